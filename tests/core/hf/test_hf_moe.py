"""Mixtures of experts from and to Hugging Face: Mixtral and Qwen3-MoE.

Tiny random models (``_tiny_hf.MOE_FAMILIES``: 2 layers, 4 experts, top-2) saved by transformers'
``save_pretrained``, which writes each expert's weights apart (``experts.{j}.w1`` / ``gate_proj`` ...), the
layout of the Hub's checkpoints:

- megascale's GPT built from them computes transformers' logits, loss and greedy tokens (fp32, 1e-5; the
  routers agree on every choice, so any wrong expert, gate/up swap or routing-weight rule shows at 1e-1);
- Hugging Face → megascale → Hugging Face gives back every tensor bit for bit and the same config, and
  transformers loads the export as the model it was;
- an expert stack sharded on its first dimension (expert parallelism) is loaded on each of 2 gloo ranks
  from that rank's experts' tensors alone;
- what megascale cannot compute or the family cannot hold is refused, naming it.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from megascale.core import GPT, GPTConfig, generate
from megascale.core.config import MoEConfig
from megascale.core.hf import (
    HFCheckpoint,
    HFWeights,
    gpt_config_from_hf,
    gpt_from_hf,
    hf_config_from_gpt,
    infer_model_type,
    load_hf_weights_,
    save_hf,
)
from tests._dist import run_distributed
from tests.core.hf._tiny_hf import VOCAB, save_tiny, tokens

ATOL = 1e-5
# (family, tied embeddings, config changes): Qwen3-MoE both with and without renormalised top-k weights
CASES = [
    pytest.param("mixtral", False, {}, id="mixtral"),
    pytest.param("qwen3_moe", True, {}, id="qwen3_moe-tied"),
    pytest.param("qwen3_moe", False, {"norm_topk_prob": True}, id="qwen3_moe-norm_topk"),
]


def _tensors(path) -> dict[str, torch.Tensor]:
    with HFCheckpoint(path) as checkpoint:
        return {name: checkpoint.read(name) for name in checkpoint}


@pytest.mark.parametrize(("family", "tie", "change"), CASES)
def test_logits_loss_and_greedy_tokens_match_transformers(family, tie, change, tmp_path):
    hf = save_tiny(family, tie, tmp_path, config=change)
    model = gpt_from_hf(tmp_path).eval()
    x = tokens()
    with torch.no_grad():
        expected = hf(x).logits
        logits = model(x)
        hf_loss = hf(x, labels=x).loss
        loss = model(x[:, :-1], x[:, 1:])
    assert (logits[..., :VOCAB] - expected).abs().max().item() <= ATOL
    assert loss.item() == pytest.approx(hf_loss.item(), abs=ATOL)

    prompt = x[:1, :6]
    want = hf.generate(prompt, max_new_tokens=20, do_sample=False)
    got = generate(model, prompt, 20, temperature=0.0)
    assert got.tolist() == want.tolist()


def test_the_moe_options_are_read_from_the_config(tmp_path):
    save_tiny("mixtral", False, tmp_path / "mixtral")
    save_tiny("qwen3_moe", False, tmp_path / "qwen3_moe", config={"norm_topk_prob": True})
    mixtral = gpt_from_hf(tmp_path / "mixtral").config
    qwen = gpt_from_hf(tmp_path / "qwen3_moe").config
    assert mixtral.moe == MoEConfig(num_experts=4, top_k=2, expert_hidden=96, score="softmax",
                                    normalize_top_k=True, aux_loss_coef=0.02)  # fmt: skip
    assert mixtral.sliding_window == 8 and mixtral.rope_theta == 1e6 and not mixtral.qk_norm
    assert qwen.moe == MoEConfig(num_experts=4, top_k=2, expert_hidden=48, normalize_top_k=True,
                                 aux_loss_coef=0.02)  # fmt: skip
    assert qwen.qk_norm and qwen.head_dim == 32 and qwen.sliding_window is None
    assert not mixtral.parallel_block and not qwen.parallel_block
    assert infer_model_type(mixtral) == "mixtral" and infer_model_type(qwen) == "qwen3_moe"


def test_the_checkpoint_holds_each_expert_apart_and_the_stacks_are_those_tensors(tmp_path):
    """The layout transformers writes, and expert j's tensors land in row j of the stacks (gate: w1, up: w3)."""
    hf = save_tiny("mixtral", False, tmp_path)
    stored = _tensors(tmp_path)
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in stored
    assert not any("gate_up_proj" in name for name in stored)
    model = gpt_from_hf(tmp_path)
    experts = model.blocks["1"].mlp.experts
    gate_up = hf.model.layers[1].mlp.experts.gate_up_proj  # transformers' in-memory fusion: [gate; up]
    assert torch.equal(torch.cat([experts.gate, experts.up], dim=1), gate_up)
    assert torch.equal(experts.down, hf.model.layers[1].mlp.experts.down_proj)
    assert torch.equal(model.blocks["1"].mlp.router.weight, hf.model.layers[1].mlp.gate.weight)


