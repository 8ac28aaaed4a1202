"""max and min by arithmetic, for ints and numpy arrays alike: the same code serves `estimate` (scalars) and
the planner (one array element per plan) without importing numpy."""

from __future__ import annotations

from typing import Any


def maximum(x: Any, y: Any) -> Any:
    """max(x, y) by arithmetic, for ints and numpy arrays alike (no numpy import needed)."""
    return x + (y - x) * (y > x)


def minimum(x: Any, y: Any) -> Any:
    """min(x, y) by arithmetic, for ints and numpy arrays alike (no numpy import needed)."""
    return x - (x - y) * (x > y)
