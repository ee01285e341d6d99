"""GPTModule with ``GPTConfig.fp8`` trains in fp8 under any Trainer: the module converts the GPT it builds.

The GPT itself no longer converts (fp8 lives above the model: issue 38); under MegaScaleStrategy
``parallelize`` converts the split layers again, as before.
"""

from __future__ import annotations

import pytest
import torch

from megascale.core import GPTConfig
from megascale.lightning import GPTModule
from tests.core._tiny import TINY_GQA_GPT

pytest.importorskip("torchao.float8")


def test_a_gpt_module_with_fp8_builds_its_gpt_with_fp8_gemms():
    from megascale.core.fp8 import _Float8Group

    def converted(module: GPTModule) -> int:
        module.configure_model()
        return sum(isinstance(m, _Float8Group) for m in module.model.modules())

    config = {**TINY_GQA_GPT, "d_model": 64}
    module = GPTModule(GPTConfig(**config, fp8="rowwise"))
    assert converted(module) > 0
    assert converted(GPTModule(GPTConfig(**config))) == 0
    with torch.device("meta"):  # a strategy's empty init: converted on the meta device too
        assert converted(GPTModule(GPTConfig(**config, fp8="rowwise"))) > 0
    tokens = torch.randint(0, 60, (2, 16))
    loss = module.model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    assert torch.isfinite(loss)