@pytest.mark.parametrize(("family", "tie", "change"), CASES)
def test_round_trip_is_bitwise_and_transformers_loads_the_export(family, tie, change, tmp_path):
    hf = save_tiny(family, tie, tmp_path / "hf", config=change)
    model = gpt_from_hf(tmp_path / "hf")
    save_hf(model, None, tmp_path / "out", model_type=family)

    original, exported = _tensors(tmp_path / "hf"), _tensors(tmp_path / "out")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    in_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    out_config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert gpt_config_from_hf(out_config) == gpt_config_from_hf(in_config) == model.config
    assert out_config["model_type"] == family

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(reloaded) is type(hf)
    assert reloaded.config.num_experts_per_tok == 2 and reloaded.config.num_local_experts == 4
    x = tokens()
    with torch.no_grad():
        assert torch.equal(reloaded(x).logits, hf(x).logits)


def test_a_megascale_moe_exports_and_transformers_agrees(tmp_path):
    """The other direction: a MoE GPT made here (no Hugging Face source) becomes a Qwen3-MoE."""
    config = GPTConfig(vocab_size=150, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, head_size=16,
                       max_seq_len=64, parallel_block=False, qk_norm=True, init_std=0.1, sliding_window=6,
                       moe=MoEConfig(num_experts=6, top_k=3, expert_hidden=40, normalize_top_k=False))  # fmt: skip
    torch.manual_seed(0)
    model = GPT(config).eval()
    save_hf(model, None, tmp_path, max_shard_size=20_000)  # family inferred: q/k norms
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_moe"
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    x = torch.randint(0, 150, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (hf(x).logits - model(x)[..., :150]).abs().max().item() <= ATOL


def test_a_model_built_on_meta_loads_in_init_weights_and_trains(tmp_path):
    """``GPT.weights_source``: what parallelize does, on one process; the routers' counters start at zero (they
    are no weights, so the loader sets them), and a training step's loss adds the balancing loss."""
    save_tiny("mixtral", False, tmp_path)
    reference = gpt_from_hf(tmp_path)
    with torch.device("meta"):
        model = GPT(gpt_config_from_hf(json.loads((tmp_path / "config.json").read_text())))
    model.to_empty(device="cpu")
    model.weights_source = HFWeights(tmp_path)
    model.init_weights()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    for m in (model, reference):
        x = tokens()
        loss = m.train()(x[:, :-1], x[:, 1:])
        assert torch.isfinite(loss)
        counts = torch.stack([b.mlp.router.tokens_per_expert for b in m.blocks.values()])
        assert counts.sum(-1).tolist() == [2 * 39 * 2] * 2  # every token's 2 choices, each layer


# ---- expert parallelism: each rank reads its experts ------------------------------------------------------


def _load_expert_shard(rank: int, world_size: int, path: str) -> dict:
    """Load the checkpoint into a GPT whose expert stacks are DTensors sharded on the experts over all ranks;
    return this rank's local stacks and which expert tensors it read."""
    import safetensors as st
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    reads: list[str] = []
    real_open = st.safe_open

    class Counting:
        def __init__(self, *args, **kwargs):
            self._inner = real_open(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self._inner, name)

        def get_slice(self, name):
            inner = self._inner.get_slice(name)
            outer = self

            class Slice:
                def get_shape(self):
                    return inner.get_shape()

                def get_dtype(self):
                    return inner.get_dtype()

                def __getitem__(self, index):
                    reads.append(name)
                    return inner[index]

            del outer
            return Slice()

        def get_tensor(self, name):
            reads.append(name)
            return self._inner.get_tensor(name)

    st.safe_open = Counting
    try:
        with HFCheckpoint(path) as checkpoint:
            config = gpt_config_from_hf(checkpoint.config)
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
        torch.manual_seed(0)
        model = GPT(config)
        for layer in (b.mlp for b in model.blocks.values()):
            experts = layer.experts
            for name in ("gate", "up", "down"):
                whole = getattr(experts, name)
                per_rank = whole.shape[0] // world_size
                shard = torch.full((per_rank, *whole.shape[1:]), float("nan"))
                setattr(experts, name, torch.nn.Parameter(DTensor.from_local(shard, mesh, [Shard(0)])))
        load_hf_weights_(model, path)
    finally:
        st.safe_open = real_open
    stacks = {
        f"{i}.{name}": getattr(b.mlp.experts, name).to_local().clone()
        for i, b in model.blocks.items()
        for name in ("gate", "up", "down")
    }
    return {"stacks": stacks, "expert_reads": sorted(n for n in reads if ".experts." in n)}


def test_an_expert_parallel_rank_reads_only_its_experts(tmp_path):
    save_tiny("qwen3_moe", False, tmp_path)
    whole = gpt_from_hf(tmp_path)
    results = run_distributed(_load_expert_shard, 2, str(tmp_path))
    for rank, result in enumerate(results):
        mine = {2 * rank, 2 * rank + 1}  # 4 experts over 2 ranks
        read = {int(n.split(".experts.")[1].split(".")[0]) for n in result["expert_reads"]}
        assert read == mine, (rank, result["expert_reads"])
        assert len(result["expert_reads"]) == 2 * 3 * 2  # layers × projections × experts, each read once
        for i, block in whole.blocks.items():
            for name in ("gate", "up", "down"):
                stack = getattr(block.mlp.experts, name)
                assert torch.equal(result["stacks"][f"{i}.{name}"], stack[2 * rank : 2 * rank + 2]), (i, name)


# ---- what is refused ----------------------------------------------------------------------------------------


def _config(tmp_path, family: str) -> dict:
    save_tiny(family, False, tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            dict(mlp_only_layers=[1]),
            r"mlp_only_layers=\[1\]: megascale's GPT has a mixture of experts in every",
        ),
        (dict(decoder_sparse_step=2), r"decoder_sparse_step=2: only every 2-th layer"),
        (dict(num_experts=0, num_local_experts=0), "without experts is dense"),
        (dict(num_experts=8), r"two different numbers of experts"),
        (dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), "remove max_window_layers"),
        (dict(shared_expert_intermediate_size=64), r"\['shared_expert_intermediate_size'\]"),  # Qwen2-MoE's
    ],
)
def test_qwen3_moe_configs_megascale_cannot_compute_are_named(change, message, tmp_path):
    config = _config(tmp_path, "qwen3_moe")
    with pytest.raises(ValueError, match=message):
        gpt_config_from_hf({**config, **change})


