"""`megascale fit/validate/test/predict`: LightningCLI over GPTModule and any LightningDataModule.

Kept apart from megascale.lightning.cli (the command's dispatcher), which imports this module only for these
four subcommands: importing Lightning costs ~10 s of CPU that `megascale --help` or a typo should not pay.
"""

from __future__ import annotations

from typing import Any

from jsonargparse import DefaultHelpFormatter
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

from megascale.core.cli_errors import UserError
from megascale.lightning.data import TokenDataModule
from megascale.lightning.module import GPTModule

__all__ = ["MegaScaleCLI", "run_lightning_cli"]


class MegaScaleCLI(LightningCLI):
    """LightningCLI over GPTModule whose data module defaults to TokenDataModule (any subclass may be given)."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.set_defaults(
            {"data": {"class_path": f"{TokenDataModule.__module__}.{TokenDataModule.__name__}"}}
        )


class _Formatter(DefaultHelpFormatter):
    """jsonargparse's help, with the description and epilog (the examples) printed as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "".join(indent + line for line in text.splitlines(keepends=True))


def run_lightning_cli(
    args: ArgsType, trainer_defaults: dict[str, Any], subcommand_help: dict[str, dict[str, Any]]
) -> None:
    """Run MegaScaleCLI on ``args`` (None: the command line); Lightning's configuration errors are the user's."""
    try:
        MegaScaleCLI(
            GPTModule,
            LightningDataModule,  # any data module; TokenDataModule by default (add_arguments_to_parser)
            subclass_mode_data=True,
            save_config_kwargs={"overwrite": True},
            seed_everything_default=0,
            trainer_defaults=trainer_defaults,
            auto_configure_optimizers=False,
            # jsonargparse gives subcommands the main parser's formatter: set it there
            parser_kwargs={"formatter_class": _Formatter, **subcommand_help},
            args=args,
        )
    except MisconfigurationException as error:  # a Trainer flag or hook the user got wrong: one line
        raise UserError(str(error)) from error
