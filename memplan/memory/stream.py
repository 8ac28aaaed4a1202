"""The allocation stream of one GPU of a pipeline stage for the run a training script does: every allocation (tensor id,
requested bytes, stream, kind, name, size polynomial) and every free, in order, for one plan of scalars. This module
owns that stream; a model of PyTorch's caching allocator replays it (memplan's verdict at the margin,
../shared/reference/allocator.md "What a replay needs").

The run: the model built (one allocation per parameter tensor, `shapes.weight_shapes`, registration order; ZeRO-3: one
shard per parameter tensor, FSDP2's / DeepSpeed stage 3's, the largest taking the rest); Megatron-LM's fp32
main-gradient buffer; the optimizer created (its master copy; ZeRO >= 1: one flat shard per state); `steps` steps, each
the stage's (interleaved) 1F1B schedule (memplan/memory/pipeline.py `schedule`; the embedding's terms in chunk 0 of the
first stage, the batch and the loss in the last chunk of the last stage), the optimizer step and zero_grad; cuBLAS's
workspaces at the first forward and the first backward matmul (one per thread, kept). ZeRO-3's unsharded parameters in
flight (`StageMemory.gathered`, memplan/memory/dp_stack.py) are all-gathered at the first forward as units of one
layer's parameters (the rest of the count one block) and stay the timeline's bytes all step: at each layer's forward and
backward the oldest unit is freed and a new one gathered (torchtitan without PP: its units by phase, dp_stack.TITAN_HELD).
LoRA (peft): the frozen base (QLoRA's linears in NF4), then the fp32 adapters, which alone get .grad tensors and states
(memplan/memory/stream_params.py). Context parallelism: the cp buffers as the timeline's moments (memplan/memory/parallel.py
cp_moments). AdamW makes exp_avg and exp_avg_sq LAZILY in the first step's optimizer call; torch .grad tensors
(transformers) appear at their first write in the backward, zero_grad frees them.

Derived, not measured: the step timeline (memplan/memory/timeline.py) counts bytes by kind; the stream picks the
per-tensor order of the real code that reproduces them at every timeline event: autograd's (saved tensors in forward
order, freed in reverse in the backward, a moment's `freed` terms gone before it), a moment's transients made at it and
freed after it, a checkpointed layer's forward making and freeing its tensors in the real order
(`Inventory.checkpointed_forward`) and re-making them, the saved ones kept, when its backward starts, a .grad group made
when a moment first lists it (a traced moment's gradients as one tensor). Around the loss the order is the recorded real
code's (tests/test_alloc_fixture*.py): a moment's first transient, the previous moment's handed-on gradient freed
(`Moment.handed_on`; kept when it is this moment's first), its .grad, the other transients, the saved terms they make
(`Moment.made_after`); AdamW's lazy states tensor by tensor. Between two timeline events every free precedes every
allocation (but a handed-on gradient, `_Run._loss_point`), so no point exceeds both neighbours (but a checkpointed
forward and its re-run, under the recomputed backward's point): the maximum is the timeline's peak. A group's tensors
are sized from their shapes, fitted to the group's count (E/ep experts; the last absorbs a padded vocabulary); weights
beyond every group (MTP, FP8 caches) are one allocation. All on stream 0 (Megatron-LM's collectives write into
compute-stream tensors); tensors named for a gather / all-to-all / dispatch are of kind "communication". `Alloc.size` is
the bytes requested (ceil(bytes / storages), before the 512 B rounding), `Alloc.bytes` what the timeline counts (rounded
to Inventory.granularity once); `marks` tie the timeline's events to stream positions.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import zip_longest
from typing import Any, Optional

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.core.training import Recompute, TrainingSpec
from memplan.core.symbolic import Poly
from memplan.inventory.k22 import EMBEDDING_OUTPUT_GRAD
from memplan.inventory.titan_moments import REDUCE_SCATTER, RS_HELD_ID
from memplan.inventory.types import Inventory, Moment, Term
from memplan.memory.parallel import cp_moments
from memplan.memory.pipeline import schedule, walked_pair
from memplan.memory.adapters import ADAPTER_BYTES
from memplan.memory.stage import StageMemory, stage_memory
from memplan.memory.dp_stack import shard_bytes
from memplan.memory.stream_fsdp import FsdpStream
from memplan.memory.stream_events import Alloc, AllocationStream, Free, Repeats, new_event
from memplan.memory.stream_params import Persistent, Sizes, fit
from memplan.memory.term_bytes import PlanValues
from memplan.memory.timeline import optimizer_impl, step_events

def not_streamed(training: TrainingSpec, plan: PlanValues) -> str:
    """What of the plan the stream does not model ("" when it models all of it)."""
    why = [what for what, on in (("activation offload", training.offload_activations),
                                 ("optimizer offload", training.offload_optimizer_fraction),
                                 ("the optimizer step in the backward", training.optimizer_in_backward),
                                 ("interleaved stages with fewer than 2p micro-batches or not a multiple of p",
                                  plan.m > 1 and (plan.microbatches % plan.p or plan.microbatches < 2 * plan.p))) if on]
    return ", ".join(why)


def stream_for(model: ModelSpec, inventory: Inventory, training: TrainingSpec, plan: PlanValues, stage: int,
               stage_mem: Optional[StageMemory] = None, steps: int = 2, first_step_seq_len: Optional[int] = None,
               workspace_bytes: int = 0, repeat: bool = True) -> AllocationStream:
    """The stream for a plan of scalars on one GPU of `stage` (`stage_mem`: its `stage_memory`, made if None);
    `repeat` False: every layer's events made afresh, none copied from a template (the same stream, slower)."""
    why = not_streamed(training, plan)
    if why or steps < 1:
        raise MemplanError(f"the allocation stream models 1F1B without interleaving, no offload, "
                           f"no optimizer step in the backward, at least one step: {why or f'{steps} steps'}")
    if stage_mem is None:
        stage_mem = stage_memory(model, inventory.terms, training, plan, stage, granularity=inventory.granularity,
                                 layout=inventory.weight_layout)
    return _Run(model, inventory, training, plan, stage, stage_mem, workspace_bytes, repeat).run(steps,
                                                                                                 first_step_seq_len)


