"""Lazy re-exports for a package's ``__init__`` (PEP 562): a public name imports its module on first use, so
importing one light submodule (a console script's error helper, its help text) does not import torch."""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any


class _LazyPackage(types.ModuleType):
    """A package whose public names are imported on first use (``_lazy_names``: name -> module)."""

    _lazy_names: dict[str, str]

    def __getattr__(self, name: str) -> Any:  # only for names not yet set
        module = self.__dict__.get("_lazy_names", {}).get(name)
        if module is None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        self.__dict__[name] = value  # once: later lookups find it directly
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        # Importing submodule ``search`` sets the package's ``search`` to that module; where the public name is
        # a function of that module (``plan.search``), the function must win, as it does with eager imports.
        if (
            isinstance(value, types.ModuleType)
            and self.__dict__.get("_lazy_names", {}).get(name) == value.__name__
        ):
            value = getattr(value, name)
        super().__setattr__(name, value)

    def __dir__(self) -> list[str]:
        return sorted({*self.__dict__, *self.__dict__.get("_lazy_names", {})})


def lazy_exports(package: str, names: dict[str, str]) -> None:
    """Make ``package`` (call from its ``__init__``) import each of ``names`` (name -> module) on first use."""
    module = sys.modules[package]
    module.__class__ = _LazyPackage
    module.__dict__["_lazy_names"] = dict(names)
