"""Memory and step time of plans given as numpy arrays, with the functions `estimate` uses (`stage_memory`,
`step_events`, `device_memory`, `perf.step_time`): `evaluate` on flat arrays, one element per plan (the plain
reference), and the same numbers for the whole table of a `PlanSpace` (memplan/plan/space.py), exactly and
fast, as `search` evaluates it (`table_parts`, `memory_ready`, `expand`).

The table's functions are called on row arrays of shape (rows, 1) broadcast against column arrays of
shape (rows, columns). Integers stay integers and every float32 step time is computed element by element
as in a flat array, so each plan's numbers are the same, bit for bit, as when it is evaluated alone
(`evaluate`; tests/test_planner_exhaustive.py checks every plan of 20 spaces). Two facts make the memory
cheap, each checked while the search runs (a failed check evaluates that part of the space directly, row
by row and column by column); a third decides the fit (memplan/plan/fit.py):

- Full recompute of k = 1 .. n layers per chunk makes most rows. Every moment of the step timeline
  and the retained bytes are affine in k for 1 <= k <= n - 1 (memplan/memory/timeline.py: the saved
  layers are min(j, k) recomputed + the rest, at the critical layers n, k, k + 1 and 1; the copies
  in flight k x kept + (n - k) x kept-if-not-recomputed), so the rows of 3 <= k <= n - 1 follow
  from k = 1 and 2 as value(1) + (k - 1) x slope, exactly in integers. Per (t, p), one row of
  k = n - 1 is evaluated too and must lie on its line.
- With a gradient buffer (Megatron-LM, the torch loop) the ZeRO variant changes a moment only
  through the states, which depend on t, p and the variant: bytes(row, variant) = bytes(row, first
  variant) + bytes(r, variant) - bytes(r, first variant) for a row r of the same (t, p). Three more
  rows per (t, p), evaluated with every variant, must agree. (transformers' .grad tensors mix the
  two: their spaces, t = p = 1, are evaluated whole.)

With p = 1 the first stage is the last: one stage is evaluated. `LazyEvaluated` gives every plan's
numbers of a search (`SearchResult.evaluated`, for plots) on first use.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterator, Optional

import numpy as np

from memplan.core.model import ModelSpec
from memplan.core.specs import GpuSpec
from memplan.core.training import TrainingSpec
from memplan.inventory.assemble import training_inventory
from memplan.inventory.types import Inventory
from memplan.memory.offload import host_bytes, offloads, per_node
from memplan.memory.pipeline_multi import is_multi, one
from memplan.memory.stage import stage_memory
from memplan.memory.term_bytes import PlanValues
from memplan.memory.device import device_memory
from memplan.memory.timeline import step_events
from memplan.plan.space import PlanSpace
from memplan.timing.step import step_time


@dataclass(frozen=True)
class Evaluated:
    plans: PlanValues
    device_bytes: np.ndarray  # what the most loaded GPU needs: peak + fragmentation margin + runtime
    peak_bytes: np.ndarray  # allocated peak of a step on the most loaded GPU (max of first and last stage)
    first_stage_peak_bytes: np.ndarray
    last_stage_peak_bytes: np.ndarray
    retained_bytes: np.ndarray  # states + saved activations at the first backward (most loaded stage)
    step_time_s: Optional[np.ndarray]
    mfu: Optional[np.ndarray]
    tokens_per_s: Optional[np.ndarray]
    host_bytes_per_node: Optional[np.ndarray] = None  # host memory of a node's GPUs for their offload (0: none)


def evaluate(model: ModelSpec, training: TrainingSpec, plans: PlanValues, gpu: Optional[GpuSpec],
             global_batch: int, impl: str = "megatron", margin: Optional[float] = None,
             with_time: bool = True) -> Evaluated:
    """Memory (and step time, when a GPU is known) of every plan, vectorised, with the functions
    `estimate` uses: the step peak at the timeline's critical moments (memplan/memory/timeline.py; a test
    checks them against the walk over every layer) and what the device adds.

    Only the first and the last stage can be the most loaded when the layers are split evenly: every
    middle stage holds no more activations than the first (fewer micro-batches in flight) and the same
    layers' states without the embedding; with uneven stages the second stage too (the most loaded middle
    stage: the most micro-batches in flight of those with the middle stages' layers). A test checks this
    against `estimate`'s all-stage maximum.
    """
    inventory = training_inventory(model, impl, training.device, training)
    peaks, retained = [], []
    for stage in candidate_stages(plans):
        mem = stage_memory(model, inventory.terms, training, plans, stage, granularity=inventory.granularity,
                           layout=inventory.weight_layout)
        peaks.append(step_events(model, inventory, training, plans, mem, stage, critical=True).peak_bytes)
        retained.append(mem.total)
    peak = functools.reduce(np.maximum, peaks)
    device = device_memory(peak, plans, inventory, gpu, margin).total
    host = host_per_node(model, training, inventory, gpu, plans, device)
    step = mfu = tps = None
    if gpu is not None and with_time:
        perf = step_time(model, training, gpu, plans, global_batch, breakdown=False, impl=impl)
        step, mfu, tps = perf.step_time_s, perf.mfu, perf.tokens_per_s
    return Evaluated(plans, device, peak, peaks[0], peaks[1], functools.reduce(np.maximum, retained), step, mfu, tps,
                     host)


def candidate_stages(plans: PlanValues) -> tuple[Any, ...]:
    """The stages that can be the most loaded (`evaluate`): the first and the last, and with uneven stages the
    second (the most loaded middle one; the last when p = 2, the first when p = 1); with a multi-stage schedule every
    rank (its chunks and order differ)."""
    last = plans.p - 1
    if is_multi(plans.schedule):  # torchtitan's multi-stage schedules: any rank (one p per part), first and last first
        p = one(plans.p)
        return (0, p - 1) + tuple(range(1, p - 1))
    if plans.first_layers is None:
        return (0 * last, last)
    return (0 * last, last, last - (last > 1) * (last - 1))


def host_per_node(model: ModelSpec, training: TrainingSpec, inventory: Inventory, gpu: Optional[GpuSpec],
                  plans: PlanValues, like: Any) -> np.ndarray:
    """Host memory a node's GPUs take for their offload (memplan/memory/offload.py), for every plan, shaped as `like`:
    the GPUs of a node x the most one GPU of the first or the last stage takes (a middle stage takes no more than
    the first: fewer micro-batches in flight, no embedding), as `estimate` gives it."""
    if not offloads(training):
        return np.zeros(np.shape(like), dtype=np.int64)
    most: Any = 0
    for stage in candidate_stages(plans):
        mem = stage_memory(model, inventory.terms, training, plans, stage, granularity=inventory.granularity,
                           layout=inventory.weight_layout)
        h = host_bytes(model, inventory.terms, training, plans, mem, inventory.weight_layout).total
        most = np.maximum(most, h)
    gpus = plans.gpus
    node = per_node(most, gpus, gpu.gpus_per_node if gpu is not None else None)
    return np.broadcast_to(np.asarray(node, dtype=np.int64), np.broadcast_shapes(np.shape(node), np.shape(like)))


# --- memory of the whole space ------------------------------------------------------------------
MEMORY_FIELDS = ("device_bytes", "peak_bytes", "first_stage_peak_bytes", "last_stage_peak_bytes", "retained_bytes",
                 "host_bytes_per_node")


TIME_FIELDS = ("step_time_s", "mfu", "tokens_per_s")


@dataclass
class Part:
    """Rows of the space evaluated together, `width` columns wide (the most ZeRO variants of their
    d's). Its direct rows are evaluated by `stage_memory` and `step_events`; a derived row (full
    recompute of 3 <= k <= n - 1 layers) takes the moments of its set's rows of k = 1 ("line") and
    k = 2 as value(1) + (k - 1) x slope."""

    rows: np.ndarray  # row numbers of the space, ascending
    width: int
    direct: np.ndarray  # row numbers evaluated directly
    src: np.ndarray  # per row: position in `direct` of itself, or of its k = 1 row when derived
    delta: np.ndarray  # per row: k - 1 when derived, else 0
    derived: np.ndarray  # per row
    line_of: np.ndarray  # per direct row: its line number when it is the k = 1 row of a set with derived rows, else -1
    lines: np.ndarray  # per line: position in `direct` of the rows of k = 1
    seconds: np.ndarray  # per line: position in `direct` of the rows of k = 2
    check: np.ndarray  # positions in `direct` of rows of k = n - 1 evaluated to check the shortcut (one per block)
    # filled by _part_memory (per stage: first, last)
    peaks: list[np.ndarray] = field(default_factory=list)  # direct rows x columns: the stage's step peak
    retained: list[np.ndarray] = field(default_factory=list)  # direct rows x columns: the stage's retained bytes
    moments: list[list[tuple[np.ndarray, np.ndarray]]] = field(default_factory=list)  # per stage, per moment:
    # (value at k = 1, slope) of each line x columns
    retained_lines: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    limits: tuple[np.ndarray, ...] = ()  # per direct row x column: the range of delta that fits (lo, hi[, lo0, hi0])


# Relative costs of evaluating a part (measured on a 2-core machine): the calls themselves, and each
# element of the direct rows' memory (table: every moment on every element; separable: a few
# additions) and of every row's step time. The units (one d, p = 1 or not) are merged into one
# part, their rows padded to the widest, while that costs less than calling again.
PART_CALL_NS = 2_000_000


MEMORY_ELEMENT_NS = {"table": 250, "separable": 15}


TIME_ELEMENT_NS = 25


PART_ELEMENTS = 1 << 21  # rows x columns of a part: bounds the memory a part's arrays take


def table_parts(space: PlanSpace, separable: bool) -> list[Part]:
    """The rows in parts: those of one d always together, widest first (see PART_CALL_NS); rows of
    p = 1 apart from the others (their first stage is the last: one stage to evaluate)."""
    memory_ns = MEMORY_ELEMENT_NS["separable" if separable else "table"]
    alone = space.rows["p"] == 1
    unit_of = 2 * space.dix + alone
    units, unit_rows = np.unique(unit_of, return_counts=True)
    unit_width = space.zcount[units // 2]
    unit_direct = unit_rows - np.bincount(unit_of, weights=space.derivable, minlength=2 * len(space.zcount))[units]
    groups: list[list[int]] = []
    for kind in (1, 0):
        width = rows = 0
        start = len(groups)
        for u in np.argsort(-unit_width, kind="stable"):
            if units[u] % 2 != kind:
                continue
            w, r, dr = int(unit_width[u]), int(unit_rows[u]), float(unit_direct[u])
            padding_ns = (width - w) * (memory_ns * dr + TIME_ELEMENT_NS * r)
            if len(groups) > start and padding_ns < PART_CALL_NS and (rows + r) * width <= PART_ELEMENTS:
                groups[-1].append(int(units[u]))
                rows += r
            else:
                groups.append([int(units[u])])
                width, rows = w, r
    return [_make_part(space, np.flatnonzero(np.isin(unit_of, us)), int(space.zcount[np.array(us) // 2].max()),
                       collapse=True) for us in groups]


def _make_part(space: PlanSpace, rows: np.ndarray, width: int, collapse: bool) -> Part:
    derived = space.derivable[rows].copy() if collapse else np.zeros(len(rows), dtype=bool)
    k, n = space.rows["k"][rows], space.chunk_layers[rows]
    # in each (t, p) block, one row of k = n - 1 (of the largest n) is evaluated directly as well, to
    # check the shortcut against
    last = np.flatnonzero(derived & (k == n - 1))
    last = last[np.lexsort((-n[last], space.block[rows[last]]))]
    pick = last[np.unique(space.block[rows[last]], return_index=True)[1]]
    derived[pick] = False
    check_rows = rows[pick]
    direct = rows[~derived]
    pos = np.full(space.row_count, -1, dtype=np.int64)
    pos[direct] = np.arange(len(direct), dtype=np.int64)
    k1 = space.k1_row[rows]
    src = np.where(derived, pos[np.maximum(k1, 0)], pos[rows])
    line_rows = np.unique(k1[derived], return_index=True)[0]  # (a plain np.unique imports numpy.ma)
    line_of = np.full(len(direct), -1, dtype=np.int64)
    line_of[pos[line_rows]] = np.arange(len(line_rows), dtype=np.int64)
    return Part(rows, width, direct, src, np.where(derived, k - 1, 0), derived, line_of, pos[line_rows],
                 pos[line_rows + 1], pos[check_rows])


def _part_memory(part: Part, space: PlanSpace, model: ModelSpec, training: TrainingSpec,
                 inventory: Inventory) -> bool:
    """Evaluate the part's direct rows: the step peak and the retained bytes of both stages (one
    when every row has p = 1: the first stage is the last), and every moment of the lines. False
    when the check of the affine shortcut fails."""
    single = bool(np.all(space.rows["p"][part.direct] == 1))
    moments = None
    if inventory.grad_lifetime == "buffer":
        moments = _separable_moments(part, space, model, training, inventory, single)
    if moments is None:
        moments = _cross_moments(part, space, model, training, inventory, single)
    part.peaks, part.retained, part.moments, part.retained_lines = [], [], [], []
    holds = True
    check = part.check
    if len(check):
        k1 = space.k1_row[part.direct[check]]
        one = np.searchsorted(part.direct, k1)
        two = np.searchsorted(part.direct, k1 + 1)
        steps = (space.rows["k"][part.direct[check]] - 1)[:, None]
    for events, retained in moments:
        lines = []
        for v in events + [retained]:
            if len(check) and holds:
                first = v.at(one)
                holds = np.array_equal(v.at(check), first + (v.at(two) - first) * steps)
            lines.append(v.line(part))
        part.moments.append(lines[:-1])
        part.retained_lines.append(lines[-1])
        part.peaks.append(_Values.peak(events))
        part.retained.append(retained.full())
    if single:  # the one stage is the first and the last
        part.peaks, part.retained = part.peaks * 2, part.retained * 2
        part.moments, part.retained_lines = part.moments * 2, part.retained_lines * 2
    return holds


class _Values:
    """A moment's bytes for a part's direct rows x columns: `full` (rows x columns) or, when
    separable, row values (rows x 1) + per-block column values gathered by the rows' blocks."""

    def __init__(self, full: Optional[np.ndarray] = None, rows: Optional[np.ndarray] = None,
                 blocks: Optional[np.ndarray] = None, block_of: Optional[np.ndarray] = None,
                 peak: Optional[np.ndarray] = None) -> None:
        self._full, self.rows, self.blocks, self.block_of, self._peak = full, rows, blocks, block_of, peak

    def at(self, index: np.ndarray) -> np.ndarray:
        if self._full is not None:
            return self._full[index]
        return self.rows[index] + self.blocks[self.block_of[index]]

    def full(self) -> np.ndarray:
        return self._full if self._full is not None else self.at(np.arange(len(self.rows)))

    def line(self, part: Part) -> tuple[np.ndarray, np.ndarray]:
        """(value at k = 1, slope per layer) of each line (per block, the row values' difference)."""
        first = self.at(part.lines)
        if self._full is not None:
            return first, self._full[part.seconds] - first
        return first, self.rows[part.seconds] - self.rows[part.lines]

    @staticmethod
    def peak(events: list["_Values"]) -> np.ndarray:
        """The largest moment of each row and column. Separable moments with equal block values are
        combined first: max(a + d, b + d) = max(a, b) + d."""
        if events[0]._peak is not None:
            return events[0]._peak
        if events[0]._full is not None:
            out = events[0]._full
            for v in events[1:]:
                out = np.maximum(out, v._full)
            return out
        groups: list[tuple[np.ndarray, np.ndarray]] = []  # (block values, largest row values)
        for v in events:
            for i, (blocks, rows) in enumerate(groups):
                if np.array_equal(blocks, v.blocks):
                    groups[i] = (blocks, np.maximum(rows, v.rows))
                    break
            else:
                groups.append((v.blocks, v.rows))
        block_of = events[0].block_of
        out = None
        for blocks, rows in groups:
            x = rows + blocks[block_of]
            out = x if out is None else np.maximum(out, x)
        return out


