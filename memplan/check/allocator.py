"""`memplan validate --allocator`: the allocation streams of real runs (validation/alloc_trace.py: build the model,
create the optimizer, two steps, every allocation and free in order) replayed through memplan's caching-allocator
model (memory/allocator.py), against memplan's own stream of the same run (memory/reserved.allocation_stream) and,
on CUDA, against what PyTorch's allocator itself reported (`max_memory_reserved`, `max_memory_allocated`, the
segments cudaMalloc'd in order and at most at once, inactive split bytes, retries), which the replay of the recorded
trace, its segments placed at the device's addresses and the card's capacity less what lives outside the pool, must
reproduce exactly (issue 20 item 5; tests/test_alloc_fixtures_cuda.py replays such recordings made on an H100).

On CPU there is no caching allocator: the recorded stream is the real code's order of storages (op outputs; the
temporaries an op frees inside itself are not seen), and the check is that the recording's live peak is what
memplan's stream peaks at (the whole-step claim, 1 %); the reserved peaks of both replays are shown side by side,
derived. `ALLOCATOR_CASES` are small Llama-shaped transformers steps; `MAX_SEQ_CASES` the llama3-8b-class runs whose
first failing length only a GPU measures (`first_failing`). torch is imported only when a run is recorded.
"""

from __future__ import annotations

import importlib
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from memplan.check.peak import PEAK_TOLERANCE, PeakCase, card_preset, peak_config, step_fields
from memplan.core.harness import harness
from memplan.core.specs import Config, GpuSpec
from memplan.memory.alloc_conf import AllocatorConfig
from memplan.memory.allocator import ReplayResult, replay
from memplan.memory.reserved import (ALLOCATORS, EXPANDABLE_CONF, Replay, allocation_stream, allocator_config,
                                     replay_stream)
from memplan.plan.limits import max_seq_len
from memplan.presets.files import configs_dir

# small Llama-shaped transformers steps (sdpa, bf16 weights and AdamW states; the logits 8 MiB, beyond the small
# pool): torch's default (foreach) and fused AdamW, with and without gradient checkpointing
_SMALL = dict(model="llama", attn="sdpa", s=256, b=2, h=256, a=8, g=4, f=704, L=2, v=4096)
ALLOCATOR_CASES = [PeakCase(name=f"llama-small {opt} {rec}", **_SMALL, optimizer=opt, recompute=rec)
                   for opt in ("foreach", "fused") for rec in ("none", "full")]
# llama3-8b as transformers trains it on one GPU (sdpa, bf16-true, b = 1): the runs the longest lengths
# were measured on; their first failing length needs a GPU (`first_failing`)
_LLAMA3_8B = dict(model="llama", attn="sdpa", s=2048, b=1, h=4096, a=32, g=8, f=14336, L=32, v=128256)
MAX_SEQ_CASES = [PeakCase(name=f"llama3-8b {opt} {rec}", **_LLAMA3_8B, optimizer=opt, recompute=rec)
                 for opt in ("foreach", "fused") for rec in ("none", "full")]
# llama3-8b's traced inventory with the step's order (validation/layer_order.py): the MAX_SEQ_CASES' stream is the
# traced code's allocations in order (memplan/memory/stream_traced.py; tests/test_alloc_stream_cuda.py)
LLAMA3_8B_ORDER = configs_dir() / "traced" / "llama3-8b" / "hf-sdpa-cuda.yaml"


def case_config(case: PeakCase) -> Config:
    """The plan a case runs, as memplan's Config (`peak_config`), a llama3-8b case's with its traced inventory."""
    config = peak_config(case)
    if (case.h, case.L, case.v) != (_LLAMA3_8B["h"], _LLAMA3_8B["L"], _LLAMA3_8B["v"]):
        return config
    return config.model_copy(update={"model": config.model.model_copy(update={"inventory": str(LLAMA3_8B_ORDER)})})


NO_LIMIT = 1 << 50  # the replay's capacity for a run that must not die: the reserved peak without pressure


