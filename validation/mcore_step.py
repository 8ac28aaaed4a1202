"""megatron-core's whole training step on CPU: GPTModel, DDP with the fp32 gradient buffer, the distributed optimizer.

A GPTModel from the local spec (``validation.mcore.build``, scope "model": bf16, the fusions off as on CPU) wrapped in
megatron-core 0.16.1's ``DistributedDataParallel`` (``grad_reduce_in_fp32=True``: one contiguous fp32 gradient buffer;
``use_distributed_optimizer=True``: the bf16 parameters remapped into one contiguous buffer too) and stepped by
``get_megatron_optimizer`` (``optimizer="adam"``, bf16, the distributed optimizer, ``clip_grad=1.0`` and
``weight_decay=0.01``: Megatron-LM's defaults; without Transformer Engine / apex megatron-core falls back to
``torch.optim.AdamW``, whose default implementation on CPU tensors is the for-loop one), over a gloo group of
d x t processes (``validation.ranks.run_ranks``). The loop is Megatron-LM's ``train_step``: ``zero_grad_buffer`` +
``optimizer.zero_grad``, forward + backward, ``finish_grad_sync`` (the gradient all-reduce / reduce-scatter),
``optimizer.step`` (gradient norm, clipping, AdamW on the fp32 shards, the bf16 parameter all-gather).

Two steps run; the second is measured. Before it (after ``gc.collect()``) ``persistent`` is read off the storages
that exist, each once, by category: the bf16 parameter buffer (``weights``), the fp32 gradient buffer
(``gradients``), the fp32 master shards (``master_weights``), AdamW's moments (``optimizer_states``) and step counters
(``optimizer_steps``). The step runs under ``instruments.LiveTracker`` (every storage an op makes, until freed); its
peak plus ``persistent_total`` is the step's peak; ``phase_peaks`` the maximum inside each phase (forward with the
loss, backward, the gradient sync, the optimizer step), the peak's phase the first that reaches it.

megatron-core's DDP and optimizer assume CUDA beyond what ``mcore_cpu.apply_cpu_patches`` covers; patched at run time in
the rank processes only (``apply_step_patches``), never in site-packages:

* ``torch.tensor`` / ``zeros`` / ``empty`` ... with ``device="cuda"`` or ``torch.cuda.current_device()`` in the
  gradient buffer (``param_and_grad_buffer.py``), the optimizer's unit scale and the gradient norm (``optimizer.py``,
  ``clip_grads.py``, ``utils.local_multi_tensor_l2_norm``): made on the CPU (the module's ``torch`` a proxy);
* ``Tensor.type()`` (no argument) answers ``torch.cuda.<T>`` for a CPU tensor: the optimizers sort parameters by
  ``param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']``.

Nothing here computes a byte count from a formula; every number is read off a tensor.
"""

from __future__ import annotations

import gc
import importlib
import importlib.metadata
import logging
import warnings
from dataclasses import dataclass, field

import torch

from .instruments import LiveTracker
from .mcore import McoreCase, build
from .mcore_cpu import apply_cpu_patches
from .ranks import run_ranks

PHASES = ("forward", "backward", "grad-sync", "optimizer")
# the modules of megatron-core 0.16.1 that allocate on CUDA in the step's path
STEP_CUDA_MODULES = ("distributed.param_and_grad_buffer", "distributed.distributed_data_parallel",
                     "optimizer.optimizer", "optimizer.distrib_optimizer", "optimizer.clip_grads", "optimizer",
                     "utils")
_FACTORIES = ("tensor", "zeros", "empty", "ones", "full", "zeros_like", "empty_like")