def _stages(plans: PlanValues, single: bool) -> tuple[Any, int]:
    """The stages evaluated, as one argument: the first (= the last when every row has p = 1), or
    the first and the last (and with uneven stages the second: `candidate_stages`) stacked on a leading
    axis, so that one call evaluates them all."""
    if single:
        return 0, 1
    stages = candidate_stages(plans)
    return np.stack(np.broadcast_arrays(*stages)), len(stages)


def _by_stage(value: Any, count: int, shape: tuple[int, ...]) -> list[np.ndarray]:
    """A result of a call with `_stages`, one array of `shape` per stage."""
    return list(np.broadcast_to(value, (count,) + shape))


def _cross_moments(part: Part, space: PlanSpace, model: ModelSpec, training: TrainingSpec,
                   inventory: Inventory, single: bool) -> list[tuple[list[_Values], _Values]]:
    """Every moment for every direct row x column (`step_events` on the whole table)."""
    plans = space.plans2d(part.direct, part.width)
    shape = (len(part.direct), part.width)
    stage, count = _stages(plans, single)
    mem = stage_memory(model, inventory.terms, training, plans, stage, granularity=inventory.granularity,
                       layout=inventory.weight_layout)
    steps = step_events(model, inventory, training, plans, mem, stage, critical=True)
    events = list(zip(*(_by_stage(e.bytes, count, shape) for e in steps.events)))
    out = []
    for s, (peak, total) in enumerate(zip(_by_stage(steps.peak_bytes, count, shape),
                                         _by_stage(mem.total, count, shape))):
        values = [_Values(v) for v in events[s]]
        values[0]._peak = peak
        out.append((values, _Values(total)))
    return out


