"""Argument checks of the ``fake_trtllm`` double: what nanobind refuses before any C++ runs.

nanobind raises ``TypeError`` for an argument it cannot convert (a wrong type, an int outside the C++
type's range); these helpers refuse the same with ``TypeError`` and let ``None`` through only where the
binding takes a ``std::optional``. Durations are ``datetime.timedelta`` (``std::chrono::milliseconds``
via nanobind stl/chrono.h). They never raise anything else and never change a value.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

# An argument the caller left out (where None is a value the binding would pass on).
NONE = object()


def check_int(name: str, value: Any, *, optional: bool = False, lo: int | None = None, hi: int | None = None) -> None:
    """An int (never a bool) within ``[lo, hi]``; ``None`` only when ``optional``."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected int, got {type(value).__name__}")
    if lo is not None and value < lo or hi is not None and value > hi:
        raise TypeError(f"{name}: {value} out of range [{lo}, {hi}]")


def check_bool(name: str, value: Any) -> None:
    """A bool (nanobind converts no int to bool)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected bool, got {type(value).__name__}")


def check_float(name: str, value: Any, *, optional: bool = False) -> None:
    """An int or float (never a bool); ``None`` only when ``optional``."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected float, got {type(value).__name__}")


def check_duration(name: str, value: Any) -> None:
    """A ``datetime.timedelta`` or ``None`` (``std::optional<std::chrono::milliseconds>``)."""
    if value is not None and not isinstance(value, timedelta):
        raise TypeError(f"{name}: expected datetime.timedelta (std::chrono::milliseconds) or None, got {type(value).__name__}")
