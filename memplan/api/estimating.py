"""One plan: `estimate` (memory per GPU, the step peak, time; with the limits), `max_seq` and `max_micro_batch`,
from the plan options (memplan.api.options.PlanOptions) as keyword arguments."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from memplan.api.options import PlanOptions
from memplan.core.errors import MemplanError
from memplan.api.values import check_emit
from memplan.core.specs import Config
from memplan.launch.bridge import launch_for
from memplan.launch.megatron import MEGATRON_EMITS, Launch, launch_refusal
from memplan.plan.estimate import Estimate
from memplan.plan.estimate import estimate as estimate_plan
from memplan.plan.limits import cap_of, max_seq_len, need_budget
from memplan.plan.limits import max_micro_batch as largest_micro_batch
from memplan.presets.files import ModelPreset
from memplan.report.formats import estimate_dict


@dataclass
class EstimateResult:
    """What `estimate` finds for one plan: the estimate (memplan.plan.estimate.Estimate: terms, stages, step
    peak, device memory, time), the config it was made for, the preset, and the limits asked for."""

    estimate: Estimate
    config: Config
    preset: ModelPreset
    limits: dict[str, Optional[int]] = field(default_factory=dict)  # max_seq_len / max_micro_batch, when asked
    launch: Optional[Launch] = None  # emit="megatron": the plan's Megatron-LM launch

    @property
    def fits(self) -> Optional[bool]:
        """Whether the plan fits its budget (and the host memory, with offload); None without a budget."""
        return self.estimate.fits

    @property
    def device_bytes(self) -> int:
        """Device memory the plan's GPUs need: the deciding stage's allocated peak + fragmentation + runtime (the most
        loaded stage's unless another stage's replay needs more: memplan/plan/stage_verdict.py)."""
        return int(self.estimate.device.total)

    @property
    def notes(self) -> list[str]:
        return self.estimate.notes

    @property
    def max_seq_len(self) -> Optional[int]:
        return self.limits.get("max_seq_len")

    @property
    def max_micro_batch(self) -> Optional[int]:
        return self.limits.get("max_micro_batch")

    def to_dict(self) -> dict[str, Any]:
        """The document `memplan estimate ... --json` prints."""
        capped = [key for key, value in self.limits.items() if cap_of(key, value, self.config) is not None]
        return {**estimate_dict(self.estimate), **self.limits, **({"limits_at_cap": capped} if capped else {}),
                **({"launch": self.launch.as_dict()} if self.launch else {})}


def _limit_options(opts: PlanOptions, gpu: Any) -> dict[str, Any]:
    return dict(impl=opts.impl, gpu=gpu, fragmentation_margin=opts.frag_margin, replay=opts.replay())


def estimate(model: Optional[str] = None, *, paper_only: bool = False, max_seq: bool = False,
             max_micro_batch: bool = False, require_fit: bool = False, emit: Optional[str] = None,
             **options: Any) -> EstimateResult:
    """Memory per GPU of one plan (`memplan estimate`): keyword arguments as PlanOptions (tp=8, seq_len=4096,
    gpu="h100-80gb", mem="80GB", ...); paper_only counts only K22's terms; max_seq / max_micro_batch also find
    the longest sequence / largest micro-batch the plan fits with; require_fit refuses a plan with no budget;
    emit="megatron" / "bridge": the plan's Megatron-LM launch / Megatron-Bridge overrides (EstimateResult.launch),
    with PYTORCH_CUDA_ALLOC_CONF exported when the plan needs it (planned with it, or it dies with the default
    allocator and fits with expandable segments)."""
    opts = PlanOptions(model=model, **options)
    check_emit(emit, opts.mst, opts.impl)
    preset, config = opts.config()
    if emit in MEGATRON_EMITS and launch_refusal(config.model):
        raise MemplanError(launch_refusal(config.model))
    gpu = opts.gpu_spec(preset)
    assumed = None
    if gpu is None and opts.mem is not None:  # a verdict: the device model `search` uses (memplan/api/options.py)
        gpu, assumed = opts.search_gpu(preset)[0], opts.assumed_gpu(preset)
    result = estimate_plan(config, budget_bytes=opts.mem, gpu=gpu, paper_only=paper_only, impl=opts.impl,
                           fragmentation_margin=opts.frag_margin, host_budget_bytes=opts.host_mem,
                           replay=opts.replay())
    result = dataclasses.replace(result, gpu_assumed=assumed)
    if opts.seq_len is None:
        result.notes.extend(preset.notes)
    result.notes.extend(opts.batch_notes(preset, config.model.seq_length, config.global_batch))
    if require_fit and result.budget_bytes is None:
        raise MemplanError("--require-fit needs a budget: give --mem SIZE or --gpu NAME")
    limits: dict[str, Optional[int]] = {}
    if max_seq or max_micro_batch:
        budget = need_budget(result.budget_bytes, "--max-seq / --max-micro-batch")
        if max_seq:
            limits["max_seq_len"] = max_seq_len(config, budget, **_limit_options(opts, gpu))
        if max_micro_batch:
            limits["max_micro_batch"] = largest_micro_batch(config, budget, **_limit_options(opts, gpu))
    launch = None
    if emit:
        expandable_fits = result.reserved.expandable_fits if result.reserved is not None else None
        launch = launch_for(config, emit, opts.impl, opts.replay().launch_conf(expandable_fits))
    return EstimateResult(result, config, preset, limits, launch)


def max_seq(model: Optional[str] = None, **options: Any) -> Optional[int]:
    """The longest sequence length this plan fits its budget with (`memplan estimate --max-seq`), all else equal;
    None when none does. Needs a budget: mem="80GB" or a GPU."""
    return estimate(model, max_seq=True, **options).max_seq_len


def max_micro_batch(model: Optional[str] = None, **options: Any) -> Optional[int]:
    """The largest micro-batch this plan fits its budget with (`memplan estimate --max-micro-batch`)."""
    return estimate(model, max_micro_batch=True, **options).max_micro_batch

