"""`search --impl torchtitan`: every torchtitan plan memplan models for a model on N GPUs (memplan/plan/titan.py),
eager and compiled, evaluated as flat arrays by the functions `estimate --impl torchtitan` uses
(memplan/plan/evaluate.py: the compiled plans with the compiled layer's inventory), filtered by the budget and ranked
by step time (memplan/timing/: FSDP2's per-layer all-gathers and per-micro-batch reduce-scatters, HSDP's all-reduce,
TP's collectives, each AC mode's recompute (memory-budget AC's traced from the partitioned graph), compile's fused kernels, with pp > 1 the pipeline's bubble and sends as
Megatron-LM's plans are timed: derived, uncalibrated). The space is small (thousands of plans), so it
is evaluated whole, as `search(..., reference=True)` evaluates Megatron-LM's."""

from __future__ import annotations

import functools
import time
from typing import Callable, Optional

import numpy as np

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.core.specs import GpuSpec
from memplan.core.training import Recompute, TrainingSpec
from memplan.inventory.assemble import training_inventory
from memplan.memory.pipeline_multi import SPLIT_BACKWARD
from memplan.plan.evaluate import concat, evaluate
from memplan.plan.fit import least_device_bytes
from memplan.plan.limits import SEQ_LIMIT, largest_under
from memplan.plan.search import SEQ_STEP, SearchResult, check_int64, mark_max_seq, ranked, tp_limit
from memplan.inventory.budget_recompute import distinct_budgets
from memplan.inventory.compiled import check_budget
from memplan.inventory.titan import BUDGET_AC, is_qwen3_dense, titan_ac_mode
from memplan.inventory.titan_float8 import RECIPES
from memplan.plan.titan import FLOAT8_ANY, TitanPins, compilable, join, pinned_every, titan_plans

IMPL = "torchtitan"


def _compile_refusal(model: ModelSpec, training: TrainingSpec) -> str:
    """Why memplan cannot plan this model compiled ("" when it can)."""
    try:
        training_inventory(model, IMPL, training.device, training.model_copy(update={"compile": True}))
    except MemplanError as err:
        return str(err)
    return ""


def _with_compile(model: ModelSpec, training: TrainingSpec, eager: list, pins: TitanPins) -> tuple[list, list[str]]:
    """The (plans, compiled) sets of `eager`'s parts with compile off and, where memplan models it, on (``training``
    with its float8 recipe), and the notes on what was left out."""
    notes: list[str] = []
    sets = []  # (plans, compiled): one per (pp, schedule) part and compile setting
    if pins.compile is not True:
        sets += [(part, False) for part in eager]
    if pins.compile is not False:
        why = _compile_refusal(model, training)
        qwen3 = is_qwen3_dense(model)  # its compiled block traced at tp 1 (memplan/inventory/compiled_qwen3.py)
        can = [compilable(part, bool(training.float8), model.num_layers, model.is_moe, qwen3) for part in eager]
        where = ("--tp 1, --ep 1, --cp 1 for MoE" if model.is_moe else "--tp 1, --cp 1 for a dense Qwen3" if qwen3 else
                 "--cp 1" + (" and --ac none, full or selective-layer (with --tp: full)" if training.float8 else ""))
        if why and pins.compile:
            raise MemplanError(why)
        if pins.compile and not any(c.any() for c in can):
            raise MemplanError(f"--compile is modelled for torchtitan with {where} (memplan/inventory/compiled.py): "
                               "no plan left")
        if why:
            notes.append(f"torch.compile not searched: {why}")
        elif any(c.any() for c in can):
            sets += [(part.take(np.flatnonzero(c)), True) for part, c in zip(eager, can) if c.any()]
            if any(str(part.schedule) in SPLIT_BACKWARD for part in eager):
                notes.append("torch.compile not searched with the split-backward pipeline schedules (I / W through a "
                             "compiled block: not modelled)")
            if not all(c.all() for part, c in zip(eager, can) if str(part.schedule) not in SPLIT_BACKWARD):
                notes.append(f"torch.compile searched with {where} only (compile with CP" + (
                    ", TP or EP" if model.is_moe else " or TP" if qwen3 else "")
                             + (", or with float8 and selective-op, or with float8, TP and AC not full,"
                                if training.float8 else "")
                             + " is not traced yet)")
    return sets, notes