class _Run(FsdpStream):
    """Builds the stream; one instance per call."""

    def __init__(self, model: ModelSpec, inv: Inventory, training: TrainingSpec, plan: PlanValues, stage: int,
                 mem: StageMemory, workspace: int, repeat: bool = True) -> None:
        self.model, self.inv, self.tr, self.plan, self.stage, self.mem = model, inv, training, plan, stage, mem
        self.events, self.marks = [], []  # the events; (timeline event, stream position) pairs
        self.nid, self.ev, self.walk, self.workspace = 0, 0, False, workspace
        self.is_first, self.is_last = stage == 0, stage == plan.p - 1
        n, recomputed = plan.chunk_layers(model, stage)
        self.rec = plan.recompute
        self.n, self.N = int(n), int(recomputed) * (self.rec != Recompute.NONE)
        self.buffer, self.M, self.m = inv.grad_lifetime == "buffer", int(plan.microbatches), int(plan.m)
        self.step = step_events(model, inv, training, plan, mem, stage)
        self.layer_terms, self.first_terms, self.last_terms, self.chunk_terms = (
            [t for t in inv.terms if t.scope == scope and (scope != "chunk" or t.kept(self.rec))
             and (scope != "first" or self.is_first)] for scope in ("layer", "first", "last", "chunk"))
        self.held = list(inv.held) if self.is_last else []
        self.index = {t.id: i for i, t in enumerate(self.layer_terms)}  # a layer term's position
        # context parallelism's buffers (memplan/memory/parallel.py cp_moments, as the timeline adds them): a moment
        # inside the attention forward after the inventory's, and the attention backward's extra transients
        cp_forward, cp_backward = cp_moments(model, inv, plan)
        self.fwd_moments = [m for m in inv.moments if m.phase == "forward" and m.scope == "layer"] + list(cp_forward)
        # around the loss in the order they happen (the inventory lists them in any order: the timeline sums each
        # on its own): the forward, then the backward's moments by the gradients they have made
        self.loss_moments = sorted(enumerate(m for m in inv.moments if m.scope == "last"),
                                   key=lambda im: (im[1].phase != "loss", len(im[1].grads)))
        self.bwd_moments = [replace(m, transients=m.transients + cp_backward) if m.id == "attention_backward" else m
                            for m in inv.moments if m.scope == "layer" and m.phase == "backward"]
        self.stored = {rc: tuple(i for i, t in enumerate(self.layer_terms)
                                 if t.kept(self.rec if rc else Recompute.NONE)) for rc in (True, False)}
        self.alive_sets, self.repeats = {}, Repeats(repeat)  # (moment, rc) -> alive terms; copies of templates
        self.chunk_alive: dict[str, tuple] = {}  # the chunk's terms alive at a backward moment
        self.is_full = self.rec == Recompute.FULL
        self.tied_waits = bool(model.tied_embeddings and inv.tied_grad_waits and plan.p == 1)
        self.have_grads, self.grad_ids = False, {}  # .grad tensors exist (made earlier in this step); their ids
        self.gathered, self.in_flight = int(mem.gathered), []  # ZeRO-3's unsharded parameters; their units' ids
        # torchtitan without PP: FSDP2's units held by phase (dp_stack.TITAN_HELD), (unit, id) each
        self.units = mem.units if mem.units is not None and mem.units["on"] else None
        self.holding, self.phase = [], "optimizer"
        ids = {t.id for m in self.bwd_moments for t in m.transients}  # a dense torchtitan layer (stream_fsdp.WGRADS)
        self.carry_grads, self.wgrads = self.units is not None and "grad_ffn_wo_weights" in ids, {}
        self.rs_carry = None  # FSDP2's reduce-scatter input held to the next unit's (stream_fsdp.py)
        self.partial: list = []  # a traced moment's gradients made so far (one tensor)
        self.persistent = pers = Persistent(model, inv, training, plan, mem, self.n * self.m, self.is_first,
                                            self.is_last)
        self.tables, self.site_of, self.sites, self.grad_rows = pers.tables, pers.site_of, pers.sites, pers.grad_rows
        self.untied_head, self._table, self._tensors = pers.untied_head, pers.table, pers.tensors
        self.head_names = [g.name for g in pers.groups.values() if g.scope == "last"] + [
            g for _, m in self.loss_moments for g in m.grads]

    # -- primitives --------------------------------------------------------------------------------------------
    def _alloc(self, size: int, counted: int, kind: str, name: str, poly: Optional[Poly] = None) -> int:
        self.nid += 1
        self.events.append(new_event(Alloc, (self.nid - 1, size, 0, kind, name, poly, counted)))
        return self.nid - 1

    def _free(self, ids: list) -> None:
        self.events += [new_event(Free, (i,)) for i in reversed(ids)]

    def _term(self, t: Term, kind: str, label: str) -> list:
        req, counted, storages, poly, kind = self.sizes(t, kind)
        i, name = self.nid, f"{t.name} ({label})"
        self.nid += storages
        if storages == 1:
            self.events.append(new_event(Alloc, (i, req, 0, kind, name, poly, counted)))
            return [i]
        self.events += [new_event(Alloc, (j, req, 0, kind, name, poly, counted)) for j in range(i, i + storages)]
        return list(range(i, i + storages))

    def _drop(self, alive: dict, keep: Any) -> None:
        for i in sorted(alive, reverse=True):
            if i not in keep:
                self._free(alive.pop(i))

    def _fill(self, alive: dict, terms: list, target: tuple, label: str) -> None:
        for i in target:
            if i not in alive:
                alive[i] = self._term(terms[i], "saved_activation", label)

    def _mark(self, at: Optional[int] = None) -> None:
        """A point of the timeline (the next event, or the one `at` events on): recorded in the walked pair."""
        if self.walk:
            self.marks.append((self.ev + (at or 0), len(self.events)))
            self.ev += at is None

    def _point(self, extra: list, at: Optional[int] = None) -> None:
        """The point, then what exists only at it goes."""
        self._mark(at)
        self._free(extra)

    def _transients(self, m: Moment, recomputed: bool, label: str, head_rs: bool = False) -> list:
        """A moment's transients; `head_rs`: the held reduce-scatter input is the tail's (the timeline's last layer)."""
        ts = [t for t in m.transients if (not t.only_full or (recomputed and self.is_full))
              and not (head_rs and t.id.startswith(RS_HELD_ID))]
        n = int(self.units["tail_rs"]) if head_rs and len(ts) < len(m.transients) else 0
        if self.units is not None:  # torchtitan's FSDP2 (the tail's held input too: stream_fsdp.py)
            return self._fsdp_transients(ts, f"{m.name}, {label}", m.id == REDUCE_SCATTER, n)
        return [i for t in ts for i in self._term(t, "transient", f"{m.name}, {label}")]

    # -- parameters and states ---------------------------------------------------------------------------------
    def _build(self) -> None:
        """The model's parameters, the main-gradient buffer, the optimizer's master copy."""
        for name, n in self.persistent.weights():
            self._alloc(n, n, "parameter", name)
        self.phases.append(("optimizer created", len(self.events)))
        if self.buffer and (n := self.mem.states.gradients):  # torchtitan zeroes FSDP2's: kept between steps
            for name, size in (self.persistent.fsdp_grad_units(n) if self.units is not None else
                               [("main-gradient buffer (fp32)" if self.mem.units is None else
                                 "FSDP2's sharded fp32 gradients (kept between steps: torchtitan zeroes them)", n)]):
                self._alloc(size, size, "gradient", name, None)
        self.master, self.lazy = self.persistent.optimizer_rows()
        for name, n in (r for rows in self.master for r in rows):  # made with the optimizer; the moments later
            self._alloc(n, n, "optimizer_state", name)

    # -- ZeRO-3's gathered parameters -------------------------------------------------------------------------
    def _gather_all(self) -> None:
        """ZeRO-3's unsharded parameters in flight, all-gathered at the first forward (`Persistent.gathered_units`)."""
        self.unit_size, units, rest = self.persistent.gathered_units()
        self.in_flight = [self._alloc(self.unit_size, self.unit_size, "parameter", f"gathered parameters (unit {k + 1})")
                          for k in range(units)] or [None]
        if rest > 0:
            self._alloc(rest, rest, "parameter", "gathered parameters (tail and prefetch)")

    def _roll(self, j: int) -> None:
        """Layer j gathered: the oldest unit in flight freed (resharded), a new one all-gathered (the same size, so the
        bytes alive at every timeline point stay the timeline's)."""
        if self.units is not None:
            self._hold(self.phase, roll=True)
        elif self.gathered and self.in_flight[0] is not None:
            old = self.in_flight.pop(0)
            self._free([old])
            n = self.unit_size
            self.in_flight.append(self._alloc(n, n, "parameter", f"gathered parameters (layer {j})"))

    # -- gradients ---------------------------------------------------------------------------------------------
    def _ensure(self, site: Any, group: str) -> None:
        """A group's .grad tensors at `site`, made at their first write."""
        if (site, group) in self.grad_ids:
            return
        rows = self.grad_rows.get((self._table(site), group), [])
        where = f"layer {site}" if isinstance(site, int) else site
        self.grad_ids[site, group] = [self._alloc(n, n, "gradient", f"{name}.grad ({where})") for name, n in rows]

    def _ensure_site(self, site: Any) -> None:
        for group in dict.fromkeys(r[0] for r in self.tables[self._table(site)]):
            self._ensure(site, group)

    def _new_grad(self, group: str) -> int:
        """A group's gradient as autograd makes it (`Persistent.new_grad`)."""
        return self.persistent.new_grad(group, self.site_of.get(group, self.n))

    def _moment_grads(self, m: Moment, site: Any, creating: bool) -> list:
        """The gradients a moment adds (after the point's frees): the listed groups' .grad where this
        micro-batch makes them, a traced moment's gradients in elements, the last group's fresh gradient."""
        fresh = m.fresh and m.grads and (self.inv.grad_hook_transient if self.buffer else not creating)
        for g in m.grads if creating else ():
            self._ensure(self.site_of.get(g, site), g)
        if creating and m.grad_elements:
            n = shard_bytes(m.grad_elements * self.tr.grad_bytes, self.plan.shard, self.plan.zero >= 2)
            self.partial = [self._alloc(n, n, "gradient", f"layer {site} gradients made so far (traced)")]
        out = [self._alloc(n, n, "gradient", f"{m.grads[-1]} gradient before accumulation")] if fresh and (
            n := self._new_grad(m.grads[-1])) else []
        if m.grads or m.grad_elements:  # a weight gradient: the backward's first matmul (after its .grad, measured)
            self._workspace(2)
        return out

    def _workspace(self, thread: int) -> None:
        """cuBLAS's workspace of matmul thread 1 (the forward's) or 2 (autograd's: the backward's), made once, kept."""
        if self.workspace and self.workspaces < thread:
            self.workspaces = thread
            self._alloc(self.workspace, 0, "workspace", "cuBLAS workspace" + " (backward)" * (thread == 2))

    # -- one micro-batch ---------------------------------------------------------------------------------------
    def _alive(self, m: Moment, rc: bool) -> tuple:
        """Indices of the layer's saved terms alive at moment m (timeline's plain / full / selective sums)."""
        if (m.id, rc) not in self.alive_sets:
            kept = [(t.kept(Recompute.NONE), t) for t in self.layer_terms]
            self.alive_sets[m.id, rc] = tuple(i for i, (plain, t) in enumerate(kept) if t.id not in m.freed and (
                plain if not rc or self.rec == Recompute.NONE else (plain or t.kept(Recompute.FULL)) if self.is_full
                else (t.kept(Recompute.SELECTIVE) or (plain and m.recomputed))))
        return self.alive_sets[m.id, rc]

    def _forward(self, mb: int, c: int) -> dict:
        """Model chunk c's forward of micro-batch mb: the loop's batch (last stage, last chunk), the embedding's
        terms (first stage, chunk 0), the layers', the loss (last stage, last chunk)."""
        label = f"micro-batch {mb}" + f", chunk {c}" * (self.m > 1)
        head, embedding = self.is_last and c == self.m - 1, c == 0
        if self.is_first and embedding:  # torchtitan's FSDP2: the embedding's unit unsharded for its forward
            self._hold("embedding")
        st: dict = {"held": [i for t in self.held * head for i in self._term(t, "saved_activation", label)],
                    "first": [i for t in self.first_terms * embedding
                              for i in self._term(t, "saved_activation", label)],
                    "chunk": {}, "layers": {}, "last": {}}
        self._workspace(1)
        if self.gathered and not self.in_flight and self.units is None:
            self._gather_all()
        self._fill(st["chunk"], self.chunk_terms, tuple(range(len(self.chunk_terms))), label)
        for j in range(1, self.n + 1):
            rc, layer = j <= self.N, st["layers"].setdefault(j, {})
            where = f"layer {j}, {label}"
            if self.gathered or self.walk:
                self._layer_forward(j, rc, layer, where)
            else:  # the same events for every layer of this shape: a template's copy (memory/stream_events.py)
                self.repeats.piece(self, ("F", rc, id(self.sizes)), {"layer": layer}, where, label, f"layer {j}",
                                   lambda: self._layer_forward(j, rc, layer, where))
        if not head:
            self.ev += len(self.loss_moments) * self.walk
            return st
        creating = not self.buffer and not self.have_grads
        handed: list = []
        for at, m in self.loss_moments:
            target = tuple(i for i, t in enumerate(self.last_terms) if t.id not in m.freed)
            self._drop(st["last"], set(target))
            self._hold("head" if m.grads else "loss")
            early = tuple(i for i in target if self.last_terms[i].id not in m.made_after)
            self._fill(st["last"], self.last_terms, early, label)
            handed = self._loss_point(m, at, label, creating, handed,
                                      lambda: self._fill(st["last"], self.last_terms, target, label))
        self._free([i for _, ids in handed for i in ids])
        self.ev += len(self.loss_moments) * self.walk
        self._drop(st["last"], ())
        return st

    def _loss_point(self, m: Moment, at: int, label: str, creating: bool, handed: list, made_after: Any) -> list:
        """A moment around the loss in the real code's order (validation/alloc_trace.py recordings): its first transient,
        the previous moment's handed-on gradient freed, the .grad tensors (lm_head's weight gradient before its input
        gradient), the other transients, the saved terms they make (`made_after`); the point; the transients freed but
        those it hands on (returned: (id, tensor ids)). The live bytes after the first transient stay at most the
        previous point's: the gradient of the logits made (s b v in the activations' dtype, at most 4 B) against the
        fp32 nll_loss gradient (4 s b v B) freed since (hf_loss_moments; the handed-on fp32 log_softmax gradient was
        counted at that point)."""
        # a handed-on transient this moment lists first is the same tensor, not a new one (megatron-core's bf16
        # gradient of the logits: made in the cross-entropy's backward, used by the output layer's)
        carried = dict(handed)
        made = [(t.id, carried.pop(t.id) if t.id in carried else self._term(t, "transient", f"{m.name}, {label}"))
                for t in m.transients[:1] if not t.only_full]
        self._free([i for ids in carried.values() for i in ids])
        grads = self._moment_grads(m, "last", creating)
        made += [(t.id, self._term(t, "transient", f"{m.name}, {label}")) for t in m.transients[1:] if not t.only_full]
        made_after()
        keep = [(tid, ids) for tid, ids in made if tid in m.handed_on]
        self._point(grads + [i for tid, ids in made if tid not in m.handed_on for i in ids], at)
        return keep

    def _layer_forward(self, j: int, rc: bool, layer: dict, where: str) -> None:
        self._roll(j)
        self._hold("forward")
        if rc and self.is_full:
            self._checkpointed(layer, (), f"checkpointed forward, {where}")
        for m in self.fwd_moments:
            target = self._alive(m, rc)
            self._drop(layer, set(target))
            self._fill(layer, self.layer_terms, target, where)
            self._point(self._transients(m, rc, where))
        self._drop(layer, set(self.stored[rc]))
        self._fill(layer, self.layer_terms, self.stored[rc], where)
        self._mark()

    def _checkpointed(self, layer: dict, target: tuple, label: str) -> None:
        """A checkpointed layer's forward in the real order (`Inventory.checkpointed_forward`): run without saving
        (`target` ()), each tensor made and freed; re-run in its backward, the saved terms in `target` kept in `layer`,
        the rest freed, up to the last kept (torch.utils.checkpoint stops recomputing there)."""
        ops, made = self.inv.checkpointed_forward, {}
        kept = [k for k, (op, t) in enumerate(ops) if op == "+" and self.index.get(t.id) in target] or [len(ops)]
        for op, t in ops[:kept[-1] + 1]:
            i = self.index.get(t.id)
            if op == "+" and i in target:
                layer[i] = self._term(self.layer_terms[i], "saved_activation", label)
            elif op == "+":
                made[t.id] = self._term(t if i is None else self.layer_terms[i], "transient", label)
            elif t.id in made:
                self._free(made.pop(t.id))
        self._free([i for ids in made.values() for i in ids])

    def _backward(self, st: dict, mb: int, c: int) -> None:
        label = f"micro-batch {mb}" + f", chunk {c}" * (self.m > 1)
        self._workspace(2)  # a stage whose backward begins with no weight gradient (the last stage's: in the loss's)
        creating = not self.buffer and not self.have_grads
        owed: list = list(self.head_names) if creating and self.is_last else []
        # a tied LM head's gradient waits in autograd's input buffer for the embedding's (with a main-grad buffer)
        self.waiting, wait = [], self._new_grad("word embedding") if self.tied_waits and self.buffer else 0
        for j in range(self.n, 0, -1):
            rc, layer = j <= self.N, st["layers"].pop(j)
            where = f"layer {j}, {label}"
            args = (j, c, rc, layer, st["chunk"], where, label, owed, wait, creating)
            if creating or owed or self.partial or self.gathered or self.walk or (wait and not self.waiting):
                self._layer_backward(*args)
            else:  # as the forward's: a template's copy when made before for this shape and what is alive
                key = ("B", rc, id(self.sizes), tuple(j - 1 in m.layers for m in self.bwd_moments if m.layers),
                       tuple(layer), tuple(st["chunk"]), bool(self.waiting), wait)
                self.repeats.piece(self, key, {"layer": layer, "chunk": st["chunk"]}, where, label, f"layer {j}",
                                   lambda: self._layer_backward(*args))
            owed += [c * self.n + j] * creating
        # embedding backward: this chunk's tensors gone, every gradient made
        self._drop(st["chunk"], ())
        self._free([self.rs_carry] if self.units is not None and self.rs_carry is not None else [])
        self.rs_carry = None
        self._free(st["held"])
        self._hold("embedding")
        self._pay(owed, wait)
        for site in self.sites if creating else ():  # the embedding's, and any no moment named (the timeline's)
            self._ensure_site(site)
        extra = []
        if self.is_first and c == 0:
            extra = self._term(EMBEDDING_OUTPUT_GRAD, "transient", f"embedding backward, {label}")
            dense = self._new_grad("word embedding")
            for name, on in (("embedding weight gradient before the hook", self.buffer),
                             ("tied weights' gradient sum", self.tied_waits),
                             ("tied LM head gradient (waiting)", self.tied_waits and not self.buffer)):
                if on and dense:
                    extra.append(self._alloc(dense, dense, "gradient", f"{name}, {label}"))
        self._point(extra + self.waiting)
        self._free(st["first"])
        self.have_grads = self.have_grads or not self.buffer

    def _layer_backward(self, j: int, c: int, rc: bool, layer: dict, chunk_alive: dict, where: str, label: str,
                        owed: list, wait: int, creating: bool) -> None:
        self._roll(j)
        for m in self.bwd_moments:
            if m.layers and j - 1 not in m.layers:
                continue
            happens = {"plain": not (rc and self.is_full), "recomputed": rc and self.is_full,
                       "rerun": rc and self.rec != Recompute.NONE}
            if m.applies != "any" and not happens[m.applies]:
                continue
            target = self._alive(m, rc)
            chunk = self.chunk_alive.get(m.id)
            if chunk is None:
                chunk = self.chunk_alive[m.id] = tuple(i for i, t in enumerate(self.chunk_terms) if t.id not in m.freed)
            self._drop(layer, set(target))
            self._drop(chunk_alive, set(chunk))
            self._hold("first " * (j == 1 and self.is_first) + ("reduce-scatter" if m.id == REDUCE_SCATTER else "layer"))
            self._pay(owed, wait)
            self._fill(chunk_alive, self.chunk_terms, chunk, label)
            if rc and self.is_full and set(layer) <= set(self.stored[rc]):  # nothing re-made yet: re-run the forward
                self._checkpointed(layer, target, f"recomputed, {where}")
            self._fill(layer, self.layer_terms, target, where)
            self._point(self._moment_grads(m, c * self.n + j, creating) + self._transients(
                m, rc, where, self.units is not None and j == self.n and self.is_last))
        self._drop(layer, ())

    def _pay(self, owed: list, wait: int) -> None:
        """At a point of the backward, after its frees of saved terms: a traced moment's partial gradients go, the
        .grad of the layers (and head groups) back-propagated by now come, the waiting tied gradient once."""
        self._free(self.partial)
        self.partial = []
        if wait and not self.waiting:
            self.waiting = [self._alloc(wait, wait, "gradient", "tied LM head gradient (waiting)")]
        for x in owed:
            if isinstance(x, int):
                self._ensure_site(x)
            else:
                self._ensure(self.site_of.get(x, "last"), x)
        owed.clear()

    # -- the run -----------------------------------------------------------------------------------------------
    def _optimizer(self, first: bool) -> None:
        self._hold("optimizer")
        # AdamW's moments, in the first step: tensor by tensor, each tensor's states in turn (torch's _init_group,
        # apex / TE FusedAdam alike: exp_avg then exp_avg_sq of one parameter, then the next parameter's)
        for name, n in (r for rows in zip_longest(*self.lazy) for r in rows if r is not None and first):
            self._alloc(n, n, "optimizer_state", name)
        temp, pb = self.step.optimizer_temp_bytes, self.tr.master_weight_bytes or self.tr.weight_bytes
        pb = ADAPTER_BYTES if self.tr.lora_rank else pb
        rows = ([[f"optimizer temporary of {name}", n * pb] for *_, name, n in self.persistent.trained()]  # torch foreach
                if optimizer_impl(self.tr, self.inv) == "foreach" and self.plan.zero == 0 else [["temporaries", temp]])
        temps = [self._alloc(n, n, "transient", name) for name, n in fit(rows, temp) if n > 0]
        self._point(temps)
        if not self.buffer:  # zero_grad(set_to_none=True)
            self._free([i for ids in self.grad_ids.values() for i in ids])
            self.grad_ids, self.have_grads = {}, False

    def run(self, steps: int, first_seq: Optional[int]) -> AllocationStream:
        self.phases: list[tuple[str, int]] = [("model built", 0)]
        self.workspaces = 0
        self.sizes = main = Sizes(self.model, self.inv, self.tr, self.plan, self.stage)
        first = main if first_seq in (None, self.model.seq_length) else Sizes(
            self.model.model_copy(update={"seq_length": first_seq}), self.inv, self.tr, self.plan, self.stage)
        self._build()
        order = schedule(self.stage, int(self.plan.p), self.m, self.M, self.plan.schedule)
        walked = walked_pair(order, self.is_first, self.is_last, self.m)
        pairs = [i for i in range(len(order) - 1) if order[i][0] == "F" and order[i + 1][0] == "B"]
        periods: list[tuple[int, int]] = []  # the steady state's (forward, backward) pairs, where a replay may repeat
        for step in range(1, steps + 1):
            self.phases.append((f"step {step}", len(self.events)))
            sizes = first if step == 1 else main
            live: dict = {}
            starts = []
            for i, (what, mb, c) in enumerate(order):
                starts.append(len(self.events))
                self.walk = step == steps and i in walked
                self.sizes = sizes
                if what == "F":
                    live[mb, c] = self._forward(mb, c)
                else:
                    self._backward(live.pop((mb, c)), mb, c)
            starts.append(len(self.events))
            periods += [(starts[i], starts[i + 2]) for i in pairs]
            self.walk = step == steps
            self.phases.append((f"optimizer step {step}", len(self.events)))
            self._optimizer(step == 1)
            self.ev = 0
        self.phases.append(("end", len(self.events)))
        return AllocationStream(self.events, self.marks, self.phases, self.step, self.stage, tuple(periods))
