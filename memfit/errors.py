"""Errors memfit raises for the user's input or environment (shown without a traceback)."""

from __future__ import annotations

import importlib
from types import ModuleType


class MemfitError(Exception):
    """A problem the user can fix; the CLI prints the message and exits with status 2."""


class MissingPackageError(MemfitError, ImportError):
    """An optional dependency that a chosen strategy needs is not installed."""


def require(module: str, purpose: str, install: str | None = None) -> ModuleType:
    """Import an optional dependency, or say which package to install for what."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingPackageError(f"{purpose} needs the '{install or module}' package: "
                                  f"pip install {install or module} ({exc})") from None