def test_mixtral_config_fields_are_understood_or_named(tmp_path):
    config = _config(tmp_path, "mixtral")
    # training-only noise on the router's input: accepted, the network is the same
    assert gpt_config_from_hf({**config, "router_jitter_noise": 0.1}) == gpt_config_from_hf(config)
    with pytest.raises(ValueError, match=r"\['moe_intermediate_size'\]"):  # a qwen3_moe field
        gpt_config_from_hf({**config, "moe_intermediate_size": 48})
    with pytest.raises(ValueError, match=r"num_experts_per_tok=5 for 4 experts"):
        gpt_config_from_hf({**config, "num_experts_per_tok": 5})


def test_a_fused_expert_checkpoint_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    save_tiny("mixtral", False, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    for i in range(2):
        p = f"model.layers.{i}.block_sparse_moe.experts."
        gate_up = torch.stack([torch.cat([tensors.pop(f"{p}{j}.w1.weight"), tensors.pop(f"{p}{j}.w3.weight")])
                               for j in range(4)])  # fmt: skip
        tensors[f"model.layers.{i}.mlp.experts.gate_up_proj"] = gate_up
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KeyError, match=r"experts.0.w1.weight .*holds experts fused"):
        gpt_from_hf(tmp_path)


MOE = MoEConfig(num_experts=4, top_k=2, expert_hidden=40)
BASE = dict(vocab_size=100, d_model=32, n_layers=2, n_heads=4, ffn_hidden=48, max_seq_len=32,
            parallel_block=False)  # fmt: skip


