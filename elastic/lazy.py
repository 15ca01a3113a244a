"""Lazy package exports: a package's public names imported from their modules on first use.

A subpackage of the worker library (``elastic.checkpoint``, ``elastic.inprocess``, ``elastic.integrity``)
exports names whose modules import torch; ``import elastic`` must not (the agent imports the package's
contracts), so each name is imported when first looked up (PEP 562) and then cached in the package.
Standard library only.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def lazy_exports(
    package: str, attrs: Mapping[str, str], public: Iterable[str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, whose name ``n`` lives in module ``attrs[n]`` of it;
    ``public``: its ``__all__``."""
    names = list(public)

    def getattr_(name: str) -> Any:
        module = attrs.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        vars(sys.modules[package])[name] = value  # later lookups skip __getattr__
        return value

    def dir_() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return getattr_, dir_
