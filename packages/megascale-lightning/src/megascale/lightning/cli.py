# The `megascale` command: LightningCLI over GPTModule and any LightningDataModule (TokenDataModule by
# default), plus `megascale configs` to list the example configs shipped in megascale.lightning.configs.
#
#     megascale fit --config tiny_cpu.yaml                  # a shipped config, by name
#     megascale fit --config my.yaml --trainer.max_steps 50
#     python -m megascale.lightning.cli fit --print_config   # every option (model.config.*: --model.config.help)
#     megascale configs                                     # shipped configs and their paths
#     megascale convert CHECKPOINT_DIR model.pt             # a checkpoint → one plain file for inference
#     megascale convert --from-hf HF_DIR model.pt           # a Hugging Face model → that file
#     megascale convert --to-hf checkpoints/run/ HF_DIR     # the newest checkpoint (or that file) → Hugging Face
#     megascale plan --model gpt3-175b --gpus 1024 --gpu a100 --global-batch 1536   # rank layouts (core's planner)
#
# `megascale --help` lists every subcommand (LightningCLI's four and ours) with one line each; every
# `megascale SUB --help` ends with examples. A user's mistake prints one line on stderr and exits with 2
# (`--traceback` or MEGASCALE_TRACEBACK=1: the full trace; megascale.core.cli_errors says which errors count).
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

import argparse
import difflib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megascale.core.cli_errors import (
    TRACEBACK_ENV,
    USER_ERRORS,
    UserError,
    pop_traceback_flag,
    report_user_errors,
)
from megascale.core.plan.examples import EXAMPLES as PLAN_EXAMPLES
from megascale.lightning import configs

if TYPE_CHECKING:
    from lightning.pytorch.cli import ArgsType

    from megascale.lightning.lightning_cli import MegaScaleCLI as MegaScaleCLI

# Lightning (with torch, ~10 s of CPU) is imported only by fit/validate/test/predict (megascale.lightning.
# lightning_cli): `megascale --help`, `configs` and a mistyped command answer at once.
__all__ = ["TRAINER_DEFAULTS", "MegaScaleCLI", "main"]

TRAINER_DEFAULTS: dict[str, Any] = {
    "gradient_clip_val": 1.0,
    "log_every_n_steps": 10,
    "check_val_every_n_epoch": None,
    "val_check_interval": 1000,
    "limit_val_batches": 50,
}


LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test", "predict")
# every subcommand, one line each: what `megascale --help` prints
SUBCOMMANDS: dict[str, str] = {
    "fit": "train a model (GPTModule or your own) with a YAML config and/or --section.key value overrides",
    "validate": "run the validation loop of a config (e.g. on a checkpoint: --ckpt_path)",
    "test": "run the test loop of a config",
    "predict": "run the predict loop of a config",
    "plan": "rank tp × pp × dp × ZeRO layouts of a model on a cluster; --emit-config writes a config to fit",
    "convert": "a checkpoint → one model file; Hugging Face in (--from-hf) and out (--to-hf)",
    "configs": "list the example configs shipped with megascale (megascale fit --config NAME runs one)",
}
EXAMPLES: dict[str, str] = {
    "fit": """\
  megascale fit --config tiny_cpu.yaml                        # a shipped config, by name (megascale configs)
  megascale fit --config my.yaml --trainer.max_steps 50       # a file of yours, one value overridden
  megascale fit --config tp2_dp2_cpu.yaml --print_config      # the whole resolved config, every default
  megascale fit --config my.yaml --ckpt_path last             # resume from the newest checkpoint""",
    "validate": """\
  megascale validate --config my.yaml --ckpt_path checkpoints/last.ckpt""",
    "test": """\
  megascale test --config my.yaml --ckpt_path checkpoints/last.ckpt""",
    "predict": """\
  megascale predict --config my.yaml --ckpt_path checkpoints/last.ckpt""",
    "plan": PLAN_EXAMPLES,
    "convert": """\
  megascale convert checkpoints/run/ model.pt              # the newest checkpoint → one file (load_gpt reads it)
  megascale convert --from-hf Llama-3.2-1B/ model.pt       # a Hugging Face model → that file
  megascale convert --to-hf checkpoints/run/ hf_out/       # the newest checkpoint (or that file) → Hugging Face
  megascale convert --to-hf model.pt hf_out/ --model-type qwen2 --eos-token-id 151643   # family, ids by hand""",
    "configs": """\
  megascale configs                                           # names and paths
  megascale fit --config tiny_cpu.yaml                        # run one""",
}


def _subcommand_help(name: str) -> dict[str, Any]:
    return {"epilog": "examples:\n" + EXAMPLES[name] + "\n"}


def _overview() -> str:
    rows = "\n".join(f"  {name:<10} {line}" for name, line in SUBCOMMANDS.items())
    return (
        "usage: megascale SUBCOMMAND [options]     (megascale SUBCOMMAND --help: its options and examples)\n\n"
        "Lightning-native 3D-parallel transformer training.\n\n"
        f"subcommands:\n{rows}\n\n"
        "examples:\n"
        + EXAMPLES["fit"]
        + "\n"
        + EXAMPLES["plan"].splitlines()[0]
        + "\n"
        + EXAMPLES["convert"].splitlines()[2]
        + "\n\n"
        f"A usage error prints one line; --traceback (or {TRACEBACK_ENV}=1) shows the full trace.\n"
        "Docs: docs/first-hour.md (from pip install to a fine-tuned, exported model)."
    )


