"""Measure what a training step really keeps: saved-tensor ledger, live storages, CUDA allocator.

Backends (``Case.backend``):

* ``"ledger"``: real CPU tensors; ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor
  autograd saves during forward (also the inputs ``torch.utils.checkpoint`` keeps).  Entries are
  deduplicated by storage: a storage saved by several ops, or through several views, is counted
  once, with its full ``nbytes``.  Parameters (weights saved by linears) are listed under
  ``"parameter"`` and not counted.
* ``"live"``: the ledger plus a ``TorchDispatchMode`` that follows every storage created inside
  the measured window until it is freed: memory retained after forward and the step's peak.
* ``"fake"``: the ledger (and the live tracker) under ``FakeTensorMode``: nothing is allocated,
  so paper-scale per-rank layers run in seconds.  For t > 1 one process plays rank ``case.rank``
  with ``SimulatedComm``.
* ``"cuda"``: the ledger plus ``torch.cuda.memory_allocated`` / ``max_memory_allocated`` after a
  warm-up step, ``gc.collect()`` and ``reset_peak_memory_stats`` (numbers include the caching
  allocator's 512-byte rounding).

The measured window starts before the inputs are created (layer: the input activation x and the
causal mask; model: token ids, position ids, targets, causal mask) and the inputs are created
inside a function whose locals die on return, so after forward only what autograd keeps (plus the
scalar loss) is alive.  For t > 1 (except fake) t processes are spawned with gloo (NCCL for cuda);
each rank measures itself; rank 0's numbers are returned and the ranks are compared.

Nothing here computes a byte count from a formula; every number is read off a tensor.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .instruments import Ledger, LiveTracker, SavedEntry, _ModuleStack, _OpRecorder
from .layers import RECOMPUTE, GPTLayer, GPTModel, LayerConfig, causal_mask
from .parallel import Comm, DistComm, SimulatedComm
from .ranks import run_ranks
from .tags import PARAMETER, UNLABELED, TagRegistry

Backend = Literal["ledger", "live", "fake", "cuda"]
BACKENDS = ("ledger", "live", "fake", "cuda")


@dataclass(frozen=True)
class Case:
    """One configuration to measure.  ``f`` defaults to 4h; ``v`` and ``L`` matter for models."""

    s: int
    b: int
    h: int
    a: int
    f: int | None = None
    v: int = 512
    L: int = 1
    t: int = 1
    sp: bool = False
    recompute: Literal["none", "selective", "full"] = "none"
    dtype: str = "bfloat16"
    backend: Backend = "ledger"
    p_drop: float = 0.1
    seed: int = 0
    rank: int = 0  # fake backend: which rank to play

    @property
    def ffn(self) -> int:
        return 4 * self.h if self.f is None else self.f

    def check(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}")
        if self.t < 1 or not 0 <= self.rank < self.t:
            raise ValueError("need t >= 1 and 0 <= rank < t")
        if self.sp and self.t > 1 and self.s % self.t:
            raise ValueError(f"sequence parallelism needs s={self.s} divisible by t={self.t}")


@dataclass
class Measurement:
    case: Case
    scope: Literal["layer", "model"]
    saved_bytes_by_label: dict[str, int]
    entries: list[SavedEntry]  # activations first, then parameters (label "parameter")
    saved_bytes_total: int  # sum over activation entries (parameters excluded)
    retained_after_forward_bytes: int | None  # live / cuda / fake: live after fwd - live before
    peak_bytes: int | None  # live / cuda / fake: peak over fwd + bwd, minus live before
    loss_bytes: int  # storage bytes of the scalar the forward returns (alive, not saved)
    saved_parameter_bytes: int
    rank: int = 0
    world_size: int = 1
    ranks_agree: bool | None = None  # t > 1 with processes: same ledger and retained bytes on all ranks
    per_rank_saved_bytes_total: list[int] = field(default_factory=list)
    per_rank_peak_bytes: list[int | None] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def entries_for(self, label: str) -> list[SavedEntry]:
        return [e for e in self.entries if e.label == label]

    @property
    def unlabeled(self) -> list[SavedEntry]:
        return self.entries_for(UNLABELED)


# ---------------------------------------------------------------------------------------------
# one measurement in this process


def _build(case: Case, scope: str, comm: Comm, dtype, device) -> torch.nn.Module:
    cfg = LayerConfig(h=case.h, a=case.a, f=case.ffn, sp=case.sp and comm.world > 1,
                      recompute=case.recompute, p_drop=case.p_drop)
    if scope == "layer":
        return GPTLayer(cfg, comm, dtype=dtype, device=device)
    return GPTModel(cfg, case.L, case.v, case.s, comm, dtype=dtype, device=device)


def _forward_fresh(module, case: Case, scope: str, comm: Comm, dtype, device) -> torch.Tensor:
    """Create this step's inputs and run forward; the inputs die with this frame unless saved."""
    mask = causal_mask(case.s, device=device)
    if scope == "layer":
        s_local = case.s // comm.world if (case.sp and comm.world > 1) else case.s
        x = torch.randn(s_local, case.b, case.h, dtype=dtype, device=device).requires_grad_()
        return module(x, mask).sum()
    token_ids = torch.randint(0, case.v, (case.b, case.s), device=device)
    targets = torch.randint(0, case.v, (case.b, case.s), device=device)
    position_ids = torch.arange(case.s, device=device).unsqueeze(0).expand(case.b, case.s)
    return module(token_ids, position_ids, targets, mask)