@dataclass
class AllocatorResult:
    """One run recorded and replayed with one allocator setting."""

    case: PeakCase
    allocator: str  # default | expandable
    device: str
    recorded_events: int
    recorded_live_peak: int  # the most bytes live at once in the recording (sizes as requested)
    recorded: ReplayResult  # the recording replayed through memplan's allocator model
    memplan_events: int
    memplan: ReplayResult  # memplan's own stream of the run, replayed
    measured: dict  # CUDA: the allocator's own statistics of the run; {} on CPU
    tolerance: float = PEAK_TOLERANCE

    @property
    def peak_error(self) -> float:
        """memplan's stream's requested peak against the recording's live peak."""
        return (self.memplan.requested_peak_bytes - self.recorded_live_peak) / max(self.recorded_live_peak, 1)

    @property
    def checks(self) -> dict[str, bool]:
        out = {"replay keeps the recording's bytes": self.recorded.requested_peak_bytes == self.recorded_live_peak,
               "memplan's stream peaks within 1 %": abs(self.peak_error) <= self.tolerance}
        if self.measured:
            out["replay = max_memory_reserved"] = (self.recorded.reserved_peak_bytes
                                                   == self.measured["max_memory_reserved"])
            out["replay = max_memory_allocated"] = (self.recorded.allocated_peak_bytes
                                                    == self.measured["max_memory_allocated"])
            # segment.all.peak: cudaMalloc'd segments only, 0 with expandable ones (alloc_rules.count_cuda_segment)
            out["replay = peak segments"] = self.recorded.segments_peak == self.measured["segments_peak"]
            if "segment_allocs" in self.measured:
                out["replay = segments cudaMalloc'd"] = (list(self.recorded.segment_allocs)
                                                         == self.measured["segment_allocs"])
        return out

    @property
    def passed(self) -> bool:
        return all(self.checks.values())


def _conf(allocator: str) -> str:
    """The PYTORCH_CUDA_ALLOC_CONF a run with `allocator` is started with."""
    return EXPANDABLE_CONF if allocator == "expandable" else ""


def replay_recording(events: list, stats: dict, settings: AllocatorConfig, device: str) -> ReplayResult:
    """A recorded run through memplan's allocator model. CUDA: the ids are the blocks' device addresses, where each
    segment is placed (which of two equal cached blocks is taken follows them), and the capacity is the card's
    memory less what lived outside PyTorch's pool after the run (CUDA context, cuBLAS and cuDNN handles). CPU: the
    reserved peak without pressure (`NO_LIMIT`)."""
    capacity = NO_LIMIT
    if "total_memory" in stats and "outside_pool_bytes" in stats:
        capacity = stats["total_memory"] - stats["outside_pool_bytes"]
    return replay(events, capacity, settings, ids_are_addresses=device == "cuda")


def _module() -> Any:
    return importlib.import_module(harness().__name__ + ".alloc_trace")


def record_cuda(case: PeakCase, allocator: str, out: Optional[Path] = None, s: Optional[int] = None,
                timeout_s: float = 600) -> Any:
    """One CUDA run of the case (at length `s` where given) in a fresh process (the allocator's state and settings
    are the process's): its recording (saved to `out`, also up to an out-of-memory) when `out` is given;
    validation/alloc_trace.py's OutOfMemory when it dies."""
    mod = _module()
    return mod.record_fresh(mod.StepCase(**step_fields(case, "cuda")), s, out=out, alloc_conf=_conf(allocator),
                            timeout_s=timeout_s)


