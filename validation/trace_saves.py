"""Recording what autograd saves (fake or real tensors alike) and the dispatch set-up of a symbolic trace: ``Saves``
(every saved storage with the context of its first save), the loss a step runs (``forward_loss``), transformers' eager
answers where it treats fake tensors as tracing (``eager_decisions``) and torch's python dispatcher
(``with_python_dispatcher``; validation/trace.py's docstring says why)."""

from __future__ import annotations

import contextlib
import re
import weakref
from collections import Counter
from typing import Callable

from . import hf as _hf  # sets HF_HUB_OFFLINE before transformers is imported

import torch  # noqa: E402
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402

from .measure import _ModuleStack  # noqa: E402

SDPA = _hf.SDPA
_SHORT = re.compile(r"[^A-Za-z0-9_]+")


def short_op(op: str) -> str:
    """An op's name as a term id's part: ``torch.nn.functional.linear`` -> ``linear``."""
    base = op.split("[")[0].rsplit(".", 1)[-1]
    return _SHORT.sub("_", base)



class Saves:
    """Every non-parameter storage autograd saves, with the context of its first save (module,
    op, k, j: ``validation.hf``'s labelling, except that k counts the saving calls of one op name
    whether called as a function or a method: ``torch.topk`` and ``Tensor.topk`` share ids), every
    module that saved it, dtype, nbytes."""

    def __init__(self, model: torch.nn.Module, extra_excluded=()) -> None:
        self.modules = _ModuleStack(model, "")
        self.rec = _hf._CallRecorder(self.modules)
        excluded = list(model.parameters()) + list(model.buffers()) + list(extra_excluded)
        self.ledger = _hf._HFLedger(excluded, self.rec, self.modules)
        self.aten = _hf._AtenLog(self.rec)
        self.dtypes: dict[StorageWeakRef, torch.dtype] = {}
        self.first_save: dict[StorageWeakRef, dict[str, int]] = {}  # saver module -> sequence number
        self.saves = 0
        self.ctx: dict[StorageWeakRef, tuple[str, str, int, int, int]] = {}  # module, op, k, j, call
        self._calls: Counter = Counter()
        self._last_call: int | None = None
        self._k = self._j = 0
        self.live = None  # a transients.LiveStorages told of every save

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = StorageWeakRef(t.untyped_storage())
        module, op, call = self.modules.current.lstrip("."), self.rec.current, self.rec.call
        if call != self._last_call:
            self._last_call, self._j = call, 0
            self._k = self._calls[(module, short_op(op))]
            self._calls[(module, short_op(op))] += 1
        is_param = key in self.ledger.param_keys
        if key not in self.ctx:
            self.ctx[key] = (module, op, self._k, -1 if is_param else self._j, call)
        if not is_param:
            self._j += 1
        self.dtypes.setdefault(key, t.dtype)
        self.first_save.setdefault(key, {}).setdefault(module, self.saves)
        self.saves += 1
        if self.live is not None and not is_param:
            self.live.saved(t, module, key)
        return self.ledger.pack(t)

    @contextlib.contextmanager
    def recording(self, aten: bool = True):
        """Saves recorded; ``aten=False``: the aten kernels logged by another dispatch mode calling ``aten.note``
        (a step's ``transients.LiveStorages``: one python dispatch mode instead of two, the same log)."""
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.ledger.unpack), self.rec, \
                    (self.aten if aten else contextlib.nullcontext()):
                yield
        finally:
            self.modules.close()

    def storages(self) -> list[dict]:
        """One dict per saved non-parameter storage, in the order of first save."""
        out = []
        for key, r in self.ledger.records.items():
            if r.is_param:
                continue
            module, op, k, j, call = self.ctx[key]
            if op == SDPA:
                op = f"{SDPA}[{self.aten.kernel_tag(call)}]"
            out.append(dict(module=module, op=op, k=k, j=j, dtype=self.dtypes[key], nbytes=r.nbytes,
                            savers=self.first_save[key], key=key))
        return out


def forward_loss(model, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=targets, use_cache=False).loss


