"""LightningCLI configs for a chosen layout: ``megascale fit --config out.yaml`` runs them as written.

``lightning_config``: the planned run. The strategy is ``megascale.lightning.MegaScaleStrategy`` with the
layout's arguments; the model ``GPTModule`` with the planned ``GPTConfig``, AdamW and a learning rate by
size (3e-4 below 10B parameters as Llama 2 and 3 used, 1.5e-4 below 100B, 6e-5 above as GPT-3 175B), warm-up
over the first 10% of ``max_steps``; the data megascale-data's ``WebDataModule`` on the standard library's
shards (``megascale-data stdlib``), tokenized to fit the vocabulary: bytes (257 ids) for a vocabulary that
small, the model's own tokenizer when its Hugging Face directory has one, otherwise a BPE of the model's
vocabulary size trained on those shards (``megascale-data tokenizer``). A ModelCheckpoint keeps ``last.ckpt``.
The data a real run needs replaces ``data.init_args.*.sources``.

``cpu_trial``: the same run shrunk to this machine — the same kind of model (norm, activation, block, heads
per key/value head, windows, biases) 64 wide with two layers per pipeline stage, the same strategy at tp and
pp of at most 2 on at most 4 CPU processes (a mixture of experts: at most 4 experts, ep within the trial's
data-parallel ranks), float32, 10 steps on the same shards: it checks the config, the
strategy and the data path in a minute before GPUs are spent on them.
"""

from __future__ import annotations

import copy
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from megascale.core.config import GPTConfig
from megascale.core.plan.cluster import ClusterSpec
from megascale.core.plan.search import Candidate

__all__ = ["cpu_trial", "lightning_config", "preparation", "to_yaml", "tokenizer_for"]

STRATEGY = "megascale.lightning.MegaScaleStrategy"
DATA = "megascale.data.WebDataModule"
CHECKPOINT = "lightning.pytorch.callbacks.ModelCheckpoint"
STDLIB = ".cache/megascale/stdlib"
BYTE_VOCAB = 257  # megascale-data's byte tokenizer: 256 bytes + end of document


def tokenizer_for(config: GPTConfig, model_spec: str | None) -> str:
    """What tokenizes the data for ``config``: "bytes" when 257 ids fit the vocabulary, the directory of the
    model's config.json when a tokenizer.json lies beside it, else a BPE of the vocabulary's size trained by
    ``megascale-data tokenizer`` (``preparation`` gives the command)."""
    if config.vocab_size <= BYTE_VOCAB:
        return "bytes"
    if model_spec is not None:
        directory = Path(model_spec).parent
        if Path(model_spec).is_file() and (directory / "tokenizer.json").is_file():
            return str(directory)
    return f".cache/megascale/bpe-{config.vocab_size}"


def preparation(tokenizer: str, vocab_size: int) -> list[str]:
    """The commands to run once before ``megascale fit`` on an emitted config: the data, and the BPE."""
    commands = [f"megascale-data stdlib --output {STDLIB}"]
    if tokenizer.startswith(".cache/megascale/bpe-"):
        commands.append(f"megascale-data tokenizer --output {tokenizer} --vocab-size {vocab_size}")
    return commands


def _config_dict(config: GPTConfig) -> dict[str, Any]:
    """The fields that differ from GPTConfig's defaults (what a reader needs), plus the shape."""
    default = GPTConfig()
    shape = {"vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"}
    out: dict[str, Any] = {}
    for f in fields(GPTConfig):
        value = getattr(config, f.name)
        if f.name in shape or value != getattr(default, f.name):
            out[f.name] = value.__dict__.copy() if hasattr(value, "__dataclass_fields__") else value
    return out


def _lr(parameters: float) -> float:
    return 3e-4 if parameters < 10e9 else 1.5e-4 if parameters < 100e9 else 6e-5


