"""The fit verdict of a plan over every pipeline stage (issue 20): what one GPU of each stage needs, its allocated
peak + the flat margin + the runtime, and with a budget its run replayed through the caching allocator
(memplan/memory/reserved.py) on the budget less the runtime. The plan fits when every stage does; the stage that
decides is the first whose run dies (the earliest phase of the run: model built, optimizer created, step 1, ...; in
one phase the lowest stage: the replays do not order the events of different GPUs in time), else the one that
needs the most (ties: the most loaded, the highest allocated peak).

Why every stage and not only the most loaded: fragmentation differs per stage. Stage 0 holds the most micro-batches
in flight and the embedding, whose weight gradient (v x h, 1 GB for a 128k vocabulary at h = 4096 in bf16) is made
in the backward when only layer-sized blocks have been freed, so it takes a segment of its own that stays reserved;
the last stage holds the head and the vocab-sized logits; uneven or interleaved stages hold other layers. A stage
with a lower allocated peak can therefore reserve more and die first (tests/test_stage_verdict.py).

Which stages are replayed: the most loaded one always (its replay is the verdict of a plan of one stage), and every
other stage whose allocated peak x RESERVED_RATIO + runtime exceeds the budget. A stage below that would need its
allocator to reserve more than 1.5 times its allocated peak to run out of memory (its replay with no pressure is
then the whole replay: it completes), more than any training step measured so far: reserved / allocated peak from
1.04 to 1.42 on an H100 (transformers steps, ../shared/reference/allocator.md), at most 43 % wasted in the published
reports on pipelines with recompute (STAlloc), and at most 1.06 in memplan's own replays of every stage of the
plans the gpt3-530b search lists and of tests/test_stage_verdict.py's plan. That is evidence, not a proof: no cheap bound limits what a best-fit allocator reserves beyond the live
bytes in general. A stage not replayed counts its allocated peak + margin + runtime. The rule is the same for
`estimate`, `search` and `--max-seq`, so the three decide a plan alike. Stages whose streams are the same, event for
event (the compact form the replay reads, compared), are replayed once. With `report` False (search, --max-seq: the
verdict alone) the stages are replayed most loaded first and the first run that dies ends it: the plan does not fit,
whatever the others do.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from memplan.core.specs import Config, GpuSpec
from memplan.core.training import TrainingSpec
from memplan.inventory.types import Inventory
from memplan.memory.device import DeviceMemory, device_memory
from memplan.memory.pipeline import replayed_microbatches
from memplan.memory.pipeline_multi import is_multi
from memplan.memory.reserved import Replay, Reserved, replay_run
from memplan.memory.stage import StageMemory
from memplan.memory.stream import not_streamed
from memplan.memory.stream_events import AllocationStream
from memplan.memory.stream_lengths import StreamLengths
from memplan.memory.stream_traced import run_stream
from memplan.memory.term_bytes import PlanValues
from memplan.memory.timeline import StepPeak, stages_by_load

# a stage other than the most loaded is replayed when its allocated peak x this + runtime exceeds the budget (above)
RESERVED_RATIO = (3, 2)


def not_replayed(training: TrainingSpec, plan: PlanValues) -> str:
    """What of the plan the allocation stream does not model ("" when it models all of it): memplan/memory/stream.py
    not_streamed, and torchtitan's multi-stage schedules (a rank's chunks differ in size; a split backward)."""
    multi = f"torchtitan's {plan.schedule} schedule" if is_multi(plan.schedule) else ""
    return ", ".join(x for x in (not_streamed(training, plan), multi) if x)


@dataclass(frozen=True)
class StageVerdict:
    """One GPU of one stage: what it needs (`device`: allocated peak + fragmentation + runtime, the fragmentation
    the replay's where it reserved more than the margin) and its replay (None: not replayed)."""

    stage: int
    device: DeviceMemory
    reserved: Optional[Reserved] = None
    same_as: Optional[int] = None  # the stage whose identical stream was replayed for this one
    phase_rank: int = 0  # where its run dies: the position of that phase in the run (0 when it does not die)

    @property
    def dies(self) -> bool:
        return self.reserved is not None and not self.reserved.fits


def worth_replaying(device: DeviceMemory, budget_bytes: int) -> bool:
    """Whether the stage's allocated peak x RESERVED_RATIO + runtime exceeds the budget (module docstring)."""
    num, den = RESERVED_RATIO
    return device.allocated_peak * num > (budget_bytes - device.runtime_bytes) * den


@dataclass(frozen=True)
class Verdict:
    """The plan's verdict: the stage that decides and every stage decided (in stage order; with report False, the
    stages replayed up to the first whose run dies)."""

    stage: int
    stages: tuple[StageVerdict, ...]

    @property
    def decided(self) -> StageVerdict:
        return next(s for s in self.stages if s.stage == self.stage)

    @property
    def device(self) -> DeviceMemory:
        return self.decided.device

    @property
    def reserved(self) -> Optional[Reserved]:
        return self.decided.reserved


def _needs(flat: DeviceMemory, reserved: Reserved) -> DeviceMemory:
    """What the stage needs with its replay: when the replay reserves more beyond the allocated peak than the margin
    (or dies: then at least the capacity + 1 B, what it would need is not known), that is the fragmentation."""
    needed = reserved.result.reserved_peak_bytes if reserved.fits else reserved.capacity_bytes + 1
    replayed = needed - flat.allocated_peak
    if replayed <= flat.fragmentation_bytes:
        return flat
    return dataclasses.replace(flat, fragmentation_bytes=replayed, margin_bytes=flat.fragmentation_bytes)


def decide(config: Config, inventory: Inventory, plan: PlanValues, mems: list[StageMemory], steps: list[StepPeak],
           gpu: Optional[GpuSpec], budget_bytes: Optional[int], fragmentation_margin: Optional[float],
           replay: Replay = Replay(), report: bool = True, lengths: Optional[StreamLengths] = None,
           every_stage: bool = True) -> Verdict:
    """The verdict of every stage (`mems`, `steps`: one GPU of each; which are replayed: the module docstring).
    Without a budget, or for a
    plan the allocation stream does not model, the flat margin alone: the most loaded stage decides. Each stage's run
    is its 1F1B schedule with at most its in-flight micro-batches + 2 per step (the steady state repeats; the peak
    is the same). `report` False: the verdict alone (replays stop at the first run that dies; none is replayed
    again with expandable segments). `lengths`: the plan's streams at the other lengths a search replays
    (memplan/memory/stream_lengths.py), by stage, and the most loaded stage's replays at each with `every_stage`
    False (`--max-seq`'s check of every stage at the length those settled on does not replay that stage again: the
    same stream and capacity give the same replay). `every_stage` False: the most loaded stage's replay alone (a
    necessary condition of the verdict, which `--max-seq` navigates its lengths by: plan/limits.py)."""
    order = stages_by_load(steps, mems)  # most loaded first
    flat = [device_memory(step.peak_bytes, plan, inventory, gpu, fragmentation_margin) for step in steps]
    if budget_bytes is None or not_replayed(config.training, plan):
        return Verdict(order[0], (StageVerdict(order[0], flat[order[0]]),))
    done: dict[tuple, StageVerdict] = {}  # by the stream's content and capacity
    streams: dict[int, tuple[AllocationStream, list[int]]] = {}
    decided = []
    for i in order:
        if i != order[0] and not (every_stage and worth_replaying(flat[i], budget_bytes)):
            decided.append(StageVerdict(i, flat[i]))
            continue
        capacity = budget_bytes - flat[i].runtime_bytes
        known = None if lengths is None else lengths.replays.get((mems[i].stage, config.model.seq_length, capacity,
                                                                  replay))
        stream, ops = _stream(config, inventory, plan, mems[i], gpu, replay, lengths) if known is None else known[:2]
        key = (capacity, len(ops), hash(tuple(ops)))
        seen = done.get(key)
        if seen is not None and streams[seen.stage][1] == ops:
            decided.append(StageVerdict(i, _needs(flat[i], seen.reserved), dataclasses.replace(seen.reserved, stage=i),
                                        seen.stage, seen.phase_rank))
        else:
            if known is None:  # (a run replayed at this length before: its verdict again, the same replay)
                reserved = replay_run(stream, capacity, replay, try_expandable=False, ops=ops)
                known = stream, ops, reserved, _phase_rank(stream, reserved)
                if lengths is not None and not every_stage:  # (the most loaded stage's, which the check of every
                    # stage at one of these lengths replays again; kept alone: every stage's streams kept would cost
                    # the garbage collector more than their replays save)
                    lengths.replays[mems[i].stage, config.model.seq_length, capacity, replay] = known
            reserved = known[2]
            done[key] = StageVerdict(i, _needs(flat[i], reserved), reserved, None, known[3])
            streams[i] = stream, ops
            decided.append(done[key])
        if decided[-1].dies and not report:
            break
    died = [s for s in decided if s.dies]
    stage = (min(died, key=lambda s: (s.phase_rank, s.stage)) if died else
             max(decided, key=lambda s: (s.device.total, -order.index(s.stage)))).stage
    if died and report:
        decided = _with_expandable(decided, stage, streams, replay)
    return Verdict(stage, tuple(sorted(decided, key=lambda s: s.stage)))


def _stream(config: Config, inventory: Inventory, plan: PlanValues, mem: StageMemory, gpu: Optional[GpuSpec],
            replay: Replay, lengths: Optional[StreamLengths]) -> tuple[AllocationStream, list[int]]:
    """The run of one GPU of the stage and its compact form (`lengths`: made or evaluated there, by stage)."""
    replayed_plan = dataclasses.replace(plan, microbatches=replayed_microbatches(
        int(mem.stage), int(plan.p), int(plan.m), int(plan.microbatches), plan.schedule))

    def make() -> AllocationStream:
        return run_stream(config.model, inventory, config.training, replayed_plan, mem.stage, mem,
                          first_step_seq_len=replay.first_step_seq_len,
                          workspace_bytes=gpu.workspace_bytes if gpu is not None else 0)

    if lengths is None:
        stream = make()
        return stream, stream.ops()
    return lengths.get(mem.stage, config.model.seq_length, make)


def _phase_rank(stream: AllocationStream, reserved: Reserved) -> int:
    """The position in the run of the phase its replay dies in (0 when it completes)."""
    oom = reserved.result.oom
    return 0 if oom is None else sum(1 for _, start in stream.phases if start <= oom.event_index)


def _with_expandable(decided: list[StageVerdict], stage: int, streams: dict[int, tuple[AllocationStream, list[int]]],
                     replay: Replay) -> list[StageVerdict]:
    """With the default allocator a stage's run dies: whether every stage's run completes with expandable segments
    (each distinct stream replayed once more with them), set on the deciding stage's replay (the report then says
    that they would fit the plan)."""
    from_replay = next(s.reserved for s in decided if s.stage == stage)
    if from_replay.allocator != "default":
        return decided
    settings = dataclasses.replace(replay, allocator="expandable")
    fits = all(replay_run(stream, s.reserved.capacity_bytes, settings, try_expandable=False, ops=ops).fits
               for s in decided if s.stage in streams for stream, ops in [streams[s.stage]])
    return [dataclasses.replace(s, reserved=dataclasses.replace(s.reserved, expandable_fits=fits))
            if s.stage == stage else s for s in decided]