@contextlib.contextmanager
def eager_decisions(model=None):
    """Give transformers the answers an eager run gets where it treats fake tensors as tracing: the position ids
    are not packed (``_not_packed``), a mask the model made of ones pads nothing (``_all_ones_masks``), and what a
    run of ``model`` reads of values its code cannot know under fake tensors (``_xlm_lengths``,
    ``_language_adapters``)."""
    hooks = (_language_adapters(model) + _xlm_lengths(model)) if model is not None else []
    try:
        with _not_packed(), _all_ones_masks():
            yield
    finally:
        for hook in hooks:
            hook.remove()


@contextlib.contextmanager
def _not_packed():
    """``find_packed_sequence_indices(position_ids)`` reads the position ids' values to detect packed
    sequences and, for a fake tensor, answers "packed" (a tensor), which builds an explicit mask
    that an eager run never makes.  The position ids are the model's own ``arange(s)`` (we pass
    none), for which an eager run returns None.
    """
    import transformers.masking_utils as mu

    orig = mu.find_packed_sequence_indices
    mu.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = orig


class _Ones:
    """The tensors made by ``torch.ones`` while tracing, and the bool masks transformers converts them to: their
    values are all ones whatever fake tensors hide, as long as nothing wrote into them (their version counter
    unchanged).  Kept by identity (a tensor's ``==`` compares values)."""

    def __init__(self) -> None:
        self._refs: dict[int, tuple[weakref.ref, int]] = {}

    def add(self, t) -> None:
        if isinstance(t, torch.Tensor):
            self._refs[id(t)] = (weakref.ref(t), t._version)

    def __contains__(self, t) -> bool:
        ref, version = self._refs.get(id(t), (None, None))
        return ref is not None and ref() is t and t._version == version


@contextlib.contextmanager
def _all_ones_masks():
    """A padding mask the model made of ones reads as "no padding", as an eager run reads it.

    transformers 5.23's encoder-decoder decoders run alone (``BartDecoder.forward`` in models/bart/modeling_bart.py,
    and its copies in mbart, plbart, pegasus, blenderbot, blenderbot_small, marian, biogpt, ...) make
    ``attention_mask = torch.ones(batch_size, mask_seq_length)`` when given none, and pass it to
    ``masking_utils.create_causal_mask``: ``_preprocess_mask_arguments`` converts it to bool
    (``attention_mask.to(dtype=torch.bool)``), ``sdpa_mask`` hands it (``prepare_padding_mask``: the same tensor when
    it covers kv_length) to ``_ignore_causal_mask_sdpa``, which drops the mask (sdpa's ``is_causal=True``, no s x s
    tensor) when ``q_length == kv_length`` and ``fast_all(padding_mask)``, i.e. by reading its values; for a fake
    tensor (``is_tracing``) it keeps the mask, which sdpa then saves in every layer (2 s^2 b bytes where a real
    CPU run saves none).  While tracing, each tensor ``torch.ones`` makes is remembered (until something writes into
    it), so is the bool mask ``_preprocess_mask_arguments`` makes of one, and ``_ignore_causal_mask_sdpa`` is given no
    padding mask in place of such a one when ``q_length == kv_length`` (the only case a training step meets: no
    cache): there ``fast_all`` of an all-ones mask is true, and the function answers for None exactly as for it.  Any
    other mask (padded by ``prepare_padding_mask``, written into, made of other values) is left to transformers.
    Nothing is hidden after the fact: the trace runs the code path (sdpa's ``is_causal``) the real run takes.
    """
    import transformers.masking_utils as mu

    ones = _Ones()
    made, preprocess, ignore = torch.ones, mu._preprocess_mask_arguments, mu._ignore_causal_mask_sdpa

    def ones_made(*args, **kwargs):
        t = made(*args, **kwargs)
        ones.add(t)
        return t

    def preprocessed(config, inputs_embeds, attention_mask, *args, **kwargs):
        out = preprocess(config, inputs_embeds, attention_mask, *args, **kwargs)
        if attention_mask is not None and attention_mask in ones:
            ones.add(out[1])  # the same values, as bool
        return out

    def ignored(padding_mask, q_length, kv_length, *args, **kwargs):
        if padding_mask is not None and padding_mask in ones and q_length == kv_length:
            padding_mask = None
        return ignore(padding_mask, q_length, kv_length, *args, **kwargs)

    torch.ones, mu._preprocess_mask_arguments, mu._ignore_causal_mask_sdpa = ones_made, preprocessed, ignored
    try:
        yield
    finally:
        torch.ones, mu._preprocess_mask_arguments, mu._ignore_causal_mask_sdpa = made, preprocess, ignore


