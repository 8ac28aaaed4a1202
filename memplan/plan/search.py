"""`search`: every plan a user could launch for a model on N GPUs (memplan/plan/space.py), evaluated as
numpy arrays by the same functions `estimate` uses (memplan/plan/evaluate.py), filtered by a memory budget
(memplan/plan/fit.py) and ranked by step time; `search_max_seq` (the longest sequence some plan fits
with), `search_presets` (several models at once), `any_fits`, and what they return (`SearchResult`, its
`Listed` rows, `Skipped`).

Every plan's fit is decided and counted, and every plan's step time computed (the ranking and the fastest
plan over the budget). `SearchResult.evaluated` (every plan's numbers, for plots) is filled on first use.
With `search(..., reference=True)` every plan is evaluated as flat arrays in chunks and sorted: the oracle
the tests compare with.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.core.specs import Config, GpuSpec
from memplan.core.training import Recompute, TrainingSpec
from memplan.inventory.assemble import training_inventory
from memplan.inventory.fp8 import check_fp8
from memplan.inventory.types import Inventory
from memplan.memory.term_bytes import PlanValues
from memplan.memory.device import MAX_COMMUNICATORS, device_memory, fraction_bytes
from memplan.plan.estimate import device_bytes
from memplan.plan.evaluate import (MEMORY_FIELDS, TIME_FIELDS, LazyEvaluated, Part, concat, evaluate, expand,
                                   host_per_node, memory_ready, row_slices, table_parts)
from memplan.plan.fit import block_limits, fit_mask, part_limits, within_budget
from memplan.plan.limits import SEQ_LIMIT, largest
from memplan.plan.space import Fixed, PlanSpace, enumerate_plans, plan_config, plan_space, space_notes, training_fixed
from memplan.plan.titan import titan_dims
from memplan.timing.step import step_time


@dataclass(frozen=True)
class Listed:
    """A row of a search's listing: a plan and the plans that fit folded into it (`FOLDING_RULE`),
    each list in the listing's order."""

    plan: int
    zero_variants: tuple[int, ...] = ()
    recompute_variants: tuple[int, ...] = ()


@dataclass
class SearchResult:
    model: ModelSpec
    gpus: int
    global_batch: int
    budget_bytes: int
    gpu: Optional[GpuSpec]
    candidates: int
    feasible: int
    seconds: float
    top: list[int]  # indices of the best feasible plans, fastest first
    nearest_miss: Optional[int]  # the least memory of all plans, when none fits
    fastest_miss: Optional[int]  # the fastest plan over the budget (if faster than the best fit)
    evaluated: Any  # Evaluated or LazyEvaluated: every plan's numbers
    training: TrainingSpec
    impl: str = "megatron"
    notes: list[str] = field(default_factory=list)
    max_seq_len: Optional[int] = None  # search --max-seq: the longest s some plan fits with
    space: Optional[PlanSpace] = None
    margin: Optional[float] = None
    exact: dict[int, dict[str, Any]] = field(default_factory=dict)  # plan number -> its `evaluate` numbers
    sort: str = "time"  # the listing's order (`arrange`): "time" (the search's ranking) or "memory"
    folded: bool = False  # whether `arrange` folded the listing's variants
    listing: Optional[list["Listed"]] = None  # set by `arrange`; else the plans of `top`, nothing folded
    distinct_fit: Optional[int] = None  # with `folded`: the rows that fit once variants are folded
    host_budget_bytes: Optional[int] = None  # host memory per node the plans' offload must fit in (--host-mem)
    gpu_assumed: Optional[str] = None  # why `gpu` was assumed (none named: memplan/api/options.py), None when named
    compiled: Optional[np.ndarray] = None  # torchtitan (memplan/plan/titan.py): per plan, torch.compile on
    float8: Optional[np.ndarray] = None  # torchtitan with --float8 any: per plan, its float8 recipe ("" bf16)
    memory_budget: Optional[np.ndarray] = None  # torchtitan: per plan, its memory-budget AC's F (NaN: none)
    async_tp: Optional[np.ndarray] = None  # torchtitan with --async-tp: per plan, async TP on (compiled, tp > 1)
    layer_ac_every: Optional[int] = None  # torchtitan: a pinned --ac selective-layer:N, as the rows name it

    def listed(self) -> list["Listed"]:
        """The plans to show, best first, each with the plans folded into it."""
        return self.listing if self.listing is not None else [Listed(i) for i in self.top]

    def config(self, i: int) -> Config:
        plans = self.space.take([i]) if self.space is not None else self.evaluated.plans.take([i])
        training = self.training.model_copy(update={name: cast(per_plan[i]) for name, per_plan, cast in (  # torchtitan
            ("compile", self.compiled, bool), ("float8", self.float8, lambda r: r or None), ("async_tp", self.async_tp, bool),
            ("memory_budget", self.memory_budget, lambda f: None if np.isnan(f) else float(f))) if per_plan is not None})
        return plan_config(self.model, training, plans, 0, self.global_batch)

    def numbers(self, i: int) -> dict[str, Any]:
        """Plan i's memory and time fields, from `evaluate` on that plan (kept for the plans shown)."""
        if i not in self.exact:
            self.exact.update(self.evaluate_plans([i]))
        return self.exact[i]

    def evaluate_plans(self, index: list[int]) -> dict[int, dict[str, Any]]:
        if self.space is None:
            e = self.evaluated
            return {i: {name: getattr(e, name)[i] if getattr(e, name) is not None else None
                        for name in MEMORY_FIELDS + TIME_FIELDS} for i in index}
        e = evaluate(self.model, self.training, self.space.take(index), self.gpu, self.global_batch, self.impl,
                     self.margin)
        return {i: {name: getattr(e, name)[j] if getattr(e, name) is not None else None
                    for name in MEMORY_FIELDS + TIME_FIELDS} for j, i in enumerate(index)}

    def row(self, i: int) -> dict[str, Any]:
        e = self.numbers(i)
        out = {
            **(config := self.config(i)).plan_summary(),
            **({"torchtitan": titan_dims(config, self.layer_ac_every)} if self.impl == "torchtitan" else {}),
            "memory": {"device_bytes": int(e["device_bytes"]), "peak_bytes": int(e["peak_bytes"]),
                       "first_stage_peak_bytes": int(e["first_stage_peak_bytes"]),
                       "last_stage_peak_bytes": int(e["last_stage_peak_bytes"]),
                       "retained_bytes": int(e["retained_bytes"]),
                       "host_bytes_per_node": int(e["host_bytes_per_node"])},
        }
        if e["step_time_s"] is not None:
            out.update(step_time_s=float(e["step_time_s"]), mfu=float(e["mfu"]),
                       tokens_per_s=float(e["tokens_per_s"]))
        return out


