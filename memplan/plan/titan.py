"""torchtitan's dimensions in a search (`search --impl torchtitan`): the plans of them memplan models, and a plan's
torchtitan settings (`titan_dims`, the listing's columns and JSON).

The space (each plan distinct and launchable with torchtitan, each one `estimate --impl torchtitan` plans with the
same flags, memplan/api/options.py):
  tp          divides the attention heads, the key/value heads, the FFN width and the vocabulary, at most the GPUs of
              a node (or --max-tp), with sequence parallelism and loss parallel (torchtitan's default) and the sequence
              length divisible by it;
  dp_shard x dp_replicate = d = GPUs / tp, d dividing the global batch; dp_replicate R divides d (R = 1: FSDP2 over
              d ranks; R > 1: HSDP, d / R >= 2 ranks per shard group) (memplan's ZeRO 3 sharded over d / R);
  local batch b divides the global batch / d (the rest is gradient accumulation);
  AC          none, selective-op, full, selective-layer:N (every N-th layer checkpointed, L // N of them: one plan
              per distinct count, named by the smallest N that gives it; the kept bytes do not depend on where the
              layers sit, memplan/inventory/titan.py);
  compile     off, or on where memplan traces it (cp = 1, any tp; with --float8 AC not selective-op, and at
              tp > 1 full AC only: memplan/inventory/compiled.py, memplan/api/options.py).
  cp          1, and where s >= CP_MIN_SEQ or --cp pins it, powers of 2 with 2 cp | s (torchtitan's head-tail
              chunks; memplan/plan/space.py), its K/V all-gather timed (memplan/timing/comm.py); compile with cp 1.
  pp          1, and the powers of 2 dividing the GPUs whose stage split `estimate --impl torchtitan --pp` takes
              (memplan/memory/pipeline.py titan_split: equal middle stages, the first / last stage a layer short
              where torchtitan's split says so), each with the schedules 1F1B and GPipe (`pipelines`), and where
              torchtitan splits 2p virtual stages (`multi_split`), the multi-stage Interleaved1F1B, LoopedBFS,
              InterleavedZeroBubble, ZBVZeroBubble and DualPipeV at 2 stages a rank (memplan/memory/pipeline_multi.py;
              where torch runs them: multi_runs; the split-backward ones not compiled); the
              micro-batch b (pipeline_parallel_microbatch_size) divides the global batch / d, the local batch is
              the pipeline's M = global batch / (d b) micro-batches (no accumulation on top, as --emit torchtitan
              launches it), 1F1B with M >= pp only (titan_schedule_runs: torch's Schedule1F1B refuses fewer); AC
              none, selective-op or full of the stage's layers (selective-layer's count over the stages is not
              modelled), not with --float8 (estimate refuses it). Each (pp, schedule) is evaluated as a part of its
              own (the schedule is one per PlanValues); `join` makes the schedule a per-plan array.
  ep          a Qwen3 MoE model's: the divisors of E dividing dp_shard cp tp (torchtitan's efsdp = dp_shard cp tp / ep),
              with tp (the experts' etp torchtitan's: tp at ep 1, 1 at ep > 1), cp, HSDP and pp (not the split-backward
              schedules: multi_refusal) and no compile or float8 (`moe_dims`; memplan/inventory/titan_moe.py);
              DeepSeek-V3's the same, pp with 1F1B / GPipe where its dense first layers all fit in the first
              stage (titan_split) and with Interleaved1F1B / LoopedBFS (each rank's chunks' dense layers counted:
              pipeline_multi.chunk_dense; the split-backward ones not: multi_refusal); dense models ep 1.
  budget      memory-budget AC (MemoryBudgetAC, --ac budget:F) on the compiled plans with AC none, tp 1 and cp 1 of a
              dense Llama 3 at the traced widths: F = 0, 0.1, ... below 1 whose saved set and recompute differ
              (memplan/inventory/budget_recompute.py distinct_budgets; F = 1 is the plain compiled block), each
              evaluated with its own TrainingSpec (titan_search._budgets; `SearchResult.memory_budget` per plan).
Not searched (not modelled for torchtitan yet): more than 2 stages a rank (estimate --pipeline-layers-per-stage).
Async TP is a pin (--async-tp: on the compiled tp > 1 plans, `SearchResult.async_tp` per plan).
  float8      pinned (`--float8 RECIPE`, bf16 without it), or with `--float8 any` off, tensorwise and rowwise (rowwise
              only with --emit torchtitan) where the GPU has FP8 tensor cores, for a dense model without pp: each
              recipe's plans evaluated with its own TrainingSpec, as compile's (titan_search._float8_recipes;
              `SearchResult.float8` per plan, a column in `titan_dims`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.core.specs import Config
from memplan.core.training import Recompute
from memplan.inventory.titan import BUDGET_AC, LAYER_AC, check_titan_layout, checkpointed_layers, titan_ac_mode
from memplan.inventory.titan_moe import check_titan_moe
from memplan.memory.pipeline import SINGLE_SCHEDULES, titan_schedule_runs, titan_split, titan_stage_layers
from memplan.memory.pipeline_multi import (MULTI_SCHEDULES, SPLIT_BACKWARD, is_multi, multi_refusal, multi_runs,
                                           rank_chunks)
from memplan.memory.term_bytes import PlanValues
from memplan.plan.space import Fixed, plan_space


@dataclass(frozen=True)
class TitanPins:
    """The torchtitan dimensions a search pins (None: searched)."""

    tp: Optional[int] = None
    cp: Optional[int] = None  # context parallelism: searched where s >= CP_MIN_SEQ (memplan/plan/space.py)
    dp_replicate: Optional[int] = None
    ac: Optional[str] = None  # --ac as `estimate` takes it
    compile: Optional[bool] = None
    micro_batch: Optional[int] = None  # torchtitan's local batch (with pp > 1 its pipeline_parallel_microbatch_size)
    pp: Optional[int] = None  # pipeline_parallel_degree
    schedule: Optional[str] = None  # pipeline_parallel_schedule (pipeline.py TORCH_SCHEDULES); pinned: pp > 1 only
    launchable: bool = False  # --emit torchtitan: only what torchtitan 0.3.0 can say (no selective-layer)
    ep: Optional[int] = None  # expert_parallel_degree (a Qwen3 MoE: searched over the divisors of E; `moe_dims`)
    etp: Optional[int] = None  # refused: torchtitan's experts have no expert TP here (efsdp = d t cp / ep)
    float8: Optional[str] = None  # FLOAT8_ANY: bf16 and the float8 recipes searched (titan_search._float8_recipes);
    # else the pinned recipe rides in the TrainingSpec


FLOAT8_ANY = "any"  # --float8 any: search bf16 and float8 (search --impl torchtitan only)


def layer_ac_counts(layers: int) -> dict[int, int]:
    """selective-layer:N's distinct counts of checkpointed layers (fewer than all), each with the smallest N giving it."""
    out: dict[int, int] = {}
    for every in range(2, layers + 1):
        out.setdefault(len(checkpointed_layers(layers, every)), every)
    return out