def _xlm_lengths(model) -> list:
    """XLM asserts ``lengths.max().item() <= s`` (XLMModel.forward, get_masks): lengths counts each row's ids other
    than padding, at most s, which the ShapeEnv cannot derive from a fake tensor's ``.item()``; while XLMModel's
    forward runs, the trace tells it so (``torch._check(0 <= u <= s)``: true of any run) and runs transformers' own
    code. Hooks on the model (none for other models)."""
    xlm = [m for m in model.modules() if type(m).__name__ == "XLMModel"]
    if not xlm:
        return []
    item = torch.Tensor.item

    def bounded(tensor):
        u = item(tensor)
        if isinstance(u, torch.SymInt):
            torch._check(u >= 0)
            torch._check(u <= bounded.s)
        return u

    def enter(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        bounded.s, torch.Tensor.item = ids.shape[1], bounded

    def leave(module, args, kwargs, output):
        torch.Tensor.item = item

    return [xlm[0].register_forward_pre_hook(enter, with_kwargs=True),
            xlm[0].register_forward_hook(leave, with_kwargs=True, always_call=True)]


def _language_adapters(model) -> list:
    """X-MOD: each layer's lang_adapter (XmodOutput) selects the samples of each language with a boolean mask of
    lang_ids, a size fake tensors cannot know; a run without lang_ids gives every sample default_language's
    (XmodModel.forward), so the trace tells the ShapeEnv that (``torch._check``: b rows for that language's adapter,
    none for the others) and runs transformers' own code. Hooks on the model (none for other models)."""
    default = getattr(getattr(model, "config", None), "default_language", None)
    adapters = [(name, m) for name, m in model.named_modules() if type(m).__name__ == "XmodAdapter"]
    if not adapters or default is None:
        return []
    batch = {}

    def take_batch(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        batch["b"] = ids.shape[0]

    def check_rows(name):
        rows = (lambda: batch["b"]) if name.rsplit(".", 1)[-1] == str(default) else (lambda: 0)
        return lambda module, args: torch._check(args[0].shape[0] == rows())

    return [model.register_forward_pre_hook(take_batch, with_kwargs=True)] + [
        m.register_forward_pre_hook(check_rows(name)) for name, m in adapters]


# ---------------------------------------------------------------------------------------------
# the python dispatcher


# Ops for which the python dispatcher would run a Python decomposition that saves differently from
# the C++ kernel an eager run executes: torch/_decomp's dropout is native_dropout (a bool mask; the
# C++ CPU kernel keeps a bernoulli_ mask in the input's dtype) and clone() at p = 0 (C++ returns
# the input itself, so nothing new is saved).
_EAGER_ONLY = ("dropout.default",)


def _aten(name: str):
    packet, overload = name.split(".")
    return getattr(getattr(torch.ops.aten, packet), overload)


@contextlib.contextmanager
def with_python_dispatcher(enabled: bool = True, overrides: dict[str, Callable] | None = None):
    """``enable_python_dispatcher()``: torch's C++ composite ops then run their Python ports
    (``aten.matmul``'s among them), which keep sizes symbolic where the C++ code reads them as
    ints (and so would pin s and b); except the ops of ``_EAGER_ONLY``, which keep their C++
    kernels, and the ``overrides`` (aten op name -> Python kernel for its composite / autograd
    keys: the CUDA kernels' emulation)."""
    if not enabled:
        yield
        return
    from torch._C import DispatchKey
    from torch._dispatch.python import enable_python_dispatcher

    keys = (DispatchKey.CompositeImplicitAutograd, DispatchKey.Autograd)
    saved = []
    for name in dict.fromkeys(_EAGER_ONLY + tuple(overrides or ())):
        op = _aten(name)
        saved.append((op, {k: op.py_kernels[k] for k in keys if k in op.py_kernels}))
        for k in keys:
            op.py_kernels.pop(k, None)
        if overrides and name in overrides:
            for k in keys:
                op.py_kernels[k] = overrides[name]
        op._dispatch_cache.clear()
    try:
        with enable_python_dispatcher():
            yield
    finally:
        for op, kernels in saved:
            for k in keys:
                op.py_kernels.pop(k, None)
            op.py_kernels.update(kernels)
            op._dispatch_cache.clear()