@pytest.mark.parametrize(
    ("model_type", "change", "message"),
    [
        ("mixtral", dict(), r"moe=None \(mixtral is a mixture of experts"),
        ("llama", dict(moe=MOE), r"llama is dense: try mixtral or qwen3_moe"),
        ("qwen3", dict(moe=MOE, qk_norm=True), r"qwen3 is dense"),
        ("mixtral", dict(moe=MoEConfig(4, 2, normalize_top_k=False)), "moe.normalize_top_k=False"),
        ("mixtral", dict(moe=MoEConfig(4, 2, shared_experts=1)), "moe.shared_experts=1"),
        ("qwen3_moe", dict(moe=MoEConfig(4, 2, score="sigmoid"), qk_norm=True), "moe.score='sigmoid'"),
        ("mixtral", dict(moe=MOE, qk_norm=True), "qk_norm=True"),
        ("qwen3_moe", dict(moe=MOE), "qk_norm=False"),
        ("mixtral", dict(moe=MOE, bias=True), "mixtral has no biases"),
        (
            "qwen3_moe",
            dict(moe=MOE, qk_norm=True, sliding_window=4, full_attention_every=2),
            "full_attention_every=2",
        ),
    ],
)
def test_an_export_the_family_cannot_express_names_the_option(model_type, change, message, tmp_path):
    config = GPTConfig(**{**BASE, **change})
    with pytest.raises(ValueError, match=message):
        hf_config_from_gpt(config, model_type)
    with pytest.raises(ValueError, match=message):
        save_hf(GPT(config), None, tmp_path, model_type)
    assert not (tmp_path / "config.json").exists()


def test_moved_balancing_biases_are_refused_on_export_and_zero_ones_dropped(tmp_path):
    config = GPTConfig(**BASE, moe=MoEConfig(4, 2, bias_update_rate=0.01))
    model = GPT(config)
    model.init_weights(seed=0)
    save_hf(model, None, tmp_path / "zero", "mixtral")  # untouched biases: routes as without them
    with safe_open(tmp_path / "zero" / "model.safetensors", "pt") as f:
        assert not any("bias" in name for name in f.keys())  # noqa: SIM118 (safe_open is no dict)
    with torch.no_grad():
        model.blocks["1"].mlp.router.expert_bias[2] = 0.01
    with pytest.raises(ValueError, match=r"blocks.1.mlp.router.expert_bias is not zero"):
        save_hf(model, None, tmp_path / "moved", "mixtral")


def test_a_config_with_other_experts_conflicts_with_the_checkpoint(tmp_path):
    from megascale.core.hf import config_conflicts

    save_tiny("mixtral", False, tmp_path)
    reference = gpt_from_hf(tmp_path).config
    training = GPTConfig(**{**reference.to_dict(), "moe": {**reference.to_dict()["moe"], "aux_loss_coef": 0.1,
                                                           "z_loss_coef": 1e-3, "bias_update_rate": 1e-3}})  # fmt: skip
    assert config_conflicts(training, reference) == []  # balancing options only change training
    other = GPTConfig(**{**reference.to_dict(), "moe": {**reference.to_dict()["moe"], "top_k": 1}})
    assert [c.split("=")[0] for c in config_conflicts(other, reference)] == ["moe"]
    model = GPT(other)
    with pytest.raises(ValueError, match=r"differs from .*config.json in what the network computes: moe="):
        load_hf_weights_(model, tmp_path)
