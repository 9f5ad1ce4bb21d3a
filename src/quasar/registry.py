"""The one registry idiom: a table from a name to "module:function", imported on first use.

    VERIFIERS = {"w8a8": "quasar.verifiers.quantized:load_w8a8", ...}
    load = lookup(VERIFIERS, "w8a8", "verifier")

A new kind is a new module and one line in its table; nothing is imported until it is asked for, and the
table itself shows every name a user may give.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lookup(table: Mapping[str, str], name: str, kind: str, choices: str | None = None) -> Callable[..., Any]:
    """The function that `table` names for `name`; an unknown name raises ValueError listing the choices."""
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; choose from {choices or ', '.join(table)}")
    module, _, function = table[name].partition(":")
    return getattr(importlib.import_module(module), function)