def ac_label(recompute: int, layers_recomputed: int, layers: int, every: Optional[int] = None) -> str:
    """The --ac of a plan: none, selective-op, full or selective-layer:N (`every`: a pinned N, where it gives the
    same layers)."""
    rec = Recompute(int(recompute))
    if rec == Recompute.NONE:
        return "none"
    if rec == Recompute.SELECTIVE:
        return "selective-op"
    k = int(layers_recomputed)
    if k >= layers:
        return "full"
    if every is not None and len(checkpointed_layers(layers, every)) == k:
        return f"{LAYER_AC}:{every}"
    return f"{LAYER_AC}:{layer_ac_counts(layers)[k]}"


def pinned_every(pins: TitanPins) -> Optional[int]:
    """The N of a pinned --ac selective-layer:N (None otherwise)."""
    if pins.ac is None:
        return None
    mode, every = titan_ac_mode(pins.ac)
    return every if mode == LAYER_AC else None


def _ac_fixed(model: ModelSpec, pins: TitanPins, chunk: int) -> dict[str, Any]:
    """The AC modes searched, as memplan's recompute pins; `chunk` the stage's layers (full AC recomputes them all;
    selective-layer searched at pp = 1 only: `pipelines`)."""
    L = model.num_layers
    if pins.ac is None:
        counts = () if pins.launchable or chunk < L else tuple(layer_ac_counts(L))
        return dict(recompute_layers=counts + (chunk,))
    mode, every = titan_ac_mode(pins.ac)
    if mode == BUDGET_AC:  # nothing checkpointed; the compiled plans at the budget (titan_search._budgets)
        return dict(recompute=Recompute.NONE, recompute_layers=(chunk,))
    if mode == LAYER_AC:
        if pins.launchable:
            raise MemplanError("--emit torchtitan: torchtitan 0.3.0 has no per-layer selective AC: search it with "
                               "--ac none, full or selective-op (or leave --ac out)")
        if every > L:
            raise MemplanError(f"--ac {LAYER_AC}:{every} checkpoints no layer of {L}: search it with --ac none")
        return dict(recompute=Recompute.FULL, recompute_layers=(len(checkpointed_layers(L, every)),))
    code = {"none": Recompute.NONE, "selective-op": Recompute.SELECTIVE, "full": Recompute.FULL}[mode]
    return dict(recompute=code, recompute_layers=(chunk,))


