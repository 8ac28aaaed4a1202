"""What the GPU needs for a step beyond its tensors' peak (memplan/memory/timeline.py): cuBLAS's workspace beside them in
PyTorch's pool, the caching allocator's margin above that (or the replay's fragmentation) and the memory outside PyTorch's
pool (the runtime, NCCL's communicators)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from memplan.core.arith import maximum
from memplan.core.specs import GpuSpec
from memplan.inventory.step_order import runs_traced
from memplan.inventory.titan_async_tp import workspace_bytes
from memplan.inventory.types import Inventory
from memplan.memory.term_bytes import PlanValues


@dataclass(frozen=True)
class DeviceMemory:
    """What the GPU needs for the step: the tensors' peak, the cuBLAS workspace beside them in
    PyTorch's pool (together: torch.cuda.max_memory_allocated), the caching allocator's margin
    above that and the memory outside PyTorch's pool."""

    peak_bytes: Any  # the step timeline's peak (tensors)
    workspace_bytes: Any
    fragmentation_bytes: Any
    runtime_bytes: Any
    margin: float
    # set when the caching allocator's replay (memory/reserved.py) reserved more than the margin: the margin's bytes
    # the replayed fragmentation replaced (what search's vectorised bound counts)
    margin_bytes: Any = None
    # of runtime_bytes: torchtitan's async TP symmetric-memory workspace (memplan/inventory/titan_async_tp.py), made by
    # the run's code outside PyTorch's pool, not by the GPU preset
    symm_workspace_bytes: Any = 0

    @property
    def allocated_peak(self) -> Any:
        return self.peak_bytes + self.workspace_bytes

    @property
    def total(self) -> Any:
        return self.allocated_peak + self.fragmentation_bytes + self.runtime_bytes

    @property
    def replayed(self) -> bool:
        """The fragmentation is the caching allocator's replay, above the margin."""
        return self.margin_bytes is not None

    @property
    def flat_total(self) -> Any:
        """The total with the flat margin, before any replay: the bound search evaluates for every plan."""
        margin = self.fragmentation_bytes if self.margin_bytes is None else self.margin_bytes
        return self.allocated_peak + margin + self.runtime_bytes


MAX_COMMUNICATORS = 5  # `communicators`: the tensor-, pipeline-, data-, context- and expert-parallel groups


def communicators(plan: PlanValues) -> Any:
    """NCCL communicators a rank of the plan creates: its tensor-, pipeline- and data-parallel
    groups of more than one rank."""
    return 1 * (plan.t > 1) + 1 * (plan.p > 1) + 1 * (plan.d > 1) + 1 * (plan.cp > 1) + 1 * (plan.ep > 1)


def device_memory(peak_bytes: Any, plan: PlanValues, inventory: Inventory, gpu: Optional[GpuSpec],
                  margin: Optional[float] = None) -> DeviceMemory:
    """The tensors' peak + the cuBLAS workspace, the GPU preset's margin on both (none with Inventory.stream_checked
    and for plans whose stream is a traced order, step_order.runs_traced: the replay decides) and the runtime's own
    memory (all from the GPU preset; none without a GPU), with async TP's symmetric-memory workspace (the run's own,
    outside the pool: memplan/inventory/titan_async_tp.py) beside it."""
    symm = workspace_bytes(inventory.symm_workspace_bytes, plan.b, plan.t) if inventory.symm_workspace_bytes else 0
    if gpu is None:
        m = margin or 0.0
        return DeviceMemory(peak_bytes, 0, fraction_bytes(peak_bytes, m), 0 * peak_bytes + symm, m,
                            symm_workspace_bytes=symm)
    traced = runs_traced(inventory.step_order, plan) if inventory.step_order and margin is None else False
    one = not getattr(traced, "ndim", 0) and bool(traced)  # one plan, a traced order's
    m = (0.0 if inventory.stream_checked or one else gpu.fragmentation_margin) if margin is None else margin
    extra = maximum(communicators(plan) - 1, 0) if inventory.runtime == "megatron" else communicators(plan)  # the
    # megatron figure was measured with one communicator already in it
    frag = fraction_bytes(peak_bytes + gpu.step_workspace_bytes, m)
    return DeviceMemory(peak_bytes, gpu.step_workspace_bytes, frag - frag * traced,
                        gpu.runtime_bytes.get(inventory.runtime) + extra * gpu.nccl_communicator_bytes + symm, m,
                        symm_workspace_bytes=symm)


def fraction_bytes(n: Any, margin: float) -> Any:
    """ceil(n * margin) in integers (margin to 1e-6), exact in int64 arrays too: with n = q 10^6 + r (0 <= r < 10^6),
    ceil(n micro / 10^6) = q micro + ceil(r micro / 10^6), whose products stay within |n| and 10^12 (n micro
    itself wraps past 2^63 from n ~ 9.2e12 at margin 1)."""
    micro = round(margin * 1_000_000)
    q, r = n // 1_000_000, n % 1_000_000
    return q * micro - (-(r * micro) // 1_000_000)
