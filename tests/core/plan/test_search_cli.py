"""Layout search and ``megascale plan`` (core's command line, without Lightning): fixed parts are honoured,
a fully fixed layout is predicted as given, ``--json`` carries every prediction, ``--emit-config`` writes the
strategy's arguments, and ``--calibrate`` measures this machine."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from megascale.core import GPTConfig
from megascale.core.plan import ClusterSpec, Fixed, Workload, gpu_spec, search
from megascale.core.plan.calibrate import (
    cpu_cluster,
    measure_collectives,
    measure_matmul,
    measure_memory_bandwidth,
)
from megascale.core.plan.cli import main

GPT_7B = ["--hidden", "4096", "--layers", "32", "--heads", "32", "--vocab", "32000"]


def _workload() -> Workload:
    return Workload(GPTConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, max_seq_len=4096),
                    seq_len=4096, global_batch=256)  # fmt: skip


def test_search_honours_fixed_parts_and_ranks_by_step_time() -> None:
    cluster = ClusterSpec(gpu_spec("h100"), gpus=64)
    ranked = search(_workload(), cluster, Fixed(tp=4, activation_checkpointing="selective"))
    assert ranked and all(
        c.layout.tp == 4 and c.layout.plan.activation_checkpointing == "selective" for c in ranked
    )
    fitting = [c for c in ranked if c.fits]
    times = [c.step.step_time for c in fitting]
    assert times == sorted(times) and ranked[: len(fitting)] == fitting
    assert all(c.layout.global_batch == 256 and c.layout.gpus == 64 for c in ranked)


def test_zb1p_is_searched_when_asked_for_and_its_bubble_is_a_third_of_1f1bs() -> None:
    cluster = ClusterSpec(gpu_spec("h100"), gpus=64)
    fixed = dict(tp=8, pp=4, activation_checkpointing="none", micro_batch_size=1)
    zb = search(_workload(), cluster, Fixed(schedule="zb1p", **fixed))
    assert zb and all(c.layout.plan.schedule == "zb1p" for c in zb)

    def key(c: Any) -> tuple[Any, ...]:
        return c.layout.dp, c.layout.plan.zero_stage, c.layout.microbatches, c.layout.plan.sequence_parallel

    one = {key(c): c.step for c in search(_workload(), cluster, Fixed(schedule="1f1b", **fixed))}
    for c in zb:
        base = one[key(c)]
        assert c.step.bubble == pytest.approx(base.bubble / 3)
    assert all(c.layout.plan.schedule != "zb1p" for c in search(_workload(), cluster, Fixed(**fixed)))


def test_a_fully_fixed_layout_is_predicted_even_when_it_does_not_fit() -> None:
    cluster = ClusterSpec(gpu_spec("a100"), gpus=8)
    fixed = Fixed(tp=1, pp=1, zero_stage=0, micro_batch_size=32, activation_checkpointing="none")
    (only,) = search(_workload(), cluster, fixed)
    assert not only.fits and only.memory.total > 80e9 and only.step.step_time > 0


def test_cli_json_has_every_prediction(capsys: pytest.CaptureFixture[str]) -> None:
    code = main([*GPT_7B, "--gpus", "64", "--gpu", "h100", "--global-batch", "256", "--seq-len", "4096",
                 "--tp", "2", "--top", "3", "--json"])  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["layouts"]) == 3 and out["cluster"]["gpu"] == "h100-sxm"
    first = out["layouts"][0]
    assert first["layout"]["tp"] == 2 and first["fits"]
    assert {"step_time", "tokens_per_s", "tflops_per_gpu", "mfu", "bubble", "tp_comm", "dp_comm"} <= set(
        first["step"]
    )
    assert {"parameters", "gradients", "optimizer_state", "activations", "total"} <= set(
        first["memory_per_gpu"]
    )


def test_cli_table_and_emitted_config(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run.yaml"
    code = main(["--model", "llama2-7b", "--gpus", "16", "--gpu", "a100", "--global-batch", "64", "--seq-len",
                 "4096", "--pp", "2", "--emit-config", str(out)])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "tokens/s" in printed and " 1  tp" in printed and f"wrote {out}" in printed
    config = yaml.safe_load(out.read_text())
    strategy = config["trainer"]["strategy"]
    assert strategy["class_path"] == "megascale.lightning.MegaScaleStrategy"
    assert strategy["init_args"]["pp"] == 2
    assert (
        config["model"]["config"]["d_model"] == 4096
        and config["data"]["init_args"]["train"]["seq_len"] == 4096
    )
    args = strategy["init_args"]
    dp = 16 // (args["tp"] * args["pp"])
    per_rank = config["data"]["init_args"]["train"]["batch_size"] * config["trainer"].get(
        "accumulate_grad_batches", 1
    )
    assert per_rank * dp == 64


def test_cli_reads_a_model_file_and_refuses_bad_input(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "model.yaml"
    path.write_text(
        "model:\n  config: {vocab_size: 1000, d_model: 256, n_layers: 4, n_heads: 4, max_seq_len: 512}\n"
    )
    assert main(["--model", str(path), "--gpus", "8", "--global-batch", "16", "--top", "1"]) == 0
    assert "256" not in capsys.readouterr().err
    capsys.readouterr()
    assert main(["--model", "no-such-preset", "--gpus", "8", "--global-batch", "16"]) == 2
    assert main(["--hidden", "256", "--gpus", "8", "--global-batch", "16"]) == 2  # an incomplete shape
    assert main(["--model", "llama-3-8b", "--gpus", "8", "--global-batch", "16"]) == 2
    assert main(["--model", "missing/config.json", "--gpus", "8", "--global-batch", "16"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("megascale plan: error: --model 'no-such-preset' is neither a preset nor a file")
    assert err[2] == "megascale plan: error: the shape needs all of --hidden, --layers, --heads and --vocab"
    assert "did you mean 'llama3-8b'?" in err[4]
    assert err[6] == "megascale plan: error: --model missing/config.json: no such file"


def test_calibration_measures_this_machine_and_plans_cpu_ranks() -> None:
    assert measure_matmul(n=256, repeats=2) > 1e8
    assert measure_memory_bandwidth(mib=16, repeats=2) > 1e8
    bus, call, p2p = measure_collectives(ranks=2, mib=1, repeats=2)
    assert bus > 1e6
    assert 0 < call < 1.0 and 0 < p2p < 1.0  # seconds of one small call, one send/receive
    from megascale.core.plan.calibrate import Calibration

    calibration = Calibration(measure_matmul(n=256, repeats=2), 5e9, bus, 1, 2, "float32", call, p2p)
    cluster = cpu_cluster(calibration, ranks=2)
    assert cluster.gpu.call_latency == call and cluster.gpu.p2p_latency == p2p and not cluster.gpu.overlap
    workload = Workload(GPTConfig(vocab_size=256, d_model=64, n_layers=4, n_heads=4, max_seq_len=64), seq_len=64,
                        global_batch=8, precision="32-true")  # fmt: skip
    ranked = search(workload, cluster)
    assert ranked[0].fits and ranked[0].step.step_time > 0


def test_refusals_name_the_real_cause(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--model", "llama3-8b", "--global-batch", "64", "--top", "1"]
    assert main([*base, "--gpus", "16", "--tp", "8", "--pp", "4", "--dp", "1"]) == 2
    err = capsys.readouterr().err
    assert "tp × pp × dp = 8 × 4 × 1 = 32 GPUs, but --gpus is 16" in err and "global batch" not in err
    assert main([*base, "--gpus", "16", "--dp", "3"]) == 2
    assert "dp=3 = 3 does not divide the 16 GPUs" in capsys.readouterr().err
    # states dominate and ZeRO would shard them: say so, not "lower the global batch"
    assert main(["--model", "llama2-7b", "--gpus", "8", "--global-batch", "64", "--tp", "1", "--pp", "1",
                 "--zero-stage", "0", "--top", "1"]) == 1  # fmt: skip
    err = capsys.readouterr().err
    assert "the model states dominate: a higher ZeRO stage (--zero-stage 3" in err
    assert "a smaller global batch would not help" in err


def test_help_states_the_default_gpu_and_shows_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default: h100" in text and "examples: megascale plan --model" in text and "--cpu-trial" in text


def test_long_sequences_are_searched_with_context_parallelism_and_short_ones_are_not() -> None:
    from megascale.core.parallel import ParallelPlan
    from megascale.core.plan import Layout, predict_memory
    from megascale.core.plan.presets import load_model

    config = load_model("llama3-8b")
    cluster = ClusterSpec(gpu_spec("h100"), gpus=64, gpus_per_node=8)
    long = Workload(config, seq_len=131072, global_batch=16)
    best = search(long, cluster, top=1)[0]
    assert best.fits and best.layout.plan.cp > 1, best.layout.describe()
    assert best.layout.plan.tp * best.layout.plan.cp <= 8  # the cp group within a node, next to tp
    assert best.step.cp_comm > 0 and "cp" in best.layout.describe()
    # activations fall as 1/cp, but for the keys/values a full layer gathers (s per sequence, not s/cp: for
    # Llama 3 8B 4 KiB per token beside ~130 KiB of the rest, so 1/cp + ~3% of one process's at cp4)
    acts = {}
    for cp in (1, 2, 4):
        plan = ParallelPlan(cp=cp, zero_stage=1)
        acts[cp] = predict_memory(long, Layout(plan, dp=64 // cp, micro_batch_size=1)).peak.activations
    for cp in (2, 4):
        assert 1 / cp <= acts[cp] / acts[1] <= 1 / cp + 0.04, (cp, acts[cp] / acts[1])
    short = Workload(config, seq_len=4096, global_batch=64)
    assert all(c.layout.plan.cp == 1 for c in search(short, cluster))


def test_cli_fixes_cp_and_the_emitted_configs_carry_it(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    run, trial = tmp_path / "run.yaml", tmp_path / "trial.yaml"
    code = main(["--model", "llama3-8b", "--gpus", "16", "--global-batch", "16", "--seq-len", "32768",
                 "--cp", "4", "--top", "1", "--emit-config", str(run), "--cpu-trial", str(trial)])  # fmt: skip
    assert code == 0, capsys.readouterr()
    assert " cp4 " in capsys.readouterr().out
    assert yaml.safe_load(run.read_text())["trainer"]["strategy"]["init_args"]["cp"] == 4
    small = yaml.safe_load(trial.read_text())
    args = small["trainer"]["strategy"]["init_args"]
    assert args["cp"] == 2 and small["trainer"]["devices"] <= 4
    assert small["data"]["init_args"]["train"]["seq_len"] % (2 * args["cp"] * args["tp"]) == 0
    code = main(
        ["--model", "llama3-8b", "--gpus", "16", "--global-batch", "16", "--seq-len", "32766", "--cp", "4"]
    )
    assert code == 2 and "multiple of 8" in capsys.readouterr().err