def _separable_moments(part: Part, space: PlanSpace, model: ModelSpec, training: TrainingSpec,
                       inventory: Inventory, single: bool) -> Optional[list[tuple[list[_Values], _Values]]]:
    """With a gradient buffer, the ZeRO variant changes a moment's bytes only through the states
    (weights, gradients, optimizer and its temporaries), which depend on t, p and the variant, not
    on the rest of the row: bytes(row, variant) = bytes(row, column 0) + [bytes(r, variant) -
    bytes(r, column 0)] for any row r of the same (t, p) block. So `step_events` runs on the rows
    with column 0, and on one row per block with every column; three more rows per block (spread
    over its micro-batches, chunks and recompute modes), evaluated with every column too, check the
    split (None when it does not hold: evaluate the whole table)."""
    blocks, block_of = np.unique(space.block[part.direct], return_inverse=True)
    # rows are numbered block by block, so each block's direct rows are consecutive
    r0 = np.searchsorted(block_of, np.arange(len(blocks)), side="left")
    r1 = np.searchsorted(block_of, np.arange(len(blocks)), side="right") - 1
    checks = np.concatenate([r0 + (r1 - r0) * i // 3 for i in (1, 2, 3)])
    nb = len(blocks)
    rows = space.plans2d(part.direct, 1)
    probe = space.plans2d(part.direct[np.concatenate((r0, checks))], part.width)
    results = []
    for plans in (rows, probe):
        stage, count = _stages(plans, single)
        mem = stage_memory(model, inventory.terms, training, plans, stage, granularity=inventory.granularity,
                           layout=inventory.weight_layout)
        steps = step_events(model, inventory, training, plans, mem, stage, critical=True)
        results.append([e.bytes for e in steps.events] + [mem.total])
    if len(results[0]) != len(results[1]):
        return None
    out: list[list[_Values]] = [[] for _ in range(count)]
    for x, y in zip(*results):
        xs = _by_stage(x, count, (len(part.direct), 1))
        ys = _by_stage(y, count, (4 * nb, part.width))
        for s in range(count):
            step = ys[s][:nb] - ys[s][:nb, :1]
            if not (np.array_equal(ys[s][:nb, :1], xs[s][r0])
                    and np.array_equal(ys[s][nb:], xs[s][checks] + np.tile(step, (3, 1)))):
                return None
            out[s].append(_Values(rows=xs[s], blocks=step, block_of=block_of))
    return [(values[:-1], values[-1]) for values in out]


def memory_ready(part: Part, space: PlanSpace, model: ModelSpec, training: TrainingSpec,
                 inventory: Inventory) -> Part:
    """The part with its memory evaluated (every row directly where the check of the shortcut fails)."""
    if not _part_memory(part, space, model, training, inventory):
        part = _make_part(space, part.rows, part.width, collapse=False)
        _part_memory(part, space, model, training, inventory)
    return part


def expand(part: Part, at: Any) -> tuple[list[np.ndarray], np.ndarray]:
    """Step peak of each stage evaluated (the first, the last[, the second]: `_stages`), and the retained bytes,
    of the part's rows `at`."""
    src = part.src[at]
    peaks = [p[src] for p in part.peaks]
    retained = functools.reduce(np.maximum, (r[src] for r in part.retained))
    which = np.flatnonzero(part.derived[at])
    if len(which):
        line = part.line_of[src[which]]
        delta = part.delta[at][which][:, None]
        peaks = [p.copy() for p in peaks]
        for out, moments in zip(peaks, part.moments):
            peak = None
            for value, slope in moments:
                x = value[line] + slope[line] * delta
                peak = x if peak is None else np.maximum(peak, x)
            out[which] = peak
        retained = retained.copy()
        retained[which] = functools.reduce(np.maximum, (value[line] + slope[line] * delta
                                                         for value, slope in part.retained_lines))
    return peaks, retained


def row_slices(part: Part, chunk: int) -> Iterator[slice]:
    """Consecutive rows of the part with at most `chunk` elements (at least one row)."""
    step = max(1, chunk // max(part.width, 1))
    for lo in range(0, len(part.rows), step):
        yield slice(lo, min(lo + step, len(part.rows)))


class LazyEvaluated:
    """`Evaluated` for every plan of a search, each field computed on first use from what the
    search kept (step times: a scatter into plan order; memory: the kept moments expanded), for
    plots and tests: the search itself does not need them."""

    def __init__(self, fill: Callable[[str], Any]) -> None:
        self._fill = fill

    def __getattr__(self, name: str) -> Any:
        if name not in {f.name for f in fields(Evaluated)}:
            raise AttributeError(name)
        value = self._fill(name)
        setattr(self, name, value)
        return value


def concat(plans: PlanValues, parts: list[Evaluated]) -> Evaluated:
    def cat(name: str) -> Any:
        values = [getattr(p, name) for p in parts]
        return None if values[0] is None else np.concatenate(values)

    return Evaluated(plans, *(cat(f.name) for f in fields(Evaluated) if f.name != "plans"))
