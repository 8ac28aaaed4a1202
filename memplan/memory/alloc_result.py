"""What a replay through memplan's caching-allocator model (memplan.memory.allocator) reports: `ReplayResult`, in
the names of torch.cuda.memory_stats() where there is one, the first out-of-memory (`OutOfMemory`) with what
PyTorch's message would say, and `format_size`, the byte count as that message writes it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


def format_size(size: int) -> str:
    """A byte count as PyTorch's out-of-memory message writes it (`format_size`): bytes up to 1 KiB, then KiB,
    MiB up to 1 GiB, then GiB, two decimals."""
    if size <= 1024:
        return f"{size} bytes"
    if size <= 1 << 20:
        return f"{size / 1024:.2f} KiB"
    if size <= 1 << 30:
        return f"{size / (1 << 20):.2f} MiB"
    return f"{size / (1 << 30):.2f} GiB"


@dataclass(frozen=True)
class OutOfMemory:
    """The event the run dies at, and the state the allocator reports in its OutOfMemoryError (after it has
    released every cached whole segment)."""

    event_index: int
    tensor_id: Any
    stream: int
    requested_bytes: int
    rounded_bytes: int
    tried_to_allocate_bytes: int  # the segment it asked for: PyTorch's "Tried to allocate" is get_allocation_size
    allocated_bytes: int
    reserved_bytes: int
    capacity_bytes: int

    @property
    def reserved_unallocated_bytes(self) -> int:
        return self.reserved_bytes - self.allocated_bytes

    @property
    def message(self) -> str:
        """The lines of PyTorch's message the replay knows (the allocator's capacity stands for the GPU's)."""
        return (f"CUDA out of memory. Tried to allocate {format_size(self.tried_to_allocate_bytes)}. The allocator "
                f"may hold {format_size(self.capacity_bytes)} of which "
                f"{format_size(self.capacity_bytes - self.reserved_bytes)} is free. Of the allocated memory "
                f"{format_size(self.allocated_bytes)} is allocated by PyTorch, and "
                f"{format_size(self.reserved_unallocated_bytes)} is reserved by PyTorch but unallocated.")


@dataclass(frozen=True)
class ReplayResult:
    """What a replay measured, in the names of torch.cuda.memory_stats() where there is one.

    reserved_peak_bytes: reserved_bytes.all.peak (max_memory_reserved).
    allocated_peak_bytes: allocated_bytes.all.peak (max_memory_allocated): rounded block sizes, with the
        unsplit remainder a block was handed out with.
    requested_peak_bytes: requested_bytes.all.peak: the sizes as asked.
    inactive_split_bytes_at_reserved_peak: inactive_split_bytes.all.current after the event that set the reserved
        peak: free bytes inside segments that still hold a live block (expandable segments excluded, as PyTorch).
    inactive_split_peak_bytes: inactive_split_bytes.all.peak.
    segments_at_reserved_peak: segments after that event (an expandable segment counts as one).
    segments_peak: segment.all.peak: the most cudaMalloc'd segments at once; an expandable segment is never one
        (memplan.memory.alloc_rules.count_cuda_segment).
    segment_allocs: the sizes cudaMalloc'd, in order (the snapshot's SEGMENT_ALLOC trace entries).
    num_alloc_retries / num_ooms: as memory_stats (num_ooms is 0 or 1: the replay stops at the first).
    events_replayed: events done before the out-of-memory (all of them when it fits).
    reserved_end_bytes / allocated_end_bytes: after the last event replayed.
    oom: the first out-of-memory, or None.
    """

    reserved_peak_bytes: int
    allocated_peak_bytes: int
    requested_peak_bytes: int
    inactive_split_bytes_at_reserved_peak: int
    inactive_split_peak_bytes: int
    segments_at_reserved_peak: int
    num_alloc_retries: int
    num_ooms: int
    events_replayed: int
    reserved_end_bytes: int
    allocated_end_bytes: int
    oom: Optional[OutOfMemory]
    segments_peak: int = 0
    segment_allocs: tuple[int, ...] = ()

    @property
    def fits(self) -> bool:
        return self.oom is None