def _did_you_mean(value: str, choices: Any, suffix: str = "") -> str:
    """`` (did you mean 'X'?)`` for the choice closest to ``value`` (compared without ``suffix``), or ""."""
    stems = {c.removesuffix(suffix): c for c in choices}
    close = difflib.get_close_matches(value.removesuffix(suffix), list(stems), n=1, cutoff=0.6)
    return f" (did you mean {stems[close[0]]!r}?)" if close else ""


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
        if Path(value).exists() or value.lstrip().startswith("{") or "\n" in value:
            continue  # a file, or the config itself inline (jsonargparse reads both)
        shipped = value if value.endswith(".yaml") else value + ".yaml"
        if shipped not in configs.names():
            raise FileNotFoundError(
                f"--config {value}: no such file, nor a shipped config of that name"
                f"{_did_you_mean(shipped, configs.names(), '.yaml')}; `megascale configs` lists the shipped ones"
            )
        out[j] = prefix + str(configs.path(shipped))
    return out


def _configs(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="megascale configs",
        description=SUBCOMMANDS["configs"],
        epilog="examples:\n" + EXAMPLES["configs"],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.parse_args(argv)
    print("example configs shipped with megascale-lightning (use: megascale fit --config NAME):")
    for name in configs.names():
        print(f"  {name:<22} {configs.path(name)}")


def _convert(argv: list[str]) -> None:
    from megascale.lightning.convert_cli import main as convert

    convert(argv, EXAMPLES["convert"])


def _lightning(args: ArgsType, from_command_line: bool) -> None:
    """fit / validate / test / predict: LightningCLI over GPTModule and any data module."""
    if isinstance(args, list):
        resolved = _resolve_configs(args)
        if from_command_line:
            # Rewrite the command line rather than pass args=: Lightning's DDP launcher re-runs sys.argv in
            # its child processes, and LightningCLI warns when args= and a command line are both present.
            sys.argv[1:] = resolved
            args = None
        else:
            args = resolved
    from megascale.lightning.lightning_cli import run_lightning_cli  # a missing --config said before this

    run_lightning_cli(args, TRAINER_DEFAULTS, {n: _subcommand_help(n) for n in LIGHTNING_SUBCOMMANDS})


def _dispatch(argv: ArgsType, from_command_line: bool) -> int:
    if isinstance(argv, list) and (not argv or argv[0] in ("-h", "--help")):
        print(_overview())
        return 0 if argv else 2
    command = argv[0] if isinstance(argv, list) else None
    if command == "configs":
        _configs([str(a) for a in argv[1:]])  # type: ignore[index]
        return 0
    if command == "convert":
        _convert([str(a) for a in argv[1:]])  # type: ignore[index]
        return 0
    if command == "plan":
        from megascale.core.plan.cli import main as plan

        return plan([str(a) for a in argv[1:]])  # type: ignore[index]
    if command is not None and command not in LIGHTNING_SUBCOMMANDS and not command.startswith("-"):
        raise UserError(
            f"no subcommand {command!r}{_did_you_mean(command, SUBCOMMANDS)}; `megascale --help` lists them all"
        )
    _lightning(argv, from_command_line)
    return 0


def main(args: ArgsType = None) -> int:
    """Run the ``megascale`` command on ``args`` (default: the command line); returns the exit code.

    ``megascale configs`` lists the shipped configs; ``megascale convert CKPT OUT`` writes a checkpoint's
    model as one plain file (``--from-hf``/``--to-hf``: from and to Hugging Face); ``megascale plan`` ranks
    parallel layouts by predicted memory and speed (``megascale.core.plan.cli``); fit, validate, test and
    predict go to LightningCLI. A usage error prints one line and returns 2 (``--traceback`` or
    ``MEGASCALE_TRACEBACK=1``: the full trace).
    """
    from_command_line = args is None
    argv: ArgsType = sys.argv[1:] if args is None else args
    traceback = False
    if isinstance(argv, list):
        argv, traceback = pop_traceback_flag([str(a) for a in argv])
        if traceback:  # Lightning's DDP launcher re-runs the command line (without the flag) in its children
            os.environ[TRACEBACK_ENV] = "1"
    prog = "megascale"
    if isinstance(argv, list) and argv and argv[0] in SUBCOMMANDS:
        prog += f" {argv[0]}"
    return report_user_errors(
        prog, lambda: _dispatch(argv, from_command_line), traceback=traceback, user_errors=USER_ERRORS
    )


def __getattr__(name: str) -> Any:
    if name == "MegaScaleCLI":  # the LightningCLI subclass, imported with Lightning on first use
        from megascale.lightning.lightning_cli import MegaScaleCLI

        return MegaScaleCLI
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    sys.exit(main())
