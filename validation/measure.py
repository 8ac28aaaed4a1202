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
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable, Literal

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._python_dispatch import TorchDispatchMode

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


@dataclass(frozen=True)
class SavedEntry:
    """One storage autograd keeps after forward."""

    label: str
    shape: tuple[int, ...]  # shape of the (first) tensor saved from this storage
    dtype: str
    bytes: int  # the storage's nbytes
    op: str  # what saved it: torch call, "<Function>.save_for_backward" or "checkpoint(inputs)"
    module: str  # module path of the reference model where it was saved


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
# the saved-tensor ledger


class _OpRecorder(TorchFunctionMode):
    """Name of the torch API call in progress (autograd packs inside it, inputs and outputs alike).

    A dispatch-level "last aten op" is wrong for inputs: autograd packs an op's inputs *before*
    the op reaches the dispatcher.  A function mode brackets the whole call instead.
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = "?"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        prev = self.current
        self.current = resolve_name(func) or getattr(func, "__name__", str(func))
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.current = prev


class _ModuleStack:
    """Module path of the reference model, via forward pre/post hooks."""

    def __init__(self, root: torch.nn.Module, root_name: str) -> None:
        self.stack: list[str] = []
        self.handles = []
        for name, mod in root.named_modules():
            path = f"{root_name}.{name}" if name else root_name
            self.handles.append(mod.register_forward_pre_hook(partial(self._push, path)))
            self.handles.append(mod.register_forward_hook(self._pop))

    def _push(self, path, mod, args):
        self.stack.append(path)

    def _pop(self, mod, args, out):
        if self.stack:
            self.stack.pop()

    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else "-"

    def close(self) -> None:
        for h in self.handles:
            h.remove()


@dataclass
class _Record:
    key: StorageWeakRef
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    ops: list[str]
    module: str
    is_param: bool


class Ledger:
    """Pack hook that lists every saved storage once."""

    def __init__(self, params: list[torch.Tensor], ops: _OpRecorder, modules: _ModuleStack | None):
        self.param_keys = {StorageWeakRef(p.untyped_storage()) for p in params}
        self.records: dict[StorageWeakRef, _Record] = {}
        self.ops, self.modules = ops, modules

    def _op_name(self) -> str:
        f = sys._getframe(2)  # the Python frame that triggered autograd's packing
        code = f.f_code
        if code.co_name == "apply" and code.co_filename.endswith(os.path.join("autograd", "function.py")):
            cls = f.f_locals.get("cls")
            return f"{getattr(cls, '__name__', '?')}.save_for_backward"
        if code.co_filename.endswith("checkpoint.py"):
            return "checkpoint(inputs)"
        return self.ops.current

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        key = StorageWeakRef(st)
        op = self._op_name()
        rec = self.records.get(key)
        if rec is None:
            self.records[key] = _Record(
                key, tuple(t.shape), str(t.dtype).replace("torch.", ""), st.nbytes(), [op],
                self.modules.current if self.modules else "-", key in self.param_keys,
            )
        elif op not in rec.ops:
            rec.ops.append(op)
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def entries(self, registry: TagRegistry) -> list[SavedEntry]:
        acts, params = [], []
        for rec in self.records.values():
            label = PARAMETER if rec.is_param else (registry.get(rec.key) or UNLABELED)
            e = SavedEntry(label, rec.shape, rec.dtype, rec.nbytes, " + ".join(rec.ops), rec.module)
            (params if rec.is_param else acts).append(e)
        return acts + params


# ---------------------------------------------------------------------------------------------
# the live-storage tracker


class LiveTracker(TorchDispatchMode):
    """Follows every storage first seen as an op *output* inside the window until it is freed.

    A storage first seen as an op *input* existed before the window (parameters, buffers) and is
    never counted, nor are views of it.  Frees are observed with weakref callbacks on the
    (preserved) Python storage object, as torch.distributed._tools.mem_tracker does.  The peak is
    sampled after every op; temporaries an op allocates and frees internally are not seen.
    """

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()  # frees can run on a gloo worker thread
        self.external: dict[int, weakref.ref] = {}
        self.sizes: dict[int, int] = {}
        self.refs: dict[int, weakref.ref] = {}
        self.live = 0
        self.peak = 0

    def _free(self, cdata: int, _ref) -> None:
        with self.lock:
            n = self.sizes.pop(cdata, 0)
            self.refs.pop(cdata, None)
            self.live -= n

    def settle(self, quiet_checks: int = 3, interval_s: float = 0.001, max_checks: int = 1000) -> int:
        """Live bytes once frees stop arriving.

        ProcessGroupGloo's worker thread drops its reference to a finished collective's tensors a
        moment after ``wait()`` returns, so right after forward a few temporaries can still be
        alive for microseconds.  Wait until the figure is stable.
        """
        last, quiet = self.live, 0
        for _ in range(max_checks):
            time.sleep(interval_s)
            quiet = quiet + 1 if self.live == last else 0
            last = self.live
            if quiet >= quiet_checks:
                break
        return self.live

    def _forget_external(self, cdata: int, _ref) -> None:
        self.external.pop(cdata, None)

    def _see_input(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        cdata = st._cdata
        if cdata not in self.sizes and cdata not in self.external:
            # forget it when it dies: a later storage may get the same StorageImpl address
            self.external[cdata] = weakref.ref(st, partial(self._forget_external, cdata))

    def _see_output(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        cdata = st._cdata
        if cdata in self.external:
            return
        n = st.nbytes()
        with self.lock:
            old = self.sizes.get(cdata)
            if old is None:
                self.refs[cdata] = weakref.ref(st, partial(self._free, cdata))
                self.sizes[cdata] = n
                self.live += n
            elif old != n:  # resized in place (out= ops)
                self.sizes[cdata] = n
                self.live += n - old

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for x in pytree.tree_leaves((args, kwargs)):
            if isinstance(x, torch.Tensor):
                self._see_input(x)
        out = func(*args, **kwargs)
        for x in pytree.tree_leaves(out):
            if isinstance(x, torch.Tensor):
                self._see_output(x)
        self.peak = max(self.peak, self.live)
        return out


def saved_storages(own) -> tuple[dict, Callable]:
    """A ``saved_tensors_hooks`` pack function recording the bytes of every storage autograd saves that is not one of
    the tensors ``own`` (the model's parameters and buffers): (storage -> bytes, the pack function)."""
    owned = {StorageWeakRef(t.untyped_storage()) for t in own}
    saved: dict = {}

    def pack(t):
        key = StorageWeakRef(t.untyped_storage())
        if key not in owned:
            saved[key] = t.untyped_storage().nbytes()
        return t

    return saved, pack


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