def search(model: ModelSpec, training: TrainingSpec, gpus: int, global_batch: int, budget_bytes: int,
           gpu: Optional[GpuSpec] = None, fixed: Fixed = Fixed(), max_tp: Optional[int] = None, top: int = 10,
           chunk: int = 1 << 18, progress: Optional[Callable[[int, int], None]] = None,
           impl: str = "megatron", margin: Optional[float] = None, reference: bool = False,
           host_budget_bytes: Optional[int] = None) -> SearchResult:
    """Evaluate every plan (reporting progress), filter by the budget, rank by step time (by memory
    when no GPU is known): the `top` fastest plans that fit, fastest first (ties: less memory, then
    the lower plan number), the fastest plan over the budget when it is faster than the best, and
    the plan that needs the least memory when none fits. See memplan/plan/evaluate.py and fit.py for how; with
    `reference`, every plan is evaluated as flat arrays in chunks (slower, the same result). With
    `host_budget_bytes`, a plan fits only when its offload's host memory per node is within it too."""
    fixed = training_fixed(model, training, fixed)
    check_fp8(training.fp8, impl, 0, gpu)
    if reference:
        out = _search_reference(model, training, gpus, global_batch, budget_bytes, gpu, fixed, max_tp, top, chunk,
                                progress, impl, margin, host_budget_bytes)
        out.notes.extend(space_notes(model, fixed))
        return out
    start = time.perf_counter()
    space = plan_space(model, gpus, global_batch, fixed, tp_limit(max_tp, gpu), impl)
    check_int64(model, training, space.max_micro_batch, impl, gpu, margin)
    inventory = training_inventory(model, impl, training.device, training)
    limits = block_limits(space, inventory, gpu, margin, budget_bytes)
    best, miss = _Best(top), _Best(1)
    feasible = done = 0
    parts: list[Part] = []
    times: list[tuple[np.ndarray, np.ndarray]] = []  # (plan numbers, step times) of each block of rows
    for part in table_parts(space, inventory.grad_lifetime == "buffer"):
        part = memory_ready(part, space, model, training, inventory)
        part_limits(part, space, limits)
        for sel in row_slices(part, chunk):
            rows = part.rows[sel]
            numbers = space.numbers(rows, part.width)
            valid = numbers >= 0
            fits = fit_mask(part, sel, valid)
            plans = space.plans2d(rows, part.width)
            if host_budget_bytes is not None:
                fits &= host_per_node(model, training, inventory, gpu, plans, fits) <= host_budget_bytes
            if gpu is not None:
                key = step_time(model, training, gpu, plans, global_batch, breakdown=False, impl=impl).step_time_s
                times.append((numbers, key))
            else:
                peaks, _ = expand(part, sel)
                key = device_memory(functools.reduce(np.maximum, peaks), plans, inventory, gpu, margin).total
            feasible += int(np.count_nonzero(fits))
            best.offer(key, numbers, fits)
            miss.offer(key, numbers, valid & ~fits)
            done += int(np.count_nonzero(valid))
            if progress is not None:
                progress(done, space.count)
        part.limits = ()
        parts.append(part)
    result = SearchResult(model, gpus, global_batch, budget_bytes, gpu, space.count, feasible, 0.0, [], None, None,
                          None, training, impl, space=space, margin=margin, host_budget_bytes=host_budget_bytes,
                          notes=space_notes(model, fixed))
    found = _Found(space, parts, model, training, inventory, gpu, global_batch, margin, impl)
    # ties of the key go to the plan that needs less memory, then to the lower plan number
    result.exact.update(found.numbers(best.numbers() + miss.numbers()))
    device = {i: int(v["device_bytes"]) for i, v in result.exact.items()}
    result.top = best.ranked(device)[:max(top, 0)]
    over = miss.ranked(device)
    if over and (not result.top or miss.key_of(over[0]) < best.key_of(result.top[0])):
        result.fastest_miss = over[0]
    if not result.top:
        result.nearest_miss = found.least_memory(chunk)
        result.exact.update(found.numbers([result.nearest_miss]))
    result.evaluated = LazyEvaluated(functools.partial(found.evaluated, times, chunk))
    result.seconds = time.perf_counter() - start
    return result