def _float8_recipes(model: ModelSpec, training: TrainingSpec, gpu: Optional[GpuSpec],
                    pins: TitanPins) -> tuple[list, list[str]]:
    """The float8 recipes searched (None: bf16 linears): the pinned one (`training.float8`), or with ``--float8 any``
    bf16 and each recipe where torchtitan runs float8 (a GPU with FP8 tensor cores; a dense model: float8 with MoE is
    not modelled; rowwise only with --emit torchtitan, the recipe its converter sets), and the notes."""
    if pins.float8 != FLOAT8_ANY:
        return [training.float8], []
    if model.is_moe or pins.pp not in (None, 1):
        return [None], ["--float8 any: float8 not searched (not modelled with " + ("MoE" if model.is_moe else "--pp")
                        + " for --impl torchtitan)"]
    if pins.ac is not None and titan_ac_mode(pins.ac)[0] == BUDGET_AC:
        return [None], ["--float8 any: float8 not searched (--ac budget:F is traced with bf16 linears)"]
    if gpu is None or not gpu.peak_fp8_flops:
        return [None], [f"--float8 any: float8 not searched ({gpu.name if gpu else 'no GPU named'}: no FP8 tensor "
                        "cores in its preset)"]
    return [None, *(("rowwise",) if pins.launchable else RECIPES)], [
        "--float8 any: bf16 and the float8 recipes " + ("rowwise (the one --emit torchtitan sets)" if pins.launchable
                                                        else "tensorwise and rowwise") + " searched; float8 timed as "
        "derived from torchao's code (FP8 GEMMs, its casts' traffic), uncalibrated"]


def _budgets(model: ModelSpec, training: TrainingSpec, pins: TitanPins) -> tuple[tuple[float, ...], list[str]]:
    """The memory budgets F searched (torchtitan's MemoryBudgetAC on the compiled plans with AC none, tp 1, cp 1, bf16
    linears: what memplan/inventory/compiled.py check_budget takes): the pinned --ac budget:F, else the distinct ones
    (budget_recompute.distinct_budgets) where the model's widths are traced, and the notes."""
    mode, tenths = titan_ac_mode(pins.ac) if pins.ac is not None else ("", 0)
    if mode == BUDGET_AC:
        if pins.compile is False:
            raise MemplanError("--ac budget:F (torchtitan's memory-budget AC) compiles the blocks: drop --no-compile")
        check_budget(model, IMPL, training.model_copy(update={"compile": True, "memory_budget": tenths / 10}))
        return (tenths / 10,), []
    if pins.ac is not None or pins.compile is False:
        return (), []
    try:
        check_budget(model, IMPL, training.model_copy(update={"compile": True, "memory_budget": 0.0,
                                                             "recompute": Recompute.NONE}))
    except MemplanError as err:
        return (), [f"memory-budget AC not searched: {err}"]
    budgets = distinct_budgets()
    return budgets, [
        f"memory-budget AC (--ac budget:F) searched on the compiled plans with AC none, tp 1, cp 1 at F = "
        f"{', '.join(f'{f:g}' for f in budgets)} (the other tenths save and recompute what one of these does; F = 1 "
        "is the plain compiled block): the saved set and what the partitioner recomputes traced (memplan/inventory/"
        "budget_recompute.py), the recompute timed as derived from the traced graph, uncalibrated"]


def _budget_sets(sets: list, budgets: tuple[float, ...]) -> list:
    """Each compiled bf16 set's plans that memory-budget AC applies to (AC none, tp 1, cp 1), once per budget."""
    out = []
    for part, compiled, recipe, _ in sets:
        if not compiled or recipe is not None:
            continue
        keep = (np.asarray(part.recompute) == int(Recompute.NONE)) & (np.asarray(part.t) == 1) & (
            np.asarray(part.cp) == 1)
        if keep.any():
            out += [(part.take(np.flatnonzero(keep)), True, None, f) for f in budgets]
    return out