def _data(seq_len: int, batch_size: int, tokenizer: str, num_workers: int) -> dict[str, Any]:
    def stream(split: str) -> dict[str, Any]:
        out: dict[str, Any] = {"sources": [{"urls": f"{STDLIB}/{split}-*.tar"}], "seq_len": seq_len,
                               "batch_size": batch_size, "num_workers": num_workers if split == "train" else 0}  # fmt: skip
        if tokenizer != "bytes":
            out["tokenizer"] = tokenizer
        return out

    return {
        "class_path": DATA,
        "init_args": {"train": stream("train"), "val": stream("val"), "val_batches": 4},
    }


def lightning_config(candidate: Candidate, config: GPTConfig, seq_len: int, cluster: ClusterSpec,
                     precision: str = "bf16-mixed", *, tokenizer: str = "bytes", max_steps: int = 1000,
                     parameters: float = 0.0) -> dict[str, Any]:  # fmt: skip
    """The LightningCLI config (a dict, for ``to_yaml``) that runs ``candidate``'s layout for ``max_steps``
    (module docstring); ``parameters`` (the model's count) chooses the learning rate."""
    layout, plan = candidate.layout, candidate.layout.plan
    init_args: dict[str, Any] = {"tp": plan.tp, "pp": plan.pp, "zero_stage": plan.zero_stage}
    if plan.cp > 1:
        init_args["cp"] = plan.cp
    if plan.ep > 1:
        init_args["ep"] = plan.ep
        if plan.zero_stage == 1:
            init_args["zero1_sharding"] = plan.zero1_sharding
    if plan.pp > 1:
        init_args.update(num_microbatches=plan.microbatches, schedule=plan.schedule)
        if plan.virtual_stages > 1:
            init_args["virtual_stages"] = plan.virtual_stages
    if plan.tp > 1:
        init_args["sequence_parallel"] = plan.sequence_parallel
    init_args["activation_checkpointing"] = plan.activation_checkpointing
    devices = min(cluster.gpus_per_node, layout.gpus)
    trainer: dict[str, Any] = {
        "accelerator": "gpu" if cluster.gpu.name != "cpu" else "cpu",
        "devices": devices,
        "num_nodes": -(-layout.gpus // devices),
        "precision": precision,
        "strategy": {"class_path": STRATEGY, "init_args": init_args},
        "max_steps": max_steps,
        "val_check_interval": min(1000, max_steps),
        "callbacks": [{"class_path": CHECKPOINT, "init_args": {
            "dirpath": "checkpoints/plan", "every_n_train_steps": max(1, max_steps // 2), "save_last": True}}],
    }  # fmt: skip
    if layout.accumulation > 1:
        trainer["accumulate_grad_batches"] = layout.accumulation
    per_rank = layout.micro_batch_size * (plan.microbatches if plan.pp > 1 else 1)
    model = {"config": _config_dict(config), "optimizer": "adamw", "lr": _lr(parameters),
             "warmup_steps": max(1, max_steps // 10), "weight_decay": 0.1, "betas": [0.9, 0.95]}  # fmt: skip
    return {"trainer": trainer, "model": model, "data": _data(seq_len, per_rank, tokenizer, num_workers=1)}


def _small(config: GPTConfig, layers: int, tp: int, vocab: int) -> GPTConfig:
    """``config``'s kind of network, 64 wide with ``layers`` layers, 4 query heads split by ``tp``."""
    group = max(1, config.n_heads // config.kv_heads)  # query heads per key/value head, kept where possible
    kv = max(tp, 4 // group)
    window = None if config.sliding_window is None else min(config.sliding_window, 32)
    every = config.full_attention_every
    moe = config.moe
    if moe is not None:  # at most 4 experts of the small width, the same routing
        experts = min(moe.num_experts, 4)
        moe = replace(moe, num_experts=experts, top_k=min(moe.top_k, experts), expert_hidden=None,
                      shared_experts=min(moe.shared_experts, 1))  # fmt: skip
    return replace(config, moe=moe, vocab_size=vocab, d_model=64, n_layers=layers, n_heads=4, n_kv_heads=kv,
                   head_size=16 if config.head_size is not None else None, ffn_hidden=None, ffn_multiple_of=32,
                   max_seq_len=64, sliding_window=window, full_attention_every=None if every is None else min(every, layers),
                   rope_scaling=None, kernels={})  # fmt: skip


def cpu_trial(
    emitted: dict[str, Any], candidate: Candidate, config: GPTConfig, steps: int = 10
) -> dict[str, Any]:
    """``emitted`` (a ``lightning_config``) shrunk to run on this machine's CPU in a minute (module
    docstring): same strategy at tp, pp <= 2 and at most 4 processes, a small model of the same kind."""
    plan = candidate.layout.plan
    cp = min(plan.cp, 2)  # context parallelism tried at cp2, within the 4 processes
    tp, pp = min(plan.tp, 2), min(plan.pp, 2 if cp == 1 else 1)
    if cp > 1 and tp * cp > 4:
        tp = 1
    dp = max(1, min(candidate.layout.dp, 4 // (tp * pp * cp)))
    virtual = plan.virtual_stages if pp > 1 and plan.schedule == "interleaved" else 1
    out = copy.deepcopy(emitted)
    train = out["data"]["init_args"]["train"]
    tokenizer = train.get("tokenizer", "bytes")
    real_tokenizer = not tokenizer.startswith(".cache/megascale/bpe-")  # bytes, or the model's own
    vocab = config.vocab_size if real_tokenizer else BYTE_VOCAB
    small = _small(config, 2 * pp * virtual, tp, vocab)
    out["model"]["config"] = _config_dict(small)
    out["model"].update(lr=1e-3, warmup_steps=2)
    strategy = out["trainer"]["strategy"]["init_args"]
    strategy.update(tp=tp, pp=pp)
    if cp > 1:
        strategy["cp"] = cp
    if plan.ep > 1:  # the largest ep within the trial's dp that splits its experts
        assert small.moe is not None
        experts = small.moe.num_experts
        strategy["ep"] = max(e for e in range(1, dp + 1) if dp % e == 0 and experts % e == 0 and e <= plan.ep)
        if strategy["ep"] == 1:
            strategy.pop("ep")
    if pp > 1:
        strategy["num_microbatches"] = 2 * pp
        if plan.schedule == "interleaved" and pp < plan.pp:
            strategy["virtual_stages"] = virtual
    else:
        for key in ("num_microbatches", "schedule", "virtual_stages"):
            strategy.pop(key, None)
    if tp == 1:
        strategy.pop("sequence_parallel", None)
    if strategy.get("zero_stage") == 3 and pp > 1:
        strategy["zero_stage"] = 2
    out["trainer"].update(accelerator="cpu", devices=tp * pp * cp * dp, num_nodes=1, precision="32-true",
                          max_steps=steps, val_check_interval=steps, limit_val_batches=2, log_every_n_steps=1,
                          num_sanity_val_steps=0)  # fmt: skip
    out["trainer"]["callbacks"][0]["init_args"].update(
        dirpath="checkpoints/plan-cpu-trial", every_n_train_steps=steps
    )
    if "accumulate_grad_batches" in out["trainer"]:
        out["trainer"]["accumulate_grad_batches"] = 2
    per_rank = 2 * (2 * pp if pp > 1 else 1)
    out["data"] = _data(64, per_rank, tokenizer if real_tokenizer else "bytes", num_workers=0)
    return out


def to_yaml(config: dict[str, Any], header: str = "") -> str:
    """YAML text of ``config`` (PyYAML when installed, else JSON, which YAML reads too), after ``header``
    lines written as comments."""
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    try:
        import yaml
    except ImportError:
        import json

        return comment + json.dumps(config, indent=2) + "\n"
    return comment + yaml.safe_dump(config, sort_keys=False)
