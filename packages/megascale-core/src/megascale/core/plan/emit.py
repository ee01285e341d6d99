"""A LightningCLI config for a chosen layout: ``megascale fit --config out.yaml`` runs it.

The strategy is ``megascale.lightning.MegaScaleStrategy`` with the layout's arguments; the model is
``GPTModule`` with the planned ``GPTConfig``; the data module ``TokenDataModule`` with the sequence length and
the batch per data-parallel rank (a pipeline splits it into its microbatches; with pp = 1 Lightning
accumulates ``accumulate_grad_batches`` micro-batches). Point ``data.init_args.source`` at a corpus, or swap
the data module, before a real run.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from megascale.core.config import GPTConfig
from megascale.core.plan.cluster import ClusterSpec
from megascale.core.plan.search import Candidate

__all__ = ["lightning_config", "to_yaml"]

STRATEGY = "megascale.lightning.MegaScaleStrategy"
DATA = "megascale.lightning.TokenDataModule"


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


def lightning_config(candidate: Candidate, config: GPTConfig, seq_len: int, cluster: ClusterSpec,
                     precision: str = "bf16-mixed") -> dict[str, Any]:  # fmt: skip
    """The LightningCLI config (a dict, for ``to_yaml``) that runs ``candidate``'s layout."""
    layout, plan = candidate.layout, candidate.layout.plan
    init_args: dict[str, Any] = {"tp": plan.tp, "pp": plan.pp, "zero_stage": plan.zero_stage}
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
    }
    if layout.accumulation > 1:
        trainer["accumulate_grad_batches"] = layout.accumulation
    per_rank = layout.micro_batch_size * (plan.microbatches if plan.pp > 1 else 1)
    return {
        "trainer": trainer,
        "model": {"config": _config_dict(config)},
        "data": {"class_path": DATA, "init_args": {"seq_len": seq_len, "batch_size": per_rank}},
    }


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