def run_allocator(cases: list[PeakCase], device: str = "cpu", record_dir: Optional[str] = None,
                  allocators: tuple[str, ...] = ALLOCATORS) -> list[AllocatorResult]:
    """Record each case's run (CPU: once, in this process, for every allocator; CUDA: once per allocator, each in a
    fresh process) and replay it and memplan's stream of it through each allocator setting. `record_dir`: save
    each recording there (gzip JSON, validation/alloc_trace.py's `save`)."""
    mod = _module()
    results = []
    with tempfile.TemporaryDirectory(prefix="memplan-alloc-") as tmp:
        for case in cases:
            config = case_config(case)
            # on CUDA the run holds cuBLAS's workspaces (the card's preset; GpuSpec.step_workspace_bytes)
            ours = allocation_stream(config, case.impl, device,
                                     workspace_bytes=card_preset().workspace_bytes if device == "cuda" else 0)
            cpu_rec = None
            for allocator in allocators:
                settings = allocator_config(allocator)
                name = f"{case.name.replace(' ', '_')}-{allocator}.json.gz"
                if device == "cuda":
                    rec = record_cuda(case, allocator, Path(record_dir or tmp) / name)
                else:
                    if cpu_rec is None:
                        cpu_rec = mod.record_run(mod.StepCase(**step_fields(case, "live")))
                        if record_dir:
                            mod.save(cpu_rec, Path(record_dir) / name.replace(f"-{allocator}", ""))
                    rec = cpu_rec
                recorded = replay_recording(rec.events, rec.stats, settings, device)
                results.append(AllocatorResult(case, allocator, device, len(rec.events), rec.live_peak_bytes,
                                               recorded, len(ours.events),
                                               replay_stream(ours, NO_LIMIT, settings), dict(rec.stats)))
    return results


def first_failing(case: PeakCase, lengths: list[int], allocator: str = "default") -> Optional[int]:
    """The first of `lengths` at which the case's run dies on this machine's GPU (a fresh process per length);
    None when every one trains."""
    mod = _module()
    return mod.first_failing_length(mod.StepCase(**step_fields(case, "cuda")), lengths, alloc_conf=_conf(allocator))


MAX_SEQ_STEP = 1024  # the done-means' step: memplan's --max-seq within one such step of the longest that trains


@dataclass
class MaxSeqResult:
    """memplan's longest sequence for a run against the real run on this GPU: the run at the predicted length must
    train and the run one `MAX_SEQ_STEP` longer must die, so the longest that trains is within one step above the
    prediction (the done-means: within one step, on the safe side)."""

    case: PeakCase
    allocator: str
    predicted: Optional[int]  # memplan's --max-seq (the replay's verdict on the GPU preset)
    trains: Optional[bool]  # the run at `tried` completes
    next_dies: Optional[bool]  # the run at `tried` + MAX_SEQ_STEP dies

    @property
    def tried(self) -> Optional[int]:
        """The length run: the prediction itself."""
        return self.predicted

    @property
    def longer(self) -> Optional[int]:
        """The length one step above the one tried, which must die."""
        return None if self.tried is None else self.tried + MAX_SEQ_STEP

    @property
    def passed(self) -> bool:
        return bool(self.trains and self.next_dies)


def predicted_max_seq(case: PeakCase, gpu: GpuSpec, allocator: str = "default") -> Optional[int]:
    """memplan's `--max-seq` for the case's run on `gpu` with `allocator` (the replay's verdict; llama3-8b's from
    its traced stream, `case_config`)."""
    return max_seq_len(case_config(case), gpu.process_memory_bytes, case.impl, "cuda", gpu, replay=Replay(allocator))


def max_seq_check(case: PeakCase, gpu: GpuSpec, allocator: str = "default") -> MaxSeqResult:
    """memplan's `--max-seq` for the case's run on `gpu` (the preset of the card in this machine) with `allocator`,
    and two real runs on this GPU: at that length and one MAX_SEQ_STEP longer."""
    predicted = predicted_max_seq(case, gpu, allocator)
    if predicted is None:
        return MaxSeqResult(case, allocator, predicted, None, None)
    dies_at = first_failing(case, [predicted, predicted + MAX_SEQ_STEP], allocator)
    return MaxSeqResult(case, allocator, predicted, dies_at != predicted, dies_at == predicted + MAX_SEQ_STEP)


def max_seq_checks(cases: list[PeakCase] = MAX_SEQ_CASES) -> list[MaxSeqResult]:
    """`max_seq_check` of each case with each allocator on this machine's GPU (its preset by name)."""
    gpu = card_preset()
    return [max_seq_check(case, gpu, allocator) for case in cases for allocator in ALLOCATORS]


def allocator_summary(results: list[AllocatorResult], max_seq: list[MaxSeqResult]) -> dict[str, Any]:
    failed = [f"{r.case.name} ({r.allocator})" for r in results + max_seq if not r.passed]
    return {"cases": len(results) + len(max_seq), "failed": len(failed), "failed_cases": failed}
