# The `megascale` command: LightningCLI over GPTModule and any LightningDataModule (TokenDataModule by
# default), plus `megascale configs` to list the example configs shipped in megascale.lightning.configs.
#
#     megascale fit --config tiny_cpu.yaml                  # a shipped config, by name
#     megascale fit --config my.yaml --trainer.max_steps 50
#     python -m megascale.lightning.cli fit --print_config   # every option (model.config.*: --model.config.help)
#     megascale configs                                     # shipped configs and their paths
#     megascale convert CHECKPOINT_DIR model.pt             # a checkpoint → one plain file for inference
#     megascale convert --from-hf HF_DIR model.pt           # a Hugging Face model → that file
#     megascale convert --to-hf model.pt HF_DIR --model-type qwen2   # that file (or a checkpoint) → Hugging Face
#     megascale plan --model gpt3-175b --gpus 1024 --gpu a100 --global-batch 1536   # rank layouts (core's planner)
#
# Choices where the brief left room:
# - `--config NAME` falls back to the shipped config of that name when no file NAME exists, so the examples
#   run from any directory; an existing file always wins.
# - The data module is given in subclass mode (`data.class_path`), so megascale-data's modules plug in; its
#   default is TokenDataModule. The model class is fixed (GPTModule is what strategies look into).
# - `auto_configure_optimizers=False`: the optimizer and LR schedule are GPTModule arguments (model.optimizer,
#   model.lr, ...), so LightningCLI's own `--optimizer`/`--lr_scheduler`, which would silently replace them,
#   are not offered.
# - Trainer defaults for pretraining: gradient clipping at 1.0; validation every 1000 training batches
#   counted across epochs (check_val_every_n_epoch=None), on at most 50 batches; logging every 10 steps.
#   Every one can be overridden in YAML or on the command line.

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

from megascale.lightning import configs
from megascale.lightning.data import TokenDataModule
from megascale.lightning.module import GPTModule

__all__ = ["TRAINER_DEFAULTS", "MegaScaleCLI", "main"]

TRAINER_DEFAULTS: dict[str, Any] = {
    "gradient_clip_val": 1.0,
    "log_every_n_steps": 10,
    "check_val_every_n_epoch": None,
    "val_check_interval": 1000,
    "limit_val_batches": 50,
}


class MegaScaleCLI(LightningCLI):
    """LightningCLI over GPTModule whose data module defaults to TokenDataModule (any subclass may be given)."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.set_defaults(
            {"data": {"class_path": f"{TokenDataModule.__module__}.{TokenDataModule.__name__}"}}
        )


def _resolve_configs(argv: list[str]) -> list[str]:
    """``--config NAME`` → the shipped config's path when NAME is not an existing file but a shipped name."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--config" and i + 1 < len(out):
            j, value, prefix = i + 1, out[i + 1], ""
        elif arg.startswith("--config="):
            j, value, prefix = i, arg[len("--config=") :], "--config="
        else:
            continue
        if not Path(value).exists() and value in configs.names():
            out[j] = prefix + str(configs.path(value))
    return out


def _print_configs() -> None:
    print("example configs shipped with megascale-lightning (use: megascale fit --config NAME):")
    for name in configs.names():
        print(f"  {name:<22} {configs.path(name)}")


def _convert(argv: list[str]) -> None:
    import argparse

    from megascale.core.hf import MODEL_TYPES
    from megascale.lightning.checkpoint_io import convert_from_hf, convert_to_hf, convert_to_torch

    parser = argparse.ArgumentParser(
        prog="megascale convert",
        description="Turn a MegaScaleStrategy checkpoint directory into one plain file for inference: "
        "{'config': GPTConfig dict, 'state_dict': weights}, loadable with torch.load(weights_only=True) "
        "and megascale.lightning.checkpoint_io.load_gpt. --from-hf writes that file from a Hugging Face model "
        "directory; --to-hf writes a Hugging Face model directory from that file or a checkpoint "
        "(both need pip install 'megascale-core[hf]').",
    )
    direction = parser.add_mutually_exclusive_group()
    direction.add_argument("--from-hf", action="store_true", help="SOURCE is a Hugging Face model directory")
    direction.add_argument(
        "--to-hf", action="store_true", help="OUTPUT is a Hugging Face model directory to write"
    )
    parser.add_argument("source", help="checkpoint directory (e.g. checkpoints/run/last.ckpt), or see above")
    parser.add_argument("output", help="file to write, e.g. model.pt; with --to-hf a directory")
    parser.add_argument(
        "--model-type", choices=MODEL_TYPES, default=None, help="with --to-hf: the family (default llama)"
    )
    parser.add_argument(
        "--max-shard-size",
        default=None,
        help="with --to-hf: bytes per safetensors file, e.g. 2GB (default 5GB)",
    )
    ns = parser.parse_args(argv)
    if not ns.to_hf and (ns.model_type is not None or ns.max_shard_size is not None):
        parser.error("--model-type and --max-shard-size go with --to-hf")
    if ns.to_hf:
        files = convert_to_hf(
            ns.source,
            ns.output,
            model_type=ns.model_type or "llama",
            max_shard_size=ns.max_shard_size or "5GB",
        )
        size = sum(f.stat().st_size for f in files)
        print(f"wrote {ns.output}: {len(files)} files ({size / 2**20:.1f} MiB)")
        return
    out = (convert_from_hf if ns.from_hf else convert_to_torch)(ns.source, ns.output)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")


def main(args: ArgsType = None) -> None:
    """Run the CLI on ``args`` (default: the command line).

    ``megascale configs`` lists the shipped configs; ``megascale convert CKPT OUT`` writes a checkpoint's
    model as one plain file (``--from-hf``/``--to-hf``: from and to Hugging Face); ``megascale plan`` ranks
    parallel layouts by predicted memory and speed (``megascale.core.plan.cli``); anything else goes to
    LightningCLI (subcommands fit, validate, test, predict).
    """
    argv = sys.argv[1:] if args is None else args
    if isinstance(argv, list) and argv[:1] == ["configs"]:
        _print_configs()
        return
    if isinstance(argv, list) and argv[:1] == ["convert"]:
        _convert([str(a) for a in argv[1:]])
        return
    if isinstance(argv, list) and argv[:1] == ["plan"]:
        from megascale.core.plan.cli import main as plan

        raise SystemExit(plan([str(a) for a in argv[1:]]))
    if isinstance(argv, list):
        resolved = _resolve_configs(argv)
        if args is None:
            # Rewrite the command line rather than pass args=: Lightning's DDP launcher re-runs sys.argv in
            # its child processes, and LightningCLI warns when args= and a command line are both present.
            sys.argv[1:] = resolved
        else:
            args = resolved
    MegaScaleCLI(
        GPTModule,
        LightningDataModule,  # any data module; TokenDataModule by default (add_arguments_to_parser)
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        seed_everything_default=0,
        trainer_defaults=TRAINER_DEFAULTS,
        auto_configure_optimizers=False,
        args=args,
    )


if __name__ == "__main__":
    main()
