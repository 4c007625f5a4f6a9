"""A package's public names imported on first use (PEP 562), so that importing the package stays cheap.

Example::

    >>> namespace = {"__name__": "pkg"}
    >>> getattr_, dir_ = lazy_names(namespace, {"sqrt": "math"})
    >>> getattr_("sqrt")(4.0), "sqrt" in namespace
    (2.0, True)
    >>> getattr_("cos")
    Traceback (most recent call last):
    ...
    AttributeError: module 'pkg' has no attribute 'cos'
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(
    namespace: dict[str, Any], homes: Mapping[str, str]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of a package lazily holding `homes` (name -> module)."""

    def __getattr__(name: str) -> object:
        if name not in homes:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(homes[name]), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *homes})

    return __getattr__, __dir__
