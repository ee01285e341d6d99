"""The throughput model against every row of Megatron-LM 2021's weak-scaling table (Narayanan et al. 2021,
arXiv 2104.04473, Table 1; ``megascale/core/plan/data``), with one calibration for the whole table.

For each row, at its published layout (``published.py`` states what the table leaves out: micro-batch 1,
1F1B, full recomputation, Megatron-LM's kernels and runtime of 2021): the predicted TFLOP/s per GPU, counted as
the paper counts them, within ±10% of the published figure, with the shipped ``MATMUL_EFFICIENCY`` (which
must be the table's own least-squares fit); the layout predicted to fit in 80 GB; and the planner's own first
choice for the same workload and cluster predicted at least as fast. Pure arithmetic: no process, no GPU.
"""

from __future__ import annotations

import pytest

from megascale.core.plan import MATMUL_EFFICIENCY, predict_memory, predict_step, search
from megascale.core.plan.published import (
    MegatronRow,
    fit_matmul_efficiency,
    megatron_2021_table,
    predicted_tflops,
)

ROWS = megatron_2021_table()
TOLERANCE = 0.10


def test_the_table_is_complete() -> None:
    assert [r.params_billion for r in ROWS] == [1.7, 3.6, 7.5, 18.4, 39.1, 76.1, 145.6, 310.1, 529.6, 1008.0]


def test_the_shipped_calibration_is_the_tables_fit() -> None:
    assert fit_matmul_efficiency(ROWS) == pytest.approx(MATMUL_EFFICIENCY, abs=0.01)


@pytest.mark.parametrize("row", ROWS, ids=[f"{r.params_billion:g}B" for r in ROWS])
def test_published_tflops_within_10_percent(row: MegatronRow) -> None:
    predicted = predicted_tflops(row)
    assert abs(predicted / row.tflops_per_gpu - 1) <= TOLERANCE, f"{predicted:.1f} vs {row.tflops_per_gpu}"


@pytest.mark.parametrize("row", ROWS, ids=[f"{r.params_billion:g}B" for r in ROWS])
def test_published_layout_fits_and_the_first_choice_is_at_least_as_fast(row: MegatronRow) -> None:
    workload, layout, cluster = row.workload(), row.layout(), row.cluster()
    assert predict_memory(workload, layout).total <= 80e9
    assert predict_memory(workload, layout).total <= cluster.usable_memory
    published = predict_step(workload, layout, cluster).step_time
    (best,) = search(workload, cluster, top=1)
    assert best.fits and best.step.step_time <= published