class _Best:
    """The `size` smallest keys offered (with every plan tied with the last of them), by plan number."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.keys = np.zeros(0)
        self.index = np.zeros(0, dtype=np.int64)

    def offer(self, key: np.ndarray, numbers: np.ndarray, mask: np.ndarray) -> None:
        if self.size <= 0:
            return
        k = key[mask]
        if not k.size:
            return
        if k.size > self.size:
            pick = mask & (key <= np.partition(k, self.size - 1)[self.size - 1])
            k, i = key[pick], numbers[pick]
        else:
            i = numbers[mask]
        keys = np.concatenate((self.keys, k)) if self.keys.size else k
        index = np.concatenate((self.index, i)) if self.index.size else i
        if keys.size > self.size:
            keep = keys <= np.partition(keys, self.size - 1)[self.size - 1]
            keys, index = keys[keep], index[keep]
        self.keys, self.index = keys, index

    def numbers(self) -> list[int]:
        return [int(i) for i in self.index]

    def key_of(self, i: int) -> Any:
        return self.keys[int(np.flatnonzero(self.index == i)[0])]

    def ranked(self, device: dict[int, int]) -> list[int]:
        """The plans in the order of (key, device memory, plan number)."""
        if not self.index.size:
            return []
        dev = np.array([device[int(i)] for i in self.index], dtype=np.int64)
        return [int(self.index[j]) for j in np.lexsort((self.index, dev, self.keys))]


@dataclass
class _Found:
    """What a search evaluated, for the numbers of single plans and of all of them afterwards."""

    space: PlanSpace
    parts: list[Part]
    model: ModelSpec
    training: TrainingSpec
    inventory: Inventory
    gpu: Optional[GpuSpec]
    global_batch: int
    margin: Optional[float]
    impl: str

    def memory(self, part: Part, at: Any, plans: PlanValues) -> dict[str, np.ndarray]:
        peaks, retained = expand(part, at)
        first, last, peak = peaks[0], peaks[1], functools.reduce(np.maximum, peaks)
        device = device_memory(peak, plans, self.inventory, self.gpu, self.margin).total
        host = host_per_node(self.model, self.training, self.inventory, self.gpu, plans, device)
        return dict(zip(MEMORY_FIELDS, (device, peak, first, last, retained, host)))

    def numbers(self, index: list[int]) -> dict[int, dict[str, Any]]:
        """Memory and time fields of the plans `index` (as `evaluate` gives them)."""
        index = sorted(set(int(i) for i in index))
        if not index:
            return {}
        row, col = self.space.locate(index)
        plans = self.space.take(index)
        out: dict[str, np.ndarray] = {f: np.zeros(len(index), dtype=np.int64) for f in MEMORY_FIELDS}
        for part in self.parts:
            which = np.flatnonzero(np.isin(row, part.rows))
            if not len(which):
                continue
            at = np.searchsorted(part.rows, row[which])
            values = self.memory(part, at, self.space.plans2d(row[which], part.width))
            for f, v in values.items():
                out[f][which] = np.broadcast_to(v, (len(which), part.width))[np.arange(len(which)), col[which]]
        times: dict[str, Any] = dict.fromkeys(TIME_FIELDS)
        if self.gpu is not None:
            perf = step_time(self.model, self.training, self.gpu, plans, self.global_batch, breakdown=False,
                             impl=self.impl)
            times = {f: getattr(perf, f) for f in TIME_FIELDS}
        return {i: {**{f: out[f][j] for f in MEMORY_FIELDS},
                    **{f: (None if v is None else v[j]) for f, v in times.items()}} for j, i in enumerate(index)}

    def least_memory(self, chunk: int) -> int:
        """The plan whose device memory is the least (the lowest plan number among equals)."""
        least = _Best(1)
        for part in self.parts:
            for sel in row_slices(part, chunk):
                rows = part.rows[sel]
                numbers = self.space.numbers(rows, part.width)
                device = self.memory(part, sel, self.space.plans2d(rows, part.width))["device_bytes"]
                least.offer(device, numbers, numbers >= 0)
        return int(least.index[least.keys == least.keys.min()].min())

    def evaluated(self, times: list[tuple[np.ndarray, np.ndarray]], chunk: int, name: str) -> Any:
        """A field of `SearchResult.evaluated`, for every plan in plan-number order."""
        n = self.space.count
        if name == "plans":
            return self.space.flat()
        if name in TIME_FIELDS and self.gpu is None:
            return None
        if name == "step_time_s":
            out = np.empty(n, dtype=times[0][1].dtype)
            for numbers, key in times:
                valid = numbers >= 0
                out[numbers[valid]] = key[valid]
            return out
        arrays: dict[str, np.ndarray] = {}
        for part in self.parts:
            for sel in row_slices(part, chunk):
                rows = part.rows[sel]
                numbers = self.space.numbers(rows, part.width)
                valid = numbers >= 0
                plans = self.space.plans2d(rows, part.width)
                if name in TIME_FIELDS:
                    perf = step_time(self.model, self.training, self.gpu, plans, self.global_batch, breakdown=False,
                                     impl=self.impl)
                    values = {f: getattr(perf, f) for f in TIME_FIELDS if f != "step_time_s"}
                else:
                    values = self.memory(part, sel, plans)
                for f, v in values.items():
                    if f not in arrays:
                        arrays[f] = np.empty(n, dtype=v.dtype)
                    arrays[f][numbers[valid]] = np.broadcast_to(v, numbers.shape)[valid]
        return arrays[name]


def _search_reference(model: ModelSpec, training: TrainingSpec, gpus: int, global_batch: int, budget_bytes: int,
                      gpu: Optional[GpuSpec], fixed: Fixed, max_tp: Optional[int], top: int, chunk: int,
                      progress: Optional[Callable[[int, int], None]], impl: str,
                      margin: Optional[float], host_budget_bytes: Optional[int] = None) -> SearchResult:
    """Every plan as flat arrays, evaluated in chunks, sorted: the oracle of `search`."""
    start = time.perf_counter()
    plans = enumerate_plans(model, gpus, global_batch, fixed, tp_limit(max_tp, gpu), impl)
    check_int64(model, training, int(plans.b.max()), impl, gpu, margin)
    n = len(plans.t)
    parts = []
    for lo in range(0, n, chunk):
        parts.append(evaluate(model, training, plans.take(slice(lo, lo + chunk)), gpu, global_batch, impl, margin))
        if progress is not None:
            progress(min(lo + chunk, n), n)
    evaluated = parts[0] if len(parts) == 1 else concat(plans, parts)
    return ranked(model, training, gpus, global_batch, budget_bytes, gpu, evaluated, top, impl, margin,
                  host_budget_bytes, start)


def ranked(model: ModelSpec, training: TrainingSpec, gpus: int, global_batch: int, budget_bytes: int,
           gpu: Optional[GpuSpec], evaluated: Any, top: int, impl: str, margin: Optional[float],
           host_budget_bytes: Optional[int], start: float) -> SearchResult:
    """A search of flat plans `evaluated`: those that fit by step time (memory without a GPU), memory, number."""
    fits = within_budget(evaluated, budget_bytes, host_budget_bytes)
    key = evaluated.step_time_s if evaluated.step_time_s is not None else evaluated.device_bytes
    order = np.lexsort((evaluated.device_bytes, key))
    best = [int(i) for i in order[fits[order]][:top]]
    over = order[~fits[order]]
    fastest_miss = int(over[0]) if len(over) and (not best or key[over[0]] < key[best[0]]) else None
    return SearchResult(model, gpus, global_batch, budget_bytes, gpu, len(key), int(fits.sum()),
                        time.perf_counter() - start, best, None if best else int(np.argmin(evaluated.device_bytes)),
                        fastest_miss, evaluated, training, impl, margin=margin, host_budget_bytes=host_budget_bytes)


def tp_limit(max_tp: Optional[int], gpu: Optional[GpuSpec]) -> int:
    """The largest t searched: --max-tp, else the GPUs of a node."""
    return max_tp if max_tp is not None else (gpu.gpus_per_node if gpu is not None else 8)


INT64_SAFE = 1 << 53  # bytes per GPU the vectorised int64 arithmetic holds with room for its products


def check_int64(model: ModelSpec, training: TrainingSpec, max_micro_batch: int, impl: str,
                gpu: Optional[GpuSpec] = None, margin: Optional[float] = None) -> None:
    """Refuse a space whose memory the planner's int64 arrays cannot hold (they would wrap around
    to negative bytes that "fit"). Every candidate's step peak is at most twice what one GPU holding the
    whole model with the largest micro-batch allocates (pipelines keep at most L layers' worth in
    flight, 1 + (p - 1)/(pm) < 2 with interleaving); the device total adds to it every term from the GPU
    file (memplan/memory/timeline.py device_memory): the cuBLAS workspace, the margin on both, the runtime
    of either framework and an NCCL communicator for each of the at most five groups (t, p, d, cp, ep).
    That bound is computed in Python integers."""
    if model.moe_token_dispatcher == "flex":  # needs etp ep > 1: bounded by the alltoall dispatcher's (its few
        model = model.model_copy(update=dict(moe_token_dispatcher="alltoall"))  # int / bool per token sit in the 2x)
    one_gpu = Config(model=model, training=training.model_copy(update=dict(
        micro_batch=max_micro_batch, global_batch=max_micro_batch, recompute=Recompute.NONE,
        recompute_num_layers=None, mst=1,  # MsT off: it needs recompute, and only lowers the bound; so does torchtune's
        **(dict(offload_activations=False, activation_offloader="save_on_cpu")  # offloading, which needs recompute
           if training.activation_offloader == "torchtune" else {}))))
    need = 2 * device_bytes(one_gpu, impl)  # the allocated peak's bound (no GPU: no margin, no runtime)
    if gpu is not None:
        m = gpu.fragmentation_margin if margin is None else margin
        allocated = need + gpu.step_workspace_bytes
        need = (allocated + fraction_bytes(allocated, m) + max(gpu.runtime_bytes.torch, gpu.runtime_bytes.megatron)
                + MAX_COMMUNICATORS * gpu.nccl_communicator_bytes)
    elif margin:
        need += fraction_bytes(need, margin)
    if need > INT64_SAFE:
        raise MemplanError(f"{model.name} at s={model.seq_length:,}, v={model.vocab_size:,}: up to {need:.2e} bytes per "
                           f"GPU, beyond what the search's 64-bit arithmetic holds ({INT64_SAFE:.1e}); use estimate "
                           "for one plan, or smaller sizes")


def any_fits(model: ModelSpec, training: TrainingSpec, gpus: int, global_batch: int, budget_bytes: int,
             gpu: Optional[GpuSpec] = None, fixed: Fixed = Fixed(), max_tp: Optional[int] = None,
             impl: str = "megatron", margin: Optional[float] = None, chunk: int = 1 << 18,
             host_budget_bytes: Optional[int] = None) -> bool:
    """Whether some plan fits (memory only; False when no plan divides the GPUs or the sizes are
    beyond the int64 arithmetic, which fits no budget)."""
    try:
        fixed = training_fixed(model, training, fixed)
        space = plan_space(model, gpus, global_batch, fixed, tp_limit(max_tp, gpu), impl)
        check_int64(model, training, space.max_micro_batch, impl, gpu, margin)
    except MemplanError:
        return False
    inventory = training_inventory(model, impl, training.device, training)
    limits = block_limits(space, inventory, gpu, margin, budget_bytes)
    for part in table_parts(space, inventory.grad_lifetime == "buffer"):
        part = memory_ready(part, space, model, training, inventory)
        part_limits(part, space, limits)
        for sel in row_slices(part, chunk):
            fits = fit_mask(part, sel, space.numbers(part.rows[sel], part.width) >= 0)
            if host_budget_bytes is not None and np.any(fits):
                plans = space.plans2d(part.rows[sel], part.width)
                fits &= host_per_node(model, training, inventory, gpu, plans, fits) <= host_budget_bytes
            if np.any(fits):
                return True
    return False


# search --max-seq answers a multiple of this many tokens
SEQ_STEP = 128


def search_max_seq(model: ModelSpec, training: TrainingSpec, gpus: int, global_batch: int, budget_bytes: int,
                   step: int = SEQ_STEP, **kwargs: Any) -> SearchResult:
    """The longest sequence (a multiple of `step`) that some plan fits with, and `search` at that
    length: the plans that fit there, fastest first. Memory grows with s for every plan, so the
    question "does any plan fit?" is monotone in s and a bisection answers it."""
    options = {k: kwargs[k] for k in ("gpu", "fixed", "max_tp", "impl", "margin", "chunk", "host_budget_bytes")
               if k in kwargs}

    def fits_at(s: int) -> bool:
        return any_fits(model.model_copy(update={"seq_length": s}), training, gpus, global_batch, budget_bytes,
                        **options)

    longest = largest(fits_at, step, SEQ_LIMIT)
    if longest is None:
        raise MemplanError(f"no plan of {model.name} fits in {budget_bytes:,} bytes per GPU even at s = {step}")
    result = search(model.model_copy(update={"seq_length": longest}), training, gpus, global_batch, budget_bytes,
                    **kwargs)
    return mark_max_seq(result, longest, step)


def mark_max_seq(result: SearchResult, longest: int, step: int) -> SearchResult:
    """Record on a search at `longest` that it is the longest length (a multiple of `step`) some plan fits with."""
    capped = longest + step > SEQ_LIMIT
    result.notes.append(f"the longest sequence any plan fits with: s = {longest:,} tokens (searched in multiples "
                        f"of {step}" + (f", up to memplan's cap of {SEQ_LIMIT:,}: no fit limit" if capped else "")
                        + f"); the global batch is kept in sequences, {result.global_batch:,}, so a step takes "
                        f"{result.global_batch * longest:,} tokens at that length; the plans below fit at that length")
    result.max_seq_len = longest
    return result


@dataclass(frozen=True)
class Skipped:
    """A preset `search_presets` could not search, and why (the search's own error)."""

    model: str
    gpu: Optional[str]
    reason: str


def search_presets(requests: list[tuple[ModelSpec, TrainingSpec, int, Optional[GpuSpec], int]], gpus: int,
                   max_seq: bool = False, progress: Optional[Callable[..., None]] = None,
                   **kwargs: Any) -> tuple[list[SearchResult], list[Skipped]]:
    """`search` (`search_max_seq` with `max_seq`) for several models, the "what can I train on this
    machine?" question: each request is (model, training, global batch, GPU, budget), so that each
    model is timed on its own GPU. A model the search refuses (no plan divides the GPUs, sizes
    beyond the int64 arithmetic, nothing fits at any sequence length) is returned in the skipped
    list with the search's reason. `progress` is called as progress(done, total, label=...), the
    label naming the model and its GPU."""
    results, skipped = [], []
    for model, training, global_batch, gpu, budget_bytes in requests:
        label = model.name + (f" on {gpu.name}" if gpu is not None else "")
        report = functools.partial(progress, label=label) if progress is not None else None
        run = search_max_seq if max_seq else search
        try:
            results.append(run(model, training, gpus, global_batch, budget_bytes, gpu=gpu, progress=report, **kwargs))
        except MemplanError as err:
            skipped.append(Skipped(model.name, gpu.name if gpu is not None else None, str(err)))
    if not results:
        raise MemplanError(f"no preset could be searched on {gpus} GPUs; the first, {skipped[0].model}: "
                           f"{skipped[0].reason}")
    return results, skipped
