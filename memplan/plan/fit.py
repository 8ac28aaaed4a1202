"""Which plans fit a memory budget: `within_budget` on evaluated numbers (the plain rule: device memory
within the budget and positive; with a host budget, the offload's host memory per node within it too), and
the same decided for the table of a `PlanSpace` (memplan/plan/evaluate.py) without computing the device
memory of every plan.

The device memory grows with the step peak, so a plan fits exactly when its peak lies between two
thresholds per (t, p), found by bisection on `device_memory` itself (`block_limits`); for the derived rows
(full recompute of 3 <= k <= n - 1 layers), the k that fit are an interval computed from the moments'
lines (`part_limits`, `fit_mask`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import numpy as np

from memplan.core.errors import MemplanError
from memplan.core.specs import GpuSpec
from memplan.inventory.types import Inventory
from memplan.memory.term_bytes import PlanValues
from memplan.memory.device import device_memory
from memplan.plan.evaluate import Part
from memplan.plan.space import PlanSpace


def within_budget(evaluated: Any, budget_bytes: int, host_budget_bytes: Optional[int] = None) -> np.ndarray:
    """The plans whose device memory is within the budget (never a non-positive figure) and, with a host
    budget, whose offload's host memory per node is within that."""
    device = np.asarray(evaluated.device_bytes)
    fits = (device <= budget_bytes) & (device > 0)
    if host_budget_bytes is not None:
        fits &= np.asarray(evaluated.host_bytes_per_node) <= host_budget_bytes
    return fits


def least_device_bytes(evaluated: Any, host_budget_bytes: Optional[int] = None) -> Optional[int]:
    """The least device memory of the plans `within_budget` could take (a positive figure, the host budget met):
    some plan fits a budget exactly when this is within it; None when no plan has one."""
    device = np.asarray(evaluated.device_bytes)
    usable = within_budget(evaluated, int(device.max(initial=0)), host_budget_bytes)
    return int(device[usable].min()) if usable.any() else None

def _peak_limits(rows: PlanValues, inventory: Inventory, gpu: Optional[GpuSpec], margin: Optional[float],
                 budget_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row (its t, p and d): the lowest step peak whose device memory is positive and the highest
    whose device memory is within the budget (-1 if none): the two ends of `within_budget`, found by
    bisection on `device_memory`, which grows with the peak."""

    def device(peak: np.ndarray) -> np.ndarray:
        return np.asarray(device_memory(peak, rows, inventory, gpu, margin).total, dtype=np.int64) + 0 * peak

    shape = np.shape(rows.t)
    limit = np.int64(1 << 62)
    lo = np.full(shape, -1, dtype=np.int64)  # device(lo) <= budget, or -1
    hi = np.full(shape, max(int(budget_bytes), 1), dtype=np.int64)  # device(hi) > budget, once widened
    while True:
        low = device(hi) <= budget_bytes
        if not low.any():
            break
        if np.any(low & (hi >= limit)):
            raise MemplanError("the budget is beyond the search's 64-bit arithmetic")
        lo, hi = np.where(low, hi, lo), np.where(low, np.minimum(hi * 2, limit), hi)
    highest, _ = _bisect(lambda x: device(x) <= budget_bytes, lo, hi)
    positive_at_zero = device(np.zeros(shape, dtype=np.int64)) > 0
    _, lowest = _bisect(lambda x: device(x) <= 0, np.full(shape, -1, dtype=np.int64),
                        np.where(positive_at_zero, 0, limit))
    return lowest, highest


def _bisect(low: Callable[[np.ndarray], np.ndarray], lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Narrow lo < hi (low(lo) true or lo = -1; low(hi) false) to hi = lo + 1."""
    while np.any(hi - lo > 1):
        mid = lo + (hi - lo) // 2
        ok = low(mid)
        wide = hi - lo > 1
        lo, hi = np.where(wide & ok, mid, lo), np.where(wide & ~ok, mid, hi)
    return lo, hi


def _delta_range(lines: list[tuple[np.ndarray, np.ndarray]], limit: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each line and column, the delta >= 0 for which every moment, value + slope x delta, is at
    most `limit` (per line): [lo, hi], empty when lo > hi."""
    shape = np.broadcast_shapes(lines[0][0].shape, limit.shape)
    lo = np.zeros(shape, dtype=np.int64)
    hi = np.full(shape, np.iinfo(np.int64).max, dtype=np.int64)
    for value, slope in lines:
        room = limit - value
        up, down = slope > 0, slope < 0
        safe = np.where(up | down, slope, 1)
        hi = np.where(up, np.minimum(hi, room // safe), hi)
        lo = np.where(down, np.maximum(lo, -((-room) // safe)), lo)
        hi = np.where((room < 0) & ~up & ~down, -1, hi)
    return lo, hi


def block_limits(space: PlanSpace, inventory: Inventory, gpu: Optional[GpuSpec], margin: Optional[float],
                 budget_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """`_peak_limits` of every (t, p) block of the space."""
    return _peak_limits(space.row_plans(space.block_row), inventory, gpu, margin, budget_bytes)


def part_limits(part: Part, space: PlanSpace, limits: tuple[np.ndarray, np.ndarray]) -> None:
    """Per direct row and column, the range of delta that fits: [0, max] or empty for a row on its
    own, the interval of its derived rows for a line."""
    block = space.block[part.direct]
    lowest, highest = limits[0][block], limits[1][block]
    peak = functools.reduce(np.maximum, part.peaks)
    fits = (peak <= highest[:, None]) & (peak >= lowest[:, None])
    lo = np.zeros(peak.shape, dtype=np.int64)
    hi = np.where(fits, np.iinfo(np.int64).max, -1)
    lines = [line for i, moments in enumerate(part.moments) if all(moments is not m for m in part.moments[:i])
             for line in moments]
    if len(part.lines):
        lo[part.lines], hi[part.lines] = _delta_range(lines, highest[part.lines][:, None])
    part.limits = (lo, hi)
    if len(part.lines) and np.any(lowest[part.lines] > 0):  # peaks too small for a positive device figure
        lo0 = np.ones(peak.shape, dtype=np.int64)
        hi0 = np.zeros(peak.shape, dtype=np.int64)
        lo0[part.lines], hi0[part.lines] = _delta_range(lines, (lowest[part.lines] - 1)[:, None])
        part.limits += (lo0, hi0)


def fit_mask(part: Part, at: Any, valid: np.ndarray) -> np.ndarray:
    """Which plans of the part's rows `at` fit."""
    src, delta = part.src[at], part.delta[at][:, None]
    lo, hi = part.limits[0][src], part.limits[1][src]
    fits = valid & (delta >= lo) & (delta <= hi)
    if len(part.limits) > 2:
        fits &= ~((delta >= part.limits[2][src]) & (delta <= part.limits[3][src]))
    return fits
