"""The verdict at the margin: a run's allocation stream (memory/stream.py) replayed through the model of PyTorch's
caching allocator (memory/allocator.py, rules in ../shared/reference/allocator.md) on the memory the allocator may
take: the device's memory (the budget) less what lives outside PyTorch's pool (CUDA context, kernels, NCCL). A plan
fits when the replay of one GPU of every pipeline stage completes (memplan/plan/stage_verdict.py); what the allocator
reserved at its peak, the free bytes inside its segments (inactive split) and, when the run dies, the allocation it
dies at, are reported.

Derived, not measured: the stream's per-tensor order is derived from the step timeline, and the replay model has
not been checked against a GPU's memory_stats (no GPU was lent; the harness that would record a real run's trace
is issue 20 item 5). A replay covers one GPU of one stage, for the run of a training script: model built, optimizer
created, two steps.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from memplan.core.errors import MemplanError
from memplan.core.specs import Config
from memplan.inventory.assemble import training_inventory
from memplan.inventory.hf import check_hf_plan
from memplan.inventory.types import HF_IMPLS
from memplan.memory.alloc_conf import AllocatorConfig, parse_alloc_conf
from memplan.memory.allocator import ReplayResult, replay_ops
from memplan.memory.stage import stage_memory
from memplan.memory.stream import AllocationStream
from memplan.memory.stream_traced import run_stream
from memplan.memory.term_bytes import PlanValues
from memplan.memory.timeline import most_loaded_stage, step_events

ALLOCATORS = ("default", "expandable")
EXPANDABLE_CONF = "expandable_segments:True"  # what the report says to export when only expandable segments fit


def allocator_config(allocator: str = "default", alloc_conf: Optional[str] = None) -> AllocatorConfig:
    """The allocator's settings: `alloc_conf` in PYTORCH_CUDA_ALLOC_CONF syntax, with expandable segments on for
    allocator "expandable" (the conf may say so itself; it may not contradict the allocator named)."""
    if allocator not in ALLOCATORS:
        raise MemplanError(f"--allocator must be one of {', '.join(ALLOCATORS)}, got {allocator!r}")
    config = parse_alloc_conf(alloc_conf) if alloc_conf else AllocatorConfig()
    if config.backend != "native":
        raise MemplanError("the cudaMallocAsync backend is the driver's pool, not modelled: use backend:native")
    if allocator == "expandable":
        return replace(config, expandable_segments=True)
    return config


def allocator_name(config: AllocatorConfig) -> str:
    return "expandable" if config.expandable_segments else "default"


def allocator_label(allocator: str, alloc_conf: Optional[str]) -> str:
    """How reports name the allocator a replay ran: "default", or "expandable, max_split_size_mb:512"."""
    return f"{allocator}, {alloc_conf}" if alloc_conf else allocator


def launch_alloc_conf(allocator: str, alloc_conf: Optional[str], expandable_fits: Optional[bool] = None) -> str:
    """The PYTORCH_CUDA_ALLOC_CONF a launch needs to run as planned ("" when the default allocator will do): the
    conf given, with expandable segments when planned with them (allocator "expandable") or when the run dies with
    the default allocator and fits with them (a replay's expandable_fits)."""
    expandable = allocator == "expandable" or bool(expandable_fits)
    parts = [alloc_conf] if alloc_conf else []
    if expandable and not allocator_config("default", alloc_conf).expandable_segments:
        parts.append(EXPANDABLE_CONF)
    return ",".join(parts)


@dataclass(frozen=True)
class Replay:
    """How a run is replayed through the caching allocator: the allocator (`ALLOCATORS`), its settings in
    PYTORCH_CUDA_ALLOC_CONF syntax, and the run's history: step 1, where AdamW creates its states lazily, at
    `first_step_seq_len` tokens and the later steps at the plan's (None: every step at the plan's length, the
    ordinary training loop)."""

    allocator: str = "default"
    alloc_conf: Optional[str] = None
    first_step_seq_len: Optional[int] = None

    @property
    def label(self) -> str:
        """How reports name it: "default", "expandable, max_split_size_mb:512; step 1 at s = 2,048"."""
        history = f"; step 1 at s = {self.first_step_seq_len:,}" if self.first_step_seq_len else ""
        return allocator_label(self.allocator, self.alloc_conf) + history

    def launch_conf(self, expandable_fits: Optional[bool] = None) -> str:
        """The PYTORCH_CUDA_ALLOC_CONF a launch needs to run as planned (`launch_alloc_conf`)."""
        return launch_alloc_conf(self.allocator, self.alloc_conf, expandable_fits)


@dataclass(frozen=True)
class Reserved:
    """The replay of one GPU's run: the allocator's settings, the memory it may take, what it measured, the
    event the run dies at (None when it fits) and, when it dies with the default allocator, whether the same
    run fits with expandable segments."""

    allocator: str  # default | expandable
    alloc_conf: str  # the PYTORCH_CUDA_ALLOC_CONF text given ("" when none)
    capacity_bytes: int  # the budget less the memory outside PyTorch's pool
    stage: int
    events: int  # allocations and frees in the run
    result: ReplayResult
    oom_event: Optional[dict]  # index, name, kind, phase, requested / tried bytes, PyTorch's message
    expandable_fits: Optional[bool] = None
    first_step_seq_len: Optional[int] = None  # the run's history (Replay)

    @property
    def fits(self) -> bool:
        return self.result.fits

    @property
    def label(self) -> str:
        return Replay(self.allocator, self.alloc_conf, self.first_step_seq_len).label


def replay_stream(stream: AllocationStream, capacity_bytes: int, config: AllocatorConfig,
                  ops: Optional[list[int]] = None) -> ReplayResult:
    """The stream's allocations (requested sizes; the model rounds them) and frees through the allocator (`ops`:
    the stream's `ops()`, when made already)."""
    return replay_ops(stream.ops() if ops is None else ops, capacity_bytes, config)


def _oom_event(stream: AllocationStream, result: ReplayResult) -> Optional[dict]:
    oom = result.oom
    if oom is None:
        return None
    event = stream.event_at(oom.event_index)
    phase = next((name for name, start in reversed(stream.phases) if start <= oom.event_index), "")
    return {"index": oom.event_index, "name": event.name, "kind": event.kind, "phase": phase,
            "requested_bytes": oom.requested_bytes, "tried_to_allocate_bytes": oom.tried_to_allocate_bytes,
            "allocated_bytes": oom.allocated_bytes, "reserved_bytes": oom.reserved_bytes, "message": oom.message}


def replay_run(stream: AllocationStream, capacity_bytes: int, settings: Replay = Replay(),
               try_expandable: bool = True, ops: Optional[list[int]] = None) -> Reserved:
    """The verdict of one GPU's run (`stream`, made with the settings' history): replayed with the allocator asked
    for, and when that dies with the default allocator, once more with expandable segments (the report then says
    that they would fit it; `try_expandable` False: not tried, the verdict alone is wanted). `ops`: the run's
    compact form when it is not the stream's own (memplan/memory/stream_lengths.py: its sizes at another length)."""
    config = allocator_config(settings.allocator, settings.alloc_conf)
    ops = stream.ops() if ops is None else ops
    result = replay_stream(stream, max(capacity_bytes, 0), config, ops)
    expandable = None
    if try_expandable and not result.fits and not config.expandable_segments:
        expandable = replay_stream(stream, max(capacity_bytes, 0), replace(config, expandable_segments=True), ops).fits
    return Reserved(allocator_name(config), settings.alloc_conf or "", capacity_bytes, stream.stage, len(stream),
                    result, _oom_event(stream, result), expandable, settings.first_step_seq_len)


def allocation_stream(config: Config, impl: str = "megatron", device: str = "cuda", stage: Optional[int] = None,
                      steps: int = 2, first_step_seq_len: Optional[int] = None,
                      workspace_bytes: int = 0) -> AllocationStream:
    """The allocation stream of `config` run by `impl` (as `estimate` builds its inventory and plan) on one GPU
    of `stage` (default: the most loaded, as `estimate` picks it). `first_step_seq_len`: step 1 runs at that
    sequence length (the lazily created states then land among other activations); `workspace_bytes`: the
    cuBLAS workspace, allocated at the first forward and kept."""
    if impl in HF_IMPLS:
        check_hf_plan(config, impl)
    inventory = training_inventory(config.model, impl, device, config.training)
    plan = PlanValues.from_config(config)
    mems = [stage_memory(config.model, inventory.terms, config.training, plan, i, granularity=inventory.granularity,
                         layout=inventory.weight_layout) for i in range(config.parallel.pp)]
    if stage is None:
        stage = most_loaded_stage([step_events(config.model, inventory, config.training, plan, mem, i, critical=True)
                                   for i, mem in enumerate(mems)], mems)
    return run_stream(config.model, inventory, config.training, plan, stage, mems[stage], steps, first_step_seq_len,
                      workspace_bytes)