def pipelines(model: ModelSpec, gpus: int, pins: TitanPins, float8: bool = False) -> tuple[list, list[str]]:
    """The (pp, first stage layers, last stage layers, schedule) searched (module docstring), and what was left out
    as notes. pp = 1 once (no schedule runs), unless --pipeline-schedule pins one."""
    L, notes = model.num_layers, []
    # --ac selective-layer with a pinned --pp: refused before the search (api options.titan_layers, as estimate)
    layer_ac = pins.ac is not None and titan_ac_mode(pins.ac)[0] == LAYER_AC
    out: list = [(1, None, None, "1F1B")] if pins.pp in (None, 1) and pins.schedule is None else []
    if pins.pp is None and (float8 or layer_ac):
        return out, [f"pipeline parallelism not searched with {'float8 linears' if float8 else '--ac ' + LAYER_AC} "
                     "(not modelled with --pp)"]
    skipped, multi_skipped = [], []
    schedules = [pins.schedule] if pins.schedule else list(SINGLE_SCHEDULES + MULTI_SCHEDULES)
    for p in [pins.pp] if pins.pp not in (None, 1) else [2 ** i for i in range(1, gpus.bit_length()) if pins.pp is None]:
        if gpus % p:
            continue
        for s in schedules:
            try:
                if is_multi(s):  # 2 stages a rank, torchtitan's split of 2p (the part is made at its ranks' layers)
                    if multi_refusal(p, 2, None, s, bool(pins.compile), model.is_moe):
                        raise ValueError(s)
                    out.append((p, *multi_split(p, L, s), s))
                else:
                    out.append((p, *titan_split(p, L, model.moe_first_dense_layers), s))
            except ValueError:
                (multi_skipped if is_multi(s) else skipped).append(p)
    why = {"single-stage": f"torchtitan's stage split of the {L} layers leaves middle stages of different sizes, a "
                           "stage without layers or dense first layers beyond the first stage (not modelled: "
                           "memplan/memory/pipeline.py titan_split)",
           "multi-stage": f"torchtitan cannot split the {L} layers into 2p stages, its middle ranks' layers differ "
                          "(titan.multi_split), or a split-backward schedule with --compile or an MoE model (not "
                          "modelled: memplan/memory/pipeline_multi.py multi_refusal)"}
    for which, ps in (("single-stage", skipped), ("multi-stage", multi_skipped)):
        if ps:
            notes.append(f"pp {', '.join(map(str, sorted(set(ps))))} not searched with the {which} schedules: "
                         + why[which])
    return out, notes


def multi_split(p: int, num_layers: int, kind: str) -> tuple[Any, Any]:
    """A multi-stage schedule's part of the search (2 stages a rank) as the planner's (first, last) stage layers:
    (None, None) where p divides L, else the first and the last ranks' layers of torchtitan's split of 2p stages
    (pipeline_multi.rank_chunks; DeepSeek-V3's 61 layers at p = 2: 15 + 16 and 16 + 14, so 31, 30) where the rest
    splits evenly over the middle ranks (the planner's rule). The memory evaluates each rank's own chunks all the
    same (PlanValues.layers). ValueError where torchtitan cannot split 2p stages or the rest does not split."""
    ranks = [sum(rank_chunks(r, p, 2, num_layers, kind)) for r in range(p)]  # ValueError: no split of 2p stages
    if num_layers % p == 0:
        return None, None
    if p > 2 and sum(ranks[1:-1]) % (p - 2):
        raise ValueError(f"ranks of {', '.join(map(str, ranks))} layers")
    return ranks[0], ranks[-1]


