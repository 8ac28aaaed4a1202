"""The instruments a measured window runs under, and what they record; nothing here runs a model.

* ``Ledger``: a ``torch.autograd.graph.saved_tensors_hooks`` pack hook that lists every storage autograd
  saves once (``SavedEntry``: its bytes, the torch call that saved it (``_OpRecorder``), the module path
  (``_ModuleStack``)); ``_HFLedger`` adds the (module, op, k, j) context of each storage's first save, with
  ``_CallRecorder`` (an id per outermost torch call, who produced what) and ``_AtenLog`` (which aten kernels an
  sdpa / dropout call reached), as validation/hf.py and validation/mcore.py label saved tensors;
* ``LiveTracker``: a ``TorchDispatchMode`` that follows every storage made inside the window until it is
  freed (retained bytes, the peak);
* ``saved_storages``: a bare pack function recording the bytes of what autograd saves.

Nothing here computes a byte count from a formula; every number is read off a tensor.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .tags import PARAMETER, UNLABELED, TagRegistry


@dataclass(frozen=True)
class SavedEntry:
    """One storage autograd keeps after forward."""

    label: str
    shape: tuple[int, ...]  # shape of the (first) tensor saved from this storage
    dtype: str
    bytes: int  # the storage's nbytes
    op: str  # what saved it: torch call, "<Function>.save_for_backward" or "checkpoint(inputs)"
    module: str  # module path of the reference model where it was saved


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
# recording


class _CallRecorder(_OpRecorder):
    """Op name (as ``_OpRecorder``), plus an id per outermost torch call and who produced what."""

    def __init__(self, modules: _ModuleStack) -> None:
        super().__init__()
        self.modules = modules
        self.call = 0
        self._next = 0
        self.producers: dict[StorageWeakRef, str] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        prev, prev_call = self.current, self.call
        self._next += 1
        self.current = resolve_name(func) or getattr(func, "__name__", str(func))
        self.call = self._next
        try:
            out = func(*args, **(kwargs or {}))
            if isinstance(out, (torch.Tensor, tuple, list)):
                for x in pytree.tree_leaves(out):
                    if isinstance(x, torch.Tensor):
                        key = StorageWeakRef(x.untyped_storage())
                        self.producers.setdefault(key, f"{self.modules.current}:{self.current}")
            return out
        finally:
            self.current, self.call = prev, prev_call


class _AtenLog(TorchDispatchMode):
    """Which aten kernels an sdpa / dropout call reached (per outermost torch call)."""

    INTERESTING = ("scaled_dot_product", "dropout", "bernoulli")

    def __init__(self, rec: _CallRecorder) -> None:
        super().__init__()
        self.rec = rec
        self.by_call: dict[int, list[str]] = {}
        self.op_of_call: dict[int, str] = {}

    def note(self, func) -> None:
        """Log ``func`` if interesting (also called by another mode's dispatch, so one mode does the work of two)."""
        name = str(func.overloadpacket)
        if any(w in name for w in self.INTERESTING):
            self.by_call.setdefault(self.rec.call, []).append(name)
            self.op_of_call[self.rec.call] = self.rec.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.note(func)
        return func(*args, **(kwargs or {}))

    def kernel_tag(self, call: int) -> str:
        names = self.by_call.get(call, [])
        if any("flash_attention_for_cpu" in n for n in names):
            return "flash_cpu"
        if any("flash" in n for n in names):
            return "flash"
        if any("efficient" in n for n in names):
            return "efficient"
        if any("cudnn" in n for n in names):
            return "cudnn"
        return "math"


class _HFLedger(Ledger):
    """``Ledger`` plus the (module, op, k, j) context of each storage's first save."""

    def __init__(self, params, rec: _CallRecorder, modules: _ModuleStack) -> None:
        super().__init__(params, rec, modules)
        self.rec = rec
        self.ctx: dict[StorageWeakRef, tuple[str, str, int, int, int]] = {}  # + call id
        self.savers: dict[StorageWeakRef, list[str]] = {}
        self._last_call: int | None = None
        self._j = 0
        self._k = 0
        self._calls: Counter = Counter()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        key = StorageWeakRef(st)
        op, call, module = self.rec.current, self.rec.call, self.modules.current
        if call != self._last_call:
            self._last_call, self._j = call, 0
            self._k = self._calls[(module, op)]
            self._calls[(module, op)] += 1
        is_param = key in self.param_keys
        rec = self.records.get(key)
        if rec is None:
            self.records[key] = _Record(key, tuple(t.shape), str(t.dtype).replace("torch.", ""), st.nbytes(),
                                        [op], module, is_param)
            self.ctx[key] = (module, op, self._k, -1 if is_param else self._j, call)
        elif op not in rec.ops:
            rec.ops.append(op)
        savers = self.savers.setdefault(key, [])
        if module not in savers:
            savers.append(module)
        if not is_param:
            self._j += 1
        return t
