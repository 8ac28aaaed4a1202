"""The allocation stream of a run whose inventory carries its traced step's order (issue 20): every step's forward and
backward are the real code's allocations and frees in order, traced under FakeTensorMode with symbolic s and b
(memplan/inventory/step_order.py, a traced inventory file's `step_order`), sized at the plan's s and b; the rest of
the run is memplan's own stream's (memplan/memory/stream.py `stream_for`): the model built, the optimizer created,
AdamW's states made lazily in step 1's optimizer call (foreach or fused: its temporaries), zero_grad. This module owns
the choice (`traced_order`: which plans the traced order is the code of) and the join (`splice`); `run_stream` is
what estimate, `--max-seq` (memplan/memory/stream_lengths.py: the traced sizes are polynomials too) and search make
a plan's stream with.

The join: of each step of memplan's stream only cuBLAS's two workspaces (the trace sees no kernel's own buffers) and
the frees of tensors made before the step are kept; the traced step follows, each workspace where the trace's marker
puts it (after the output of the first matmul of its thread: the forward's, autograd's), as every CUDA recording has
it (tests/data/alloc/cuda); the traced tensors still alive after the backward (the .grad tensors) are freed where
zero_grad frees them, after the optimizer step. With it memplan's replay gives the H100's verdict at every recorded
llama3-8b length (tests/test_alloc_stream_cuda.py). What the trace cannot see is left out: the buffers kernels
allocate inside themselves (cuDNN attention's backward workspace, CUDA reductions' staging; freed at once, added with
sizes fitted to the recordings they moved no recorded llama3-8b figure by a MB: docs/how-it-works.md).

The traced order is the code traced: one GPU (no tensor, pipeline, context or data parallelism), one micro-batch per
step, bf16 weights, gradients and activations without master weights (bf16-true), gradient checkpointing of none or
every layer, and an inventory no training setting changed (memplan/inventory/assemble.py keeps the order only then);
any other plan gets memplan's derived stream. A plan that gets the traced stream has its fit decided by the replay
alone, no flat margin (memplan/memory/timeline.py device_memory, in estimate and in search's vectorised bound).
The stream's `marks` (the timeline's events at stream positions) are empty: the traced step's live bytes are the real code's, not the timeline's moment by moment.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.core.training import Recompute, TrainingSpec
from memplan.inventory.step_order import runs_traced
from memplan.inventory.types import Inventory
from memplan.memory.stage import StageMemory, stage_memory
from memplan.memory.stream import stream_for
from memplan.memory.stream_events import Alloc, AllocationStream, Free, new_event
from memplan.memory.stream_lengths import ceil_at
from memplan.memory.term_bytes import PlanValues
from memplan.memory.timeline import step_events

_RECOMPUTE = {int(Recompute.NONE): "none", int(Recompute.FULL): "full"}
_KINDS: dict[int, tuple] = {}  # id(order) -> (order, each allocation's kind): the order kept while cached


def traced_order(model: ModelSpec, inventory: Inventory, training: TrainingSpec, plan: PlanValues) -> Optional[tuple]:
    """The traced step (`step_order.expand`'s events) the plan's stream is made of; None where the plan is not the
    code traced (`step_order.runs_traced`; the inventory keeps the order only for the dtypes and settings traced:
    memplan/inventory/assemble.py) or the inventory has no order."""
    if not inventory.step_order or not runs_traced(inventory.step_order, plan):
        return None
    return next(events for recompute, _, events in inventory.step_order
                if recompute == _RECOMPUTE[int(plan.recompute)])


def run_stream(model: ModelSpec, inventory: Inventory, training: TrainingSpec, plan: PlanValues, stage: int,
               stage_mem: Optional[StageMemory] = None, steps: int = 2, first_step_seq_len: Optional[int] = None,
               workspace_bytes: int = 0) -> AllocationStream:
    """The run's stream on one GPU of `stage` (`stream_for`'s arguments): its steps traced where the inventory has
    the order of this plan's code (`traced_order`), else memplan's derived stream."""
    order = traced_order(model, inventory, training, plan)
    if order is None:
        return stream_for(model, inventory, training, plan, stage, stage_mem, steps, first_step_seq_len,
                          workspace_bytes)
    if stage_mem is None:
        stage_mem = stage_memory(model, inventory.terms, training, plan, stage, granularity=inventory.granularity,
                                 layout=inventory.weight_layout)
    # memplan's run without the step's tensors (the splice drops them): the same build, optimizer, zero_grad and
    # workspaces (tests/test_stream_traced.py), made ten times faster than with the traced inventory's moments
    bare = replace(inventory, terms=(), moments=(), held=(), checkpointed_forward=())
    stream = stream_for(model, bare, training, plan, stage, stage_mem, steps, first_step_seq_len, workspace_bytes)
    step = step_events(model, inventory, training, plan, stage_mem, stage)
    return splice(replace(stream, step=step), order, model.seq_length, int(plan.b), first_step_seq_len,
                  inventory.granularity)


def kinds_of(order: tuple) -> tuple:
    """Each traced allocation's kind: a gradient when it outlives the backward (a .grad), a saved activation when
    made in the forward and freed in the backward, else a transient."""
    hit = _KINDS.get(id(order))
    if hit is not None and hit[0] is order:
        return hit[1]
    made, freed, forward_end = [], {}, 0
    for k, e in enumerate(order):
        if e[0] == "+":
            made.append((k, e[2]))
            if e[2] == "embedding" or e[2].endswith(" forward"):
                forward_end = k
        elif e[0] == "-":
            freed[e[1]] = k
    kinds = tuple("gradient" if n not in freed else "saved_activation" if k <= forward_end < freed[n]
                  else "transient" for n, (k, _) in enumerate(made))
    _KINDS[id(order)] = (order, kinds)
    return kinds


def splice(stream: AllocationStream, order: tuple, s: int, b: int, first_s: Optional[int] = None,
           granularity: int = 1) -> AllocationStream:
    """memplan's `stream` with each step's forward and backward the traced `order` at s and b (step 1 at `first_s`
    where given): the join of the module docstring. Ids are renumbered in allocation order, as the replay wants."""
    events = stream.events
    kinds = kinds_of(order)
    out: list = []
    renamed: dict[int, int] = {}  # memplan's id -> the new stream's
    dropped: set = set()
    left: list[int] = []
    phases: list[tuple[str, int]] = []

    def keep(e: Alloc) -> None:
        renamed[e.id] = len(renamed) + len(made)
        out.append(e._replace(id=renamed[e.id]))

    made: list[int] = []  # the traced allocations' new ids, over every step
    for (name, start), (_, end) in zip(stream.phases, stream.phases[1:]):
        phases.append((name, len(out)))
        if not name.startswith("step "):
            for e in events[start:end]:
                if type(e) is Alloc:
                    keep(e)
                elif e.id not in dropped:
                    out.append(new_event(Free, (renamed[e.id],)))
            if name.startswith("optimizer step "):  # zero_grad(set_to_none=True): the traced .grad tensors
                out += [new_event(Free, (i,)) for i in reversed(left)]
                left = []
            continue
        at = first_s if first_s and name == "step 1" else s
        workspaces: dict[int, Alloc] = {}
        for e in events[start:end]:
            if type(e) is Alloc:
                if e.kind == "workspace":
                    workspaces[2 if "(backward)" in e.name else 1] = e
                else:
                    dropped.add(e.id)
            elif e.id not in dropped:
                out.append(new_event(Free, (renamed[e.id],)))
        alive: dict[int, int] = {}  # the traced allocation's number -> its id
        sizes: dict = {}
        number = 0
        for e in order:
            if e[0] == "+":
                poly = e[1]
                hit = sizes.get(id(poly))  # one Poly object per distinct size (step_order.expand)
                if hit is None:
                    size = ceil_at(poly, at, b)
                    if size is None or size < 1:
                        raise MemplanError(f"the traced step's size {poly} is not a positive polynomial in s and b")
                    hit = sizes[id(poly)] = (size, -(-size // granularity) * granularity)
                size, counted = hit
                i = alive[number] = len(renamed) + len(made)
                made.append(i)
                out.append(new_event(Alloc, (i, size, 0, kinds[number], f"traced ({e[2]})", poly, counted)))
                number += 1
            elif e[0] == "-":
                out.append(new_event(Free, (alive.pop(e[1]),)))
            elif e[1] in workspaces:
                keep(workspaces.pop(e[1]))
        for e in workspaces.values():  # a workspace whose matmul the trace lacks: after the step
            keep(e)
        left = list(alive.values())
    phases.append(("end", len(out)))
    return AllocationStream(out, [], phases, stream.step, stream.stage)