def _zero_grads(module) -> None:
    for p in module.parameters():
        p.grad = None


def _measure_here(case: Case, scope: str, comm: Comm, device: str) -> Measurement:
    case.check()
    dtype = getattr(torch, case.dtype)
    fake = case.backend == "fake"
    mode = contextlib.nullcontext()
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=False)
    with mode:
        torch.manual_seed(case.seed + comm.rank)
        module = _build(case, scope, comm, dtype, device)
        module.train()
        if case.backend in ("live", "cuda"):  # warm-up: lazy initialisation outside the window
            _forward_fresh(module, case, scope, comm, dtype, device).backward()
            _zero_grads(module)
            gc.collect()
        return _measure_step(module, case, scope, comm, dtype, device)


def _measure_step(module, case, scope, comm, dtype, device) -> Measurement:
    track_live = case.backend in ("live", "fake")
    use_cuda = case.backend == "cuda"
    tracker = LiveTracker() if track_live else None
    ops = _OpRecorder()
    modules = _ModuleStack(module, scope)
    ledger = Ledger(list(module.parameters()), ops, modules)
    registry = TagRegistry()
    base = 0
    if use_cuda:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    try:
        with registry, (tracker or contextlib.nullcontext()):
            with torch.autograd.graph.saved_tensors_hooks(ledger.pack, ledger.unpack), ops:
                loss = _forward_fresh(module, case, scope, comm, dtype, device)
            registry.frozen = True
            if use_cuda:
                torch.cuda.synchronize()
                retained = torch.cuda.memory_allocated() - base
            else:
                # real collectives: gloo's worker thread may still hold a finished op's tensors
                settle = tracker is not None and isinstance(comm, DistComm)
                retained = (tracker.settle() if settle else tracker.live) if tracker else None
            entries = ledger.entries(registry)
            loss_bytes = loss.untyped_storage().nbytes()
            loss.backward()
            del loss
            if use_cuda:
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() - base
            else:
                peak = tracker.peak if tracker else None
    finally:
        modules.close()
    by_label: dict[str, int] = {}
    for e in entries:
        if e.label != PARAMETER:
            by_label[e.label] = by_label.get(e.label, 0) + e.bytes
    notes = list(registry.conflicts)
    return Measurement(
        case=case,
        scope=scope,
        saved_bytes_by_label=by_label,
        entries=entries,
        saved_bytes_total=sum(by_label.values()),
        retained_after_forward_bytes=retained,
        peak_bytes=peak,
        loss_bytes=loss_bytes,
        saved_parameter_bytes=sum(e.bytes for e in entries if e.label == PARAMETER),
        rank=comm.rank,
        world_size=comm.world,
        notes=notes,
    )