class _CpuTorch:
    """A module's ``torch`` with CUDA devices answered by the CPU: ``torch.cuda.current_device()`` is "cpu" and the
    tensor factories given a CUDA device make a CPU tensor."""

    class _Cuda:
        def __getattr__(self, name):
            return (lambda *a, **k: "cpu") if name == "current_device" else getattr(torch.cuda, name)

    cuda = _Cuda()

    def __getattr__(self, name):
        fn = getattr(torch, name)
        if name not in _FACTORIES:
            return fn

        def on_cpu(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return fn(*args, **kwargs)

        return on_cpu


def apply_step_patches() -> None:
    """``mcore_cpu.apply_cpu_patches`` and the DDP / optimizer ones (module docstring); rank processes only."""
    apply_cpu_patches()
    if getattr(torch.Tensor.type, "_memplan_cpu", False):
        return
    for name in STEP_CUDA_MODULES:
        importlib.import_module(f"megatron.core.{name}").torch = _CpuTorch()
    original = torch.Tensor.type

    def tensor_type(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if not args and not kwargs and not self.is_cuda and out.startswith("torch.") and out.endswith("Tensor"):
            return "torch.cuda." + out.removeprefix("torch.")
        return out

    tensor_type._memplan_cpu = True
    torch.Tensor.type = tensor_type


@dataclass(frozen=True)
class McoreStepCase:
    """A GPTModel case (``McoreCase`` with scope "model") trained on d data-parallel ranks."""

    model: McoreCase
    dp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.model.t


@dataclass
class McoreStepMeasurement:
    case: McoreStepCase
    persistent: dict[str, int]  # category -> bytes alive before the measured step
    persistent_total: int
    peak_bytes: int  # persistent_total + the largest live bytes of the step
    peak_phase: str
    phase_peaks: dict[str, int]  # phase -> persistent_total + the largest live bytes inside it
    live_at_end: int
    parameters: int  # elements of the model's parameters on this rank
    notes: list[str] = field(default_factory=list)


def _storages(tensors) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.numel()}


def _persistent(ddp, optimizer) -> dict[str, int]:
    """Bytes per category of what the step starts with, each storage once (the first category that names it)."""
    opts = [o.optimizer for o in optimizer.chained_optimizers]
    masters = [p for o in opts for g in o.param_groups for p in g["params"]]
    states = [(k, v) for o in opts for s in o.state.values() for k, v in s.items() if torch.is_tensor(v)]
    groups = {
        "weights": [p for p in ddp.parameters()] + [b.param_data for b in ddp.buffers if b.param_data is not None],
        "gradients": [b.grad_data for b in ddp.buffers],
        "master_weights": masters,
        "optimizer_states": [v for k, v in states if k != "step"],
        "optimizer_steps": [v for k, v in states if k == "step"],
        "buffers": list(ddp.module.buffers()),
    }
    seen: set[int] = set()
    out = {}
    for name, tensors in groups.items():
        st = {k: n for k, n in _storages(tensors).items() if k not in seen}
        seen.update(st)
        out[name] = sum(st.values())
    return out


def _forward(ddp, case: McoreCase) -> torch.Tensor:
    """Megatron-LM's forward_step + loss_func (pretrain_gpt.py) on a fresh batch: the per-token losses times the
    loss mask, summed; the batch dies with this frame unless autograd saved it."""
    mask = torch.triu(torch.ones(case.s, case.s, dtype=torch.bool), diagonal=1).view(1, 1, case.s, case.s)
    ids = torch.randint(0, case.v, (case.b, case.s))
    labels = torch.randint(0, case.v, (case.b, case.s))
    loss_mask = torch.ones(case.b, case.s, dtype=torch.float)
    pos = torch.arange(case.s).unsqueeze(0).expand(case.b, case.s)
    losses = ddp(ids, pos, mask, labels=labels)
    return torch.sum(losses.view(-1).float() * loss_mask.view(-1))


def wrap_for_training(model):
    """The model in DDP with the fp32 gradient buffer and the distributed optimizer over Adam (clip 1.0), as the
    reference loop trains it: (ddp, optimizer)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True), model)
    return ddp, get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-4, weight_decay=0.01, bf16=True, use_distributed_optimizer=True,
        clip_grad=1.0), [ddp])


def train_step(ddp, optimizer, case: McoreCase, mark) -> None:
    """Megatron-LM's train_step for one micro-batch; `mark(phase)` at the end of each phase."""
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    loss = _forward(ddp, case)
    mark("forward")
    loss.backward()
    del loss
    mark("backward")
    ddp.finish_grad_sync()
    mark("grad-sync")
    ok, _, _ = optimizer.step()
    assert ok
    mark("optimizer")


def _measure_here(case: McoreStepCase) -> McoreStepMeasurement:
    warnings.filterwarnings("ignore")
    logging.getLogger("megatron.core").setLevel(logging.ERROR)
    apply_step_patches()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random

    c = case.model
    ps.initialize_model_parallel(tensor_model_parallel_size=c.t)
    try:
        random.model_parallel_cuda_manual_seed(c.seed + 1)
        torch.manual_seed(c.seed + ps.get_tensor_model_parallel_rank())
        model = build(c)
        ddp, optimizer = wrap_for_training(model)
        train_step(ddp, optimizer, c, lambda phase: None)
        gc.collect()
        persistent = _persistent(ddp, optimizer)
        base = sum(persistent.values())
        peaks: dict[str, int] = {}
        tracker = LiveTracker()

        def mark(phase: str) -> None:  # the phase's own maximum; the next phase starts from what is live now
            peaks[phase] = base + tracker.peak
            tracker.peak = tracker.live

        with tracker:
            train_step(ddp, optimizer, c, mark)
            gc.collect()
            live_at_end = tracker.settle()
        peak = max(peaks.values())
        phase = next(p for p in PHASES if peaks[p] == peak)
        return McoreStepMeasurement(case, persistent, base, peak, phase, peaks, live_at_end,
                                    sum(p.numel() for p in model.parameters()),
                                    notes=[f"megatron-core {importlib.metadata.version('megatron-core')}",
                                           f"optimizer {type(optimizer.chained_optimizers[0].optimizer).__name__}"])
    finally:
        ps.destroy_model_parallel()


def _measure_rank(rank: int, world: int, cases: list[McoreStepCase]) -> list[McoreStepMeasurement]:
    return [_measure_here(c) for c in cases]


def measure_mcore_step(cases: list[McoreStepCase]) -> list[McoreStepMeasurement]:
    """Each case's second step on rank 0 of a d x t gloo group (one spawn per world size)."""
    out: list = [None] * len(cases)
    by_world: dict[int, list[int]] = {}
    for i, c in enumerate(cases):
        by_world.setdefault(c.world, []).append(i)
    for world, idx in by_world.items():
        per_rank = run_ranks(_measure_rank, world, ([cases[i] for i in idx],))
        for n, i in enumerate(idx):
            out[i] = per_rank[0][n]
    return out