def search_titan(model: ModelSpec, training: TrainingSpec, gpus: int, global_batch: int, budget_bytes: int,
                 gpu: Optional[GpuSpec] = None, pins: TitanPins = TitanPins(), max_tp: Optional[int] = None,
                 top: int = 10, margin: Optional[float] = None, host_budget_bytes: Optional[int] = None,
                 progress: Optional[Callable[[int, int], None]] = None) -> SearchResult:
    """The torchtitan plans that fit the budget, fastest first (`SearchResult.compiled` says which are compiled)."""
    start = time.perf_counter()
    training = training.model_copy(update={"memory_budget": None})  # each budget's plans their own (_budgets)
    recipes, notes = _float8_recipes(model, training, gpu, pins)
    budgets, more = _budgets(model, training, pins)
    notes += more
    sets = []  # (plans, compiled, float8 recipe, memory budget): per (pp, schedule) part, compile, recipe and budget
    for recipe in recipes:
        tr = training.model_copy(update={"float8": recipe})
        try:
            eager, more = titan_plans(model, gpus, global_batch, pins, tp_limit(max_tp, gpu), bool(recipe))
            compiled, more_c = _with_compile(model, tr, eager, pins)
        except MemplanError as err:
            if recipe is None or pins.float8 != FLOAT8_ANY:
                raise
            notes.append(f"--float8 any: {recipe} not searched: {err}")
            continue
        sets += [(part, c, recipe, None) for part, c in compiled]
        notes += [n for n in more + more_c if n not in notes]
    if budgets:  # a pinned budget: its plans only
        sets = _budget_sets(sets, budgets) + ([] if pins.ac is not None else sets)
        if not sets:
            raise MemplanError("--ac budget:F: no plan left (memory-budget AC is modelled compiled, with tp 1 and cp 1)")
    parts, done, total = [], 0, sum(len(p.t) for p, _, _, _ in sets)
    for plans, compiled, recipe, budget in sets:
        tr = training.model_copy(update={"compile": compiled, "float8": recipe, "memory_budget": budget,
                                         "async_tp": training.async_tp and compiled})  # with tp > 1 only: device.py
        check_int64(model, tr, int(plans.b.max()), IMPL, gpu, margin)
        parts.append(evaluate(model, tr, plans, gpu, global_batch, IMPL, margin))
        done += len(plans.t)
        if progress is not None:
            progress(done, total)
    plans = functools.reduce(join, [p.plans for p in parts])
    evaluated = parts[0] if len(parts) == 1 else concat(plans, parts)
    result = ranked(model, training, gpus, global_batch, budget_bytes, gpu, evaluated, top, IMPL, margin,
                    host_budget_bytes, start)
    result.compiled = np.concatenate([np.full(len(p.t), c) for p, c, _, _ in sets])
    if training.async_tp:  # --async-tp: on the compiled plans with a TP mesh (torchtitan does nothing without one)
        result.async_tp = result.compiled & (np.asarray(plans.t) > 1)
    if pins.float8 == FLOAT8_ANY:
        result.float8 = np.concatenate([np.full(len(p.t), r or "", dtype=object) for p, _, r, _ in sets])
    if budgets:
        result.memory_budget = np.concatenate([np.full(len(p.t), np.nan if f is None else f) for p, _, _, f in sets])
    result.exact.update(result.evaluate_plans(result.top + [i for i in (result.nearest_miss, result.fastest_miss)
                                                            if i is not None]))
    result.layer_ac_every = pinned_every(pins)
    result.notes.extend(notes + [("torchtitan: async TP (--async-tp) on every compiled plan with tp > 1: its "
                                  "symmetric-memory workspace outside the caching allocator and TP's collectives "
                                  "overlapped with their matmuls, derived from torch 2.13's code, uncalibrated; "
                                  if training.async_tp else "torchtitan: async TP is a pin (--async-tp), not searched; ")
                                 + "the multi-stage schedules at 2 stages a rank only (torchtitan's default)"
                                 + ("" if pins.float8 == FLOAT8_ANY else "; float8 is a pin (--float8 RECIPE; "
                                    "--float8 any searches it)")])
    if np.any(np.asarray(plans.p) > 1):
        result.notes.append("torchtitan pp: the step time charges the pipeline bubble, (pp - 1) / (m M) of a stage's "
                            "busy time (m = 2 stages a rank for the multi-stage schedules; a third of it for the "
                            "split-backward ones: memplan/memory/pipeline_multi.py bubble_share), and the stage sends "
                            "as Megatron-LM's plans are timed (memplan/timing/step.py): derived, uncalibrated (no "
                            "torchtitan pipeline run was timed)")
    return result


def search_titan_max_seq(model: ModelSpec, training: TrainingSpec, gpus: int, global_batch: int, budget_bytes: int,
                         step: int = SEQ_STEP, **kwargs) -> SearchResult:
    """`search --impl torchtitan --max-seq`: the longest sequence (a multiple of `step`) some torchtitan plan fits
    with by the allocated-peak bound, and `search_titan` at that length (memplan/plan/search.py `search_max_seq` for
    Megatron-LM's space; the replay then settles it: memplan/plan/verdict.py `replayed_max_seq`). Every plan's device
    memory grows with s, so the least of them does too: `largest_under` finds the length from those figures, the same
    answer as a bisection on "some plan fits". A length the search refuses (its sizes beyond the int64 arithmetic)
    fits no budget; at `step` itself a refusal is the user's to read."""
    found: dict[int, SearchResult] = {}

    def at(s: int) -> SearchResult:
        if s not in found:
            found[s] = search_titan(model.model_copy(update={"seq_length": s}), training, gpus, global_batch,
                                    budget_bytes, **kwargs)
        return found[s]

    host = kwargs.get("host_budget_bytes")

    def need(s: int) -> int:
        try:
            evaluated = at(s).evaluated
        except MemplanError:
            if s == step:
                raise
            return budget_bytes + 1
        least = least_device_bytes(evaluated, host)
        return budget_bytes + 1 if least is None else least

    longest = largest_under(need, budget_bytes, step, SEQ_LIMIT)
    if longest is None:
        raise MemplanError(f"no torchtitan plan of {model.name} fits in {budget_bytes:,} bytes per GPU even at "
                           f"s = {step}")
    return mark_max_seq(at(longest), longest, step)