# ---------------------------------------------------------------------------------------------
# processes for t > 1


def _measure_rank(rank: int, world: int, jobs: list[tuple[Case, str]], cuda: bool) -> list[Measurement]:
    """Run by ``ranks.run_ranks`` in rank ``rank``'s process, inside the process group."""
    comm = DistComm()
    device = f"cuda:{rank}" if cuda else "cpu"
    return [_measure_here(case, scope, comm, device) for case, scope in jobs]


def _signature(m: Measurement):
    return (
        m.saved_bytes_by_label,
        [(e.label, e.shape, e.dtype, e.bytes) for e in m.entries],
        m.retained_after_forward_bytes if m.case.backend != "cuda" else None,
    )  # the peak is not compared: it can include gloo's in-flight buffers (timing-dependent)


def _spawn(t: int, jobs: list[tuple[Case, str]]) -> list[Measurement]:
    cuda = any(c.backend == "cuda" for c, _ in jobs)
    per_rank = run_ranks(_measure_rank, t, (jobs, cuda), backend="nccl" if cuda else "gloo")
    out = []
    for i in range(len(jobs)):
        ms = [per_rank[r][i] for r in range(t)]
        m0 = ms[0]
        m0.ranks_agree = all(_signature(m) == _signature(m0) for m in ms[1:])
        m0.per_rank_saved_bytes_total = [m.saved_bytes_total for m in ms]
        m0.per_rank_peak_bytes = [m.peak_bytes for m in ms]
        out.append(m0)
    return out


# ---------------------------------------------------------------------------------------------
# public API


def measure_many(jobs: list[tuple[Case, Literal["layer", "model"]]]) -> list[Measurement]:
    """Measure many (case, scope) pairs; one spawn per t > 1 shared by all its cases."""
    results: list[Measurement | None] = [None] * len(jobs)
    spawned: dict[int, list[int]] = {}
    for i, (case, scope) in enumerate(jobs):
        if scope not in ("layer", "model"):
            raise ValueError("scope must be 'layer' or 'model'")
        case.check()
        if case.t > 1 and case.backend != "fake":
            spawned.setdefault(case.t, []).append(i)
        else:
            comm = SimulatedComm(case.rank, case.t)
            device = "cuda" if case.backend == "cuda" else "cpu"
            results[i] = _measure_here(case, scope, comm, device)
            results[i].per_rank_saved_bytes_total = [results[i].saved_bytes_total]
            results[i].per_rank_peak_bytes = [results[i].peak_bytes]
    for t, idx in spawned.items():
        for i, m in zip(idx, _spawn(t, [jobs[i] for i in idx])):
            results[i] = m
    return results  # type: ignore[return-value]


def measure_layer(case: Case) -> Measurement:
    """Saved tensors / memory of one transformer layer on one tensor-parallel rank."""
    return measure_many([(case, "layer")])[0]


def measure_model(case: Case) -> Measurement:
    """Saved tensors / memory of the whole model (embedding, L layers, head, loss) on one rank."""
    return measure_many([(case, "model")])[0]


def with_backend(case: Case, backend: Backend) -> Case:
    return replace(case, backend=backend)


# ---------------------------------------------------------------------------------------------
# facts about torch's dropout


class _OpNames(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def probe_dropout(native: bool, device: str = "cpu", dtype: str = "bfloat16") -> tuple[list[str], list[str]]:
    """(aten ops reached, dtypes autograd saves) for ``F.dropout`` (native=False) or
    ``torch.native_dropout`` (native=True) in training mode on a small tensor."""
    x = torch.randn(8, 16, dtype=getattr(torch, dtype), device=device, requires_grad=True)
    saved: list[str] = []

    def pack(t):
        saved.append(str(t.dtype).replace("torch.", ""))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _OpNames() as names:
        if native:
            torch.native_dropout(x, 0.1, True)
        else:
            torch.nn.functional.dropout(x, 0.1, training=True)
    return names.names, saved