def _planner_chunk(p: int, num_layers: int, first: Any, last: Any) -> int:
    """The largest stage of the planner's split (first, middle, last: memplan/plan/space.py _splits)."""
    if first is None:
        return num_layers // p
    return max(first, last, (num_layers - first - last) // (p - 2) if p > 2 else 0)


def moe_dims(model: ModelSpec, pins: TitanPins, float8: bool = False) -> dict[str, Any]:
    """The model-parallel pins of the space: a dense model's tp and cp with ep 1; a Qwen3 MoE's ep (searched over the
    divisors of E, memplan/plan/space.py; `titan_plans` keeps those dividing dp_shard cp tp), tp and cp, etp
    torchtitan's (tp at ep 1, 1 at ep > 1: titan_moe.moe_etp), DeepSeek-V3's the same: what estimate models of it
    (memplan/inventory/titan_moe.py check_titan_moe refuses the rest, as for
    estimate; pp and HSDP are searched as for a dense model)."""
    check_titan_layout(model)
    check_titan_moe(model, pins.ep or 1, pins.etp, pins.tp or 1, pins.cp or 1, pins.pp or 1, False, float8,
                    pins.dp_replicate or 1, False)
    if not model.is_moe:
        return dict(tp=pins.tp, cp=pins.cp, ep=1)
    return dict(tp=pins.tp, cp=pins.cp, ep=pins.ep, etp=pins.etp)  # etp: torchtitan's (moe_etp), kept in titan_plans


def titan_plans(model: ModelSpec, gpus: int, global_batch: int, pins: TitanPins, max_tp: int,
                float8: bool = False) -> tuple[list[PlanValues], list[str]]:
    """Every eager plan of the space (module docstring) as flat arrays (memplan/plan/space.py numbers them), one
    part per (pp, schedule) (`pipelines`), and the notes on what was left out."""
    parts, (splits, left) = [], pipelines(model, gpus, pins, float8)
    notes = left
    dims = moe_dims(model, pins, float8)  # the pins' refusals first (as estimate's), before any pp is left out
    if model.is_moe:  # FSDP2 / HSDP with EP, PP and (Qwen3 MoE) TP (moe_dims)
        notes = notes + ["torchtitan MoE: ep, tp, cp and pp searched"
                         + ", the split-backward schedules not; EP's all-to-alls timed as Megatron-LM's alltoall dispatcher's "
                         "(memplan/timing/comm.py): derived, uncalibrated"]
    for p, first, last, schedule in splits:
        multi = is_multi(schedule)
        chunk = _planner_chunk(p, model.num_layers, first, last) if multi else max(titan_stage_layers(p, model.num_layers))
        fixed = Fixed(**dims, pp=p, vpp=1, cp_comm_type="allgather", zero=3,
                      micro_batch=pins.micro_batch, first_stage_layers=first, last_stage_layers=last,
                      **_ac_fixed(model, pins, chunk))
        try:
            plans = plan_space(model, gpus, global_batch, fixed, max_tp, "torchtitan").flat()
        except MemplanError:  # no t, d, b for this pp
            continue
        replicas = plans.d // plans.shard
        keep = (replicas == 1) | (plans.shard >= 2)  # HSDP keeps 2 or more ranks per shard group (options.titan_shard)
        # TP shards w1 / w3 / w2 by the FFN width and the LM head and loss by the vocabulary (colwise, loss parallel)
        keep &= (model.f % plans.t == 0) & (model.vocab_size % plans.t == 0)
        keep &= multi_runs(plans.p, 2, plans.microbatches, schedule) if multi else titan_schedule_runs(
            plans.p, plans.microbatches, schedule)
        if pins.dp_replicate is not None:
            keep &= replicas == pins.dp_replicate
        if model.is_moe:  # EP borrows a shard group's and TP's ranks (torchtitan's efsdp = dp_shard tp / ep, cp 1)
            keep &= ((plans.shard * plans.t * plans.cp) % plans.ep == 0) & (
                plans.expert_tp == np.where(plans.ep == 1, plans.t, 1)) & (  # titan_moe.moe_etp
                (model.moe_shared_ffn_hidden_size or 0) % plans.t == 0)  # the shared experts colwise over tp
        if keep.any():
            plans = dataclasses.replace(plans.take(np.flatnonzero(keep)), schedule=schedule)
            if multi:  # 2 stages a rank (torchtitan's default); the AC mode covers every layer of every chunk
                plans = dataclasses.replace(plans, m=plans.m * 2, recomputed_layers=0 * plans.m + model.num_layers)
            n = np.full(len(plans.t), 1)  # the split as arrays in every part (even: L / p), so that parts join
            parts.append(dataclasses.replace(plans, first_layers=n * (first or model.num_layers // p),
                                             last_layers=n * (last or model.num_layers // p)))
    if not parts and not splits and (left or pins.schedule):  # a pinned schedule no pp is searched with: say why
        raise MemplanError(f"no torchtitan plan of {model.name} on {gpus} GPUs: " + (
            left[0] if left else f"--pipeline-schedule {pins.schedule} needs pp >= 2 dividing the GPUs"))
    if not parts:
        raise MemplanError(f"no torchtitan plan of {model.name} on {gpus} GPUs with global batch {global_batch} and "
                           f"the pinned dimensions (dp_replicate R must divide d = GPUs / tp and leave 2 or more "
                           "ranks per shard group; 1F1B needs as many micro-batches as pipeline stages)")
    return parts, notes


def compilable(plans: PlanValues, float8: bool = False, layers: int = 0, moe: bool = False,
               qwen3: bool = False) -> np.ndarray:
    """The plans memplan models with torch.compile: cp = 1 (any tp: the compiled block measured per TP rank); with
    float8 linears AC not selective-op (memplan/inventory/compiled.py), and with tp > 1 full AC of all ``layers``
    (memplan/api/options.py); ``moe`` (the Qwen3 MoE block, memplan/inventory/compiled_moe.py) and ``qwen3`` (the
    dense Qwen3 block, memplan/inventory/compiled_qwen3.py): tp 1 and ep 1 only."""
    rec, t = np.asarray(plans.recompute), np.asarray(plans.t)
    if moe or qwen3:
        return (np.asarray(plans.cp) == 1) & (t == 1) & (np.asarray(plans.ep) == 1) & (
            str(plans.schedule) not in SPLIT_BACKWARD)
    full = (rec == int(Recompute.FULL)) & (np.asarray(plans.recomputed_layers) >= layers)
    split = str(plans.schedule) in SPLIT_BACKWARD  # I / W through a compiled block: not modelled (api options)
    return (np.asarray(plans.cp) == 1) & (((rec != int(Recompute.SELECTIVE)) & ((t == 1) | full)) | (not float8)) & (
        not split)


def join(a: PlanValues, b: PlanValues) -> PlanValues:
    """Two sets of flat plans as one (the array fields concatenated; a scalar field the two differ in, the pipeline
    schedule, as a per-plan array)."""
    out, n = {}, (len(a.t), len(b.t))
    for f in dataclasses.fields(PlanValues):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if getattr(x, "ndim", 0) or getattr(y, "ndim", 0) or x != y:
            out[f.name] = np.concatenate([v if getattr(v, "ndim", 0) else np.full(k, v) for v, k in zip((x, y), n)])
        else:
            out[f.name] = x
    return PlanValues(**out)


def titan_dims(config: Config, every: Optional[int] = None) -> dict[str, Any]:
    """A plan's torchtitan settings, by the names its config and `estimate --impl torchtitan` use."""
    par, tr = config.parallel, config.training
    k = tr.recompute_num_layers if tr.recompute_num_layers is not None else config.model.num_layers
    piped = par.pp > 1  # the local batch is the pipeline's M micro-batches (memplan/launch/titan.py titan_document)
    return {"dp_replicate": par.dp // par.shard, "dp_shard": par.shard, "tp": par.tp, "cp": par.cp, "pp": par.pp,
            "pipeline_schedule": par.pp_schedule if piped else None,
            "ac": f"{BUDGET_AC}:{tr.memory_budget:g}" if tr.memory_budget is not None else
            ac_label(int(tr.recompute), k, config.model.num_layers, every), "compile": bool(tr.compile),
            "float8": tr.float8,
            "local_batch": tr.micro_batch * (config.num_microbatches if piped else 1),
            "pipeline_microbatch_size": tr.micro_batch if piped else None,
            "gradient_accumulation": 1 if piped else config.num_microbatches,
            **({"ep": par.ep} if config.model.is_moe else {}),
            **({"async_tp": True} if tr.async_tp else {})}  # compile.enable_async_tensor_parallel (--async-tp)
