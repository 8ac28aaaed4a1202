"""A plan's values (scalars for one plan, arrays for the planner) and the bytes of every inventory term under it:
`PlanValues`, `TermBytes` (cached per model and plan for scalars) and how many copies of a term a stage holds."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import Any

from memplan.core.arith import minimum
from memplan.core.model import ModelSpec
from memplan.core.specs import Config
from memplan.core.training import Recompute
from memplan.inventory.moe import one_layer
from memplan.inventory.types import Term
from memplan.memory.pipeline import schedule_in_flight, stage_layers
from memplan.memory.pipeline_multi import chunk_dense, is_multi, one, rank_chunks, stage_ends
from memplan.memory.param_group import ParamGroup


@dataclass(frozen=True)
class PlanValues:
    """A parallel plan as numbers (each field a scalar or an equally shaped numpy array)."""

    t: Any
    p: Any
    d: Any
    m: Any
    sp: Any  # 0 / 1
    zero: Any  # 0..3
    shard: Any  # ranks the ZeRO states are split over (d, or fewer with HSDP)
    b: Any
    recompute: Any  # Recompute codes 0 / 1 / 2
    recomputed_layers: Any  # layers per model chunk that the recompute mode applies to
    microbatches: Any  # M, micro-batches per step per data-parallel rank
    cp: Any = 1  # context-parallel size (memplan/memory/parallel.py)
    ep: Any = 1  # expert-parallel size
    etp: Any = None  # expert tensor-parallel size (None: t)
    cp_comm: str = "p2p"  # context-parallel attention's communication (ParallelSpec.cp_comm_type)
    schedule: str = "1F1B"  # the pipeline schedule (ParallelSpec.pp_schedule: memplan/memory/pipeline.py TORCH_SCHEDULES)

    @property
    def expert_tp(self) -> Any:
        return self.t if self.etp is None else self.etp

    @property
    def gpus(self) -> Any:
        return self.t * self.p * self.d * self.cp
    # transformer layers on the first and on the last pipeline stage (memplan/memory/pipeline.py stage_layers; the
    # middle stages split the rest); None: the even split L/p
    first_layers: Any = None
    last_layers: Any = None

    @staticmethod
    def from_config(config: Config) -> "PlanValues":
        par, tr = config.parallel, config.training
        model_layers = config.model.num_layers
        chunk = model_layers if is_multi(par.pp_schedule) else config.layers_per_chunk  # multi: all, every chunk
        recomputed = tr.recompute_num_layers if tr.recompute_num_layers is not None else chunk
        first, _, last = config.split
        return PlanValues(
            t=par.tp, p=par.pp, d=par.dp, m=par.vpp, sp=int(par.sp), zero=par.zero, shard=par.shard,
            b=tr.micro_batch,
            recompute=int(tr.recompute), recomputed_layers=recomputed, microbatches=config.num_microbatches,
            cp=par.cp, ep=par.ep, etp=par.expert_tp, cp_comm=par.cp_comm_type, schedule=par.pp_schedule,
            first_layers=first if config.uneven else None, last_layers=last if config.uneven else None,
        )

    def take(self, index: Any) -> "PlanValues":
        """One candidate (or a subset) of an array-valued plan (scalar and None fields stay as they are)."""
        return PlanValues(**{f.name: (v[index] if getattr(v := getattr(self, f.name), "ndim", 0) else v)
                             for f in fields(self)})

    def symbols(self, model: ModelSpec, **more: Any) -> dict[str, Any]:
        """The model's symbols with this plan's b, t, cp, ep, etp (the one place they are bound)."""
        return model.symbols(b=self.b, t=self.t, cp=self.cp, ep=self.ep, etp=self.expert_tp, **more)

    def layers(self, model: ModelSpec, stage: Any) -> Any:
        """Transformer layers on pipeline stage `stage` (memplan/memory/pipeline.py stage_layers; a multi-stage
        schedule's rank: its chunks', memplan/memory/pipeline_multi.py rank_chunks)."""
        if is_multi(self.schedule):
            return sum(rank_chunks(one(stage), one(self.p), one(self.m), model.num_layers, str(self.schedule)))
        return stage_layers(stage, self.p, model.num_layers, self.first_layers, self.last_layers)

    def dense_layers(self, model: ModelSpec, stage: Any) -> Any:
        """An MoE model's dense first layers on pipeline stage `stage`: all of them on the first (titan_split and
        Config check that they fit), none elsewhere; a multi-stage schedule's rank: its chunks' (torchtitan's split
        deals layers.0 .. out first: memplan/memory/pipeline_multi.py chunk_dense)."""
        nd = model.moe_first_dense_layers
        if nd and is_multi(self.schedule):
            return sum(chunk_dense(one(stage), one(self.p), one(self.m), model.num_layers, nd, str(self.schedule)))
        return nd * (stage == 0)

    def chunk_dense_layers(self, model: ModelSpec, stage: Any) -> Any:
        """Of the chunk `chunk_layers` describes (the one the timeline walks), the dense first layers: all of them on
        the first stage, none elsewhere; a multi-stage schedule's rank: its largest chunk's (`chunk_dense`)."""
        nd = model.moe_first_dense_layers
        if nd and is_multi(self.schedule):
            p, m, rank, kind = one(self.p), one(self.m), one(stage), str(self.schedule)
            sizes = rank_chunks(rank, p, m, model.num_layers, kind)
            return chunk_dense(rank, p, m, model.num_layers, nd, kind)[sizes.index(max(sizes))]
        return nd * (stage == 0)

    def ends(self, stage: Any) -> tuple[Any, Any]:
        """(stage `stage` holds the embedding, it holds the output layer): memplan/memory/pipeline_multi.py
        stage_ends."""
        return stage_ends(stage, self.p, self.schedule)

    def chunk_layers(self, model: ModelSpec, stage: Any) -> tuple[Any, Any]:
        """(layers per model chunk of stage `stage`, those of them the recompute mode applies to): Megatron-LM
        recomputes the first N layers of each chunk (block method), all of a chunk that has fewer. A multi-stage
        schedule's chunks differ: the rank's largest."""
        if is_multi(self.schedule):
            n = max(rank_chunks(one(stage), one(self.p), one(self.m), model.num_layers, str(self.schedule)))
        else:
            n = self.layers(model, stage) // self.m
        return n, minimum(self.recomputed_layers, n)


class TermBytes:
    """Bytes of one copy of a term on one GPU (Term.bytes), and parameters of a group on one GPU, for
    a plan of scalars or arrays. They depend on the plan only through b, t and SP, so with arrays
    each distinct (b, t, sp) is evaluated once and the results are gathered back (the planner's hot
    path)."""

    def __init__(self, model: ModelSpec, plan: PlanValues, activation_bytes: int, granularity: int = 1) -> None:
        self.act, self.index, self.granularity = activation_bytes, None, granularity
        b, t, sp, cp, ep, etp = plan.b, plan.t, plan.sp, plan.cp, plan.ep, plan.expert_tp
        if any(getattr(x, "size", 1) > 1 for x in (b, t, sp, cp, ep, etp)):
            import numpy as np

            b, t, sp, cp, ep, etp = np.broadcast_arrays(b, t, sp, cp, ep, etp)
            key = b * (2 * int(t.max()) + 2) + 2 * t + sp  # one integer per distinct (b, t, sp, cp, ep, etp)
            for x in (cp, ep, etp):
                if int(x.max()) > 1:
                    key = key * (int(x.max()) + 1) + x
            uniq, first, index = np.unique(key.ravel(), return_index=True, return_inverse=True)
            self.index = index.reshape(b.shape)  # gathered values keep the plan's (broadcast) shape
            b, t, sp, cp, ep, etp = (x.ravel()[first] for x in (b, t, sp, cp, ep, etp))
        self.values, self.sp = model.symbols(b=b, t=t, cp=cp, ep=ep, etp=etp), sp
        self._cache: dict[Any, Any] = {}

    def __call__(self, term: Term) -> Any:
        """Bytes of one copy, each of its storages rounded up to the allocator's granularity."""
        def allocated() -> Any:
            n = term.bytes(self.values, self.act, self.sp)
            if self.granularity == 1:
                return n
            each = -(-n // term.storages)
            return -(-each // self.granularity) * self.granularity * term.storages * (n > 0)

        return self._cached(term, allocated)

    def group(self, group: ParamGroup) -> Any:
        """A parameter group's parameters on one GPU (it depends on t only). Keyed by its count
        polynomial and split (states.param_groups makes new groups on every call; their parsed
        polynomials are shared)."""
        return self._cached(group.count, lambda: group.per_gpu(self.values),
                            ("group", group.tp_split, group.expert, group.whole is not None))

    def _cached(self, obj: Any, compute: Any, kind: Any = None) -> Any:
        # keyed by identity (hashing a term's polynomial on every call is slow); the entry keeps the
        # object alive, so its id cannot be reused by another object while the entry exists
        hit = self._cache.get((kind, id(obj)))
        if hit is None:
            if len(self._cache) >= CACHE_ENTRIES:  # a shared instance sees the terms of many inventories
                self._cache.clear()
            n = compute()
            hit = self._cache[kind, id(obj)] = (obj, n[self.index] if self.index is not None and getattr(n, "ndim", 0)
                                                else n)
        return hit[1]


CACHE_ENTRIES = 4096


_SHARED: "OrderedDict[tuple, TermBytes]" = OrderedDict()


def term_bytes_for(model: ModelSpec, plan: PlanValues, activation_bytes: int, granularity: int = 1) -> TermBytes:
    """`TermBytes` for the plan. A plan of scalars (`estimate`: every stage of one plan, and
    `--max-seq`'s probes) shares one instance per (model, b, t, SP, bytes, granularity), so each
    term is evaluated once, not once per stage."""
    plan_key = (plan.b, plan.t, plan.sp, plan.cp, plan.ep, plan.expert_tp)
    if any(hasattr(x, "shape") for x in plan_key):
        return TermBytes(model, plan, activation_bytes, granularity)
    key = (model, *(int(x) for x in plan_key), activation_bytes, granularity)
    sizes = _SHARED.get(key)
    if sizes is None:
        sizes = _SHARED[key] = TermBytes(model, plan, activation_bytes, granularity)
        if len(_SHARED) > 16:
            _SHARED.popitem(last=False)
    else:
        _SHARED.move_to_end(key)
    return sizes


def symbol_values(model: ModelSpec, plan: PlanValues) -> dict[str, Any]:
    """Bind the K22 symbols once: s, b, h, a, f, g, v, t (and cp, ep, etp)."""
    return plan.symbols(model)


_WHOLE: dict[tuple, tuple[Term, Term]] = {}


def whole_layer(model: ModelSpec, term: Term) -> Term:
    """A dense-layer or an MoE-layer term as the tensor of one such layer (memplan/inventory/moe.py one_layer), cached
    by the term."""
    L, nd = model.num_layers, model.moe_first_dense_layers
    key = (id(term), L, nd)
    hit = _WHOLE.get(key)
    if hit is None:
        if len(_WHOLE) >= CACHE_ENTRIES:
            _WHOLE.clear()
        hit = _WHOLE[key] = (term, one_layer(term, model))
    return hit[1]


def kind_share(model: ModelSpec, term: Term, plan: PlanValues, stage: Any) -> tuple[Any, Any]:
    """(numerator, denominator) of the share of stage `stage`'s n layers that are of a dense / MoE layer term's kind
    (Term.layer_kind): torchtitan's split keeps the nd dense first layers on the first stage (memplan/memory/pipeline.py
    titan_split checks it), so stage 0 holds nd dense and n - nd MoE layers, the others n MoE layers; a multi-stage
    schedule's rank the dense layers of its chunks (PlanValues.dense_layers). Without PP (n = L) the model's nd / L
    and (L - nd) / L, the inventory's weights."""
    n, d = plan.layers(model, stage), plan.dense_layers(model, stage)
    return (d, n) if term.layer_kind == "dense" else (n - d, n)


def stage_unit_bytes(sizes: "TermBytes", model: ModelSpec, term: Term, plan: PlanValues, stage: Any) -> Any:
    """Bytes of one copy of `term` on stage `stage` (`sizes`: the plan's TermBytes): a dense / MoE layer term's one
    layer's tensor (each storage rounded as allocated) times its kind's share of the stage's layers (`kind_share`: a
    multi-stage schedule's rank's average layer; memplan/memory/stage.py multi_counts counts its copies chunk by chunk
    in layers of its kind, of one such layer's tensor)."""
    if not term.layer_kind:
        return sizes(term)
    num, den = kind_share(model, term, plan, stage)
    return sizes(whole_layer(model, term)) * num // den


def term_count(term: Term, plan: PlanValues, layers_per_chunk: Any, stage: Any, recomputed: Any = None) -> Any:
    """How many copies of a saved tensor stage `stage` holds at its peak (`recomputed`: layers of each of its
    chunks the recompute mode applies to, default the plan's)."""
    chunks, microbatches = schedule_in_flight(stage, plan.p, plan.m, plan.microbatches, plan.schedule)
    if term.scope == "layer":
        recomputed = plan.recomputed_layers if recomputed is None else recomputed
        per_chunk = recomputed * term.kept(plan.recompute) + (layers_per_chunk - recomputed) * term.kept(
            Recompute.NONE
        )
        return chunks * per_chunk
    if term.scope == "chunk":
        return chunks * term.kept(plan.recompute)
    on_stage = (stage == 0) if term.scope == "first" else (stage == plan.p - 1)
    return on_stage * microbatches
