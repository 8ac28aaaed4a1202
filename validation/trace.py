"""Trace what transformers' real model code saves for backward, as exact polynomials in s and b.

``trace_hf_config(config)`` builds the ``*ForCausalLM`` of a transformers ``config.json`` (from the
config alone: no weights, no network) under ``FakeTensorMode`` with a ``ShapeEnv``, gives it token
ids of shape ``[b, s]`` where s (sequence length) and b (micro-batch) are *symbols*, runs forward +
loss once in training mode, and records every storage autograd saves for backward
(``saved_tensors_hooks``; one entry per storage, views of one storage count once; parameters and
buffers excluded).  Under fake tensors nothing is allocated, so the real config's sizes are used
(h, a, g, f, v as the config says), and each storage's size comes
out as a symbolic expression: an exact polynomial in s and b with integer coefficients, which is
written in memplan's ``Poly`` syntax (``"5656 s b"``, ``"12 s^2 b + 64 s b"``).

The real config's sizes are used (no reduced model), but not every decoder layer runs: the
first layer of each kind, one in its middle, and the model's last two (``validation/compose.py``: layers with the same
modules, parameter shapes and per-layer settings, e.g. Gemma 3's sliding layers, whose sdpa keeps
an s x s mask, beside its global ones, or DeepSeek-V3's dense first layers before the MoE ones)
run, with the embedding, head and loss once, and every other layer takes its kind's terms
(``compose=False`` traces every layer: the reference tests compare the composition with).
Layers whose saved tensors are identical (same ids, ops, dtypes and polynomials) form one group.  MoE layers trace with
transformers' default ``grouped_mm`` experts: dropless top-k routing sends all k s b token copies
through grouped GEMMs, so every size is a polynomial; an expert loop over the experts that
received tokens (``experts_implementation="eager"``) is data-dependent and refused.

How a saved storage is named: from the context of its *first* save (``validation.hf``'s
machinery): the module path (relative to the decoder layer, ``self_attn.q_proj``, or to the model,
``model.norm``, ``""`` for the loss computed in the ``*ForCausalLM`` itself), the outermost torch call
in progress (``torch.nn.functional.linear``; ``scaled_dot_product_attention`` refined with the aten
kernel it reached, ``[flash_cpu]`` / ``[math]``), ``k`` the how-many-th saving call of that op in
that module and ``j`` the position of the tensor among what that call saved.  The id is
``<module>.<op>[#k].<j>``, e.g. ``self_attn.q_proj.linear.0``, ``mlp.mul.1``,
``input_layernorm.mul#1.0``: stable for a given code path and unique within a layer.  A storage
saved by several layers (the rotary cos / sin tables) is listed in every layer that saves it with
``shared: true``; it exists once per forward, so a consumer counts it once per id (memplan's
``chunk`` scope): shared ids are unique in the whole file (a second shared storage whose id is
taken, as Gemma 3's global rope tables beside its local ones, gets ``@<its first layer>``).  A
storage saved both outside and inside the layers would be listed in both, shared.

The trace is refused (``TraceRefused``) when it is not valid for every s and b:

* guards or replacements in the ShapeEnv that pin s or b (``Eq(s, 4096)``, ``s -> 4096``): some code
  turned a size into a Python int or compared it with a constant.  Wrapping the forward in
  ``torch._dispatch.python.enable_python_dispatcher()`` is what keeps torch's own C++ composite
  ops from doing that (``aten.matmul``'s C++ folding of batch dimensions reads sizes as ints; its
  Python port keeps them symbolic): without it eager attention specialises both s and b
  (``python_dispatcher=False`` shows it; tests check the refusal).  The python dispatcher also
  swaps in ``torch/_decomp``'s ``dropout``, which is not what an eager run executes (a bool
  ``native_dropout`` mask instead of the CPU kernel's bf16 ``bernoulli_`` one, a copy at p = 0),
  so dropout keeps its C++ kernel (``_EAGER_ONLY``);
* a size that is not a polynomial in s and b, or a forward that depends on tensor values
  (data-dependent control flow or sizes).

Range guards (``s >= 4096``: a sliding window that only masks when the sequence is longer than
the window) do not pin s; they are kept in the result's ``conditions`` with the symbols' ranges
(s, b >= 2 always: torch specialises sizes 0 and 1, so a trace never covers b = 1, where a few
kernels save differently, e.g. matmul keeps views instead of copies).  Which side of such a guard
is traced is chosen by the hints ``s_hint`` / ``b_hint`` (the values the ShapeEnv evaluates guards
at).

transformers treats fake tensors as tracing (``is_tracing(t)`` is true for a ``FakeTensor``) and
then takes branches an eager run never takes.  The one that changes saved tensors is
``masking_utils.find_packed_sequence_indices``: it cannot read fake position ids, answers
"packed" and makes ``create_causal_mask`` build an explicit mask (an ``s^2 b`` tensor saved by
sdpa, where a real run passes ``is_causal=True``).  The model builds its own position ids
(``arange(s)``: not packed), so the real answer, None, is given while tracing (``_eager_decisions``).
Tests compare traces with real CPU runs at several (s, b) to catch any other such branch.

Kernels: ``kernels="cpu"`` is what torch's CPU kernels save (the trace runs them as fake CPU
tensors): dropout through ``F.dropout`` keeps a bf16 ``bernoulli_`` mask, sdpa reaches
``_scaled_dot_product_flash_attention_for_cpu`` without dropout and the fp32 math path (s^2
tensors) with dropout, layer norm keeps its mean and rstd in the activation dtype.
``kernels="cuda"`` emulates what the CUDA kernels save, still on fake CPU tensors (a CPU-only
torch cannot make fake CUDA tensors for a whole model), by swapping the ops whose CUDA kernels
save differently at dispatch level (``_CudaKernels``): native_dropout's bool mask, torch's choice
of cuDNN / FlashAttention-2 / memory-efficient / math sdpa kernel (its default order on an H100:
``SDPA_ORDER``; ``sdpa=`` another) with their saved tensors (q, k, v, out, fp32 logsumexp, Philox
RNG state, the additive mask), fp32 layer-norm statistics.  It is derived from torch's dispatch
code, checked against memplan's CUDA inventories (terms_hf) and against an H100's saved bytes
(validation/cuda_dropout.py; tests/data/cuda_dropout.json, tests/test_cuda_dropout.py);
``measure_hf_config(device="cuda")`` is the measurement (tests/test_trace.py, skipped without CUDA).

CLI: ``python -m validation.trace --hf-config config.json [--impl hf-sdpa|hf-eager]
[--kernels cpu|cuda] [--out FILE.yaml]`` (YAML on stdout without ``--out``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import re
from collections import Counter
from fractions import Fraction
from functools import lru_cache, partial
from pathlib import Path
from typing import Any, Callable

from . import hf as _hf  # sets HF_HUB_OFFLINE before transformers is imported

import sympy  # noqa: E402
import torch  # noqa: E402
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402

from . import compose as compose_  # noqa: E402
from . import layer_order as order_  # noqa: E402
from .measure import Ledger, _ModuleStack, _OpRecorder  # noqa: E402

FORMAT = "memplan-traced-inventory/2"
IMPLS = ("hf-sdpa", "hf-eager")
KERNELS = ("cpu", "cuda")
# torch's default sdpa priority on sm90 (H100) with cuDNN > 9.15.0 (torch 2.11 + cuDNN 9.19 measured): _CudaKernels
SDPA_ORDER = ("cudnn", "flash", "efficient", "math")
SDPA = _hf.SDPA


class TraceRefused(RuntimeError):
    """The trace does not describe every (s, b): a size was specialised or is not a polynomial."""


# ---------------------------------------------------------------------------------------------
# configs


def load_config(config: dict | str | Path) -> dict:
    """A config.json as a dict (a dict is copied; a str or Path is a path to the JSON file)."""
    if isinstance(config, dict):
        return json.loads(json.dumps(config))
    return json.loads(Path(config).read_text())


# config.json keys that do not change what a training step saves (memplan/inventory/traced_file.py's
# METADATA_KEYS, the key of a traced inventory: validation/ does not import memplan; a test checks they agree)
METADATA_KEYS = frozenset({
    "transformers_version", "torch_dtype", "dtype", "_name_or_path", "name_or_path", "_commit_hash", "auto_map",
    "architectures", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "use_cache", "cache_implementation", "initializer_range", "tokenizer_class", "output_attentions",
    "output_hidden_states", "return_dict", "id2label", "label2id", "num_labels", "problem_type",
    "task_specific_params", "finetuning_task", "prefix", "_attn_implementation", "_attn_implementation_autoset",
    "attn_implementation", "use_return_dict", "torchscript", "generation_config"})


def architecture_fields(config):
    """The config without its metadata keys (nested configs too), integral floats as integers."""
    if isinstance(config, dict):
        return {k: architecture_fields(v) for k, v in config.items() if k not in METADATA_KEYS}
    if isinstance(config, list):
        return [architecture_fields(v) for v in config]
    if isinstance(config, float) and config.is_integer() and abs(config) < 2 ** 53:
        return int(config)
    return config


def config_sha256(config: dict) -> str:
    """sha256 of the canonical JSON (sorted keys, no whitespace) of a config's architecture fields."""
    text = json.dumps(architecture_fields(config), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def hf_config(config: dict):
    """The transformers config object of a config dict (its ``model_type`` picks the class)."""
    tf = _hf._transformers()
    if "model_type" not in config:
        raise ValueError("the config has no model_type")
    cls = tf.CONFIG_MAPPING[config["model_type"]]
    cfg = cls.from_dict(dict(config))
    cfg.loss_type = "ForCausalLM"  # what the Trainer uses for a causal LM; set to silence the guess
    return cfg


def build_model(config: dict, impl: str = "hf-sdpa", dtype: str = "bfloat16", experts: str | None = None):
    """``AutoModelForCausalLM.from_config`` in training mode (under a fake mode when one is active);
    ``experts``: transformers' ``experts_implementation`` of MoE models (None: its default)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}")
    tf = _hf._transformers()
    kwargs = {"experts_implementation": experts} if experts else {}
    kwargs.update(dtype=getattr(torch, dtype), attn_implementation=impl.removeprefix("hf-"))
    cfg = hf_config(config)
    try:
        model = tf.AutoModelForCausalLM.from_config(cfg, **kwargs)
    except ValueError:  # a text model's config the mapping does not name (Emu3TextConfig): the class it configures
        cls = getattr(tf, (config.get("architectures") or [""])[0], None)
        if cls is None or getattr(cls, "config_class", None) is not type(cfg):
            raise
        model = cls._from_config(cfg, **kwargs)
    return model.train()


def decoder_layers_path(model, num_layers: int) -> str:
    """Module path of the decoder layers' ModuleList (``model.layers``, ``transformer.h``)."""
    found = [name for name, m in model.named_modules()
             if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers and name]
    if not found:
        raise ValueError(f"no ModuleList of {num_layers} decoder layers in {type(model).__name__}")
    return min(found, key=lambda n: n.count("."))


def num_hidden_layers(model) -> int:
    return int(model.config.num_hidden_layers)


# ---------------------------------------------------------------------------------------------
# recording saved storages (fake or real tensors alike)


class _Saves:
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
            self._k = self._calls[(module, _short_op(op))]
            self._calls[(module, _short_op(op))] += 1
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
    def recording(self):
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.ledger.unpack), self.rec, self.aten:
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


def _forward_loss(model, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=targets, use_cache=False).loss


@contextlib.contextmanager
def _eager_decisions():
    """Give transformers the answers an eager run gets where it treats fake tensors as tracing.

    ``find_packed_sequence_indices(position_ids)`` reads the position ids' values to detect packed
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


# ---------------------------------------------------------------------------------------------
# the symbolic trace

# Ops for which the python dispatcher would run a Python decomposition that saves differently from
# the C++ kernel an eager run executes: torch/_decomp's dropout is native_dropout (a bool mask; the
# C++ CPU kernel keeps a bernoulli_ mask in the input's dtype) and clone() at p = 0 (C++ returns
# the input itself, so nothing new is saved).
_EAGER_ONLY = ("dropout.default",)


def _aten(name: str):
    packet, overload = name.split(".")
    return getattr(getattr(torch.ops.aten, packet), overload)


@contextlib.contextmanager
def _python_dispatcher(enabled: bool = True, overrides: dict[str, Callable] | None = None):
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


class _CudaKernels:
    """What torch's CUDA kernels save, emulated on fake CPU tensors (``kernels="cuda"``).

    Read off torch's C++ dispatch (aten/src/ATen/native/Dropout.cpp, transformers/attention.cpp,
    transformers/cuda/sdp_utils.cpp) for an sm90 GPU (H100), fp16 / bf16, and measured there
    (validation/cuda_dropout.py; torch 2.11.0+cu130, cuDNN 9.19, tests/data/cuda_dropout.json):

    * ``dropout``: on CUDA ``at::dropout`` is ``native_dropout`` (a 1-byte bool mask) for
      0 < p < 1, the input itself at p = 0;
    * ``scaled_dot_product_attention``: the first kernel of ``sdpa`` (``SDPA_ORDER``) that takes the
      call. ``SDPA_ORDER`` is torch's default priority on sm90 / sm100 / sm103 with a cuDNN newer
      than 9.15.0 (sdp_utils.cpp ``check_prefer_cudnn_attention``: cuDNN, flash, memory-efficient,
      math; torch 2.9+ wheels with cuDNN 9.15.1+, e.g. torch 2.11 with cuDNN 9.19; an older cuDNN, an
      A100 or ``TORCH_CUDNN_SDPA_DEPRIORITIZED=1`` put flash first: ``sdpa=SDPA_ORDER[1:]``):
      - cuDNN attention (``_scaled_dot_product_cudnn_attention``; ``check_cudnn_tensor_shapes``:
        head dims multiples of 8, <= 256 on sm90 with cuDNN >= 9.10; any mask, turned into an
        additive one in the activation dtype; GQA native) saves q, k, v, the output, an fp32
        logsumexp [b, a, s, 1], the mask and its Philox seed and offset, int64 [] each (16 bytes:
        torch/_meta_registrations.py ``meta__scaled_dot_product_cudnn_attention``). Its output is
        allocated in q's layout (``alloc_with_matching_layout``, the meta registration does the
        same), where flash and memory-efficient attention allocate [b, s, a, d]: for DeepSeek's MLA,
        whose q is a ``torch.cat`` (contiguous [b, a, s, d]), transformers' ``transpose(1, 2)
        .reshape`` before o_proj then copies the output and o_proj keeps the copy: b a s d_v
        elements more than the memory-efficient kernel (which flash's d_qk != d_v refusal leaves),
        as measured on the H100;
      - FlashAttention-2 (``_scaled_dot_product_flash_attention``: no mask, equal head dims <= 256;
        head dim padded to a multiple of 8; GQA native) saves q, k, v, the output, an fp32
        logsumexp [b, a, s] and the RNG state uint64 [2] and [] (24 bytes, GPU tensors);
      - memory-efficient attention (any mask, turned into an additive one; head dims multiples of
        8; no GQA: equal head counts) saves the same plus the mask, its logsumexp padded to a
        multiple of 32 along s, and an int64 [] seed and offset (which a CUDA run outside graph
        capture keeps on the host: 16 bytes counted that the GPU does not hold);
      - else the math kernel, as on CPU (fp32).
      With dropout (``attention_dropout > 0``) the choice is the same (cuDNN takes dropout except
      with cuDNN 9.11 - 9.13; torch 2.11 took p = 0.1, where some other sdp_utils.cpp versions
      refuse a p that is not a multiple of 1/16: neither emulated): each kernel keeps only
      the Philox state to replay it, never an s x s tensor (measured); CPU sdpa instead leaves its
      flash kernel for the fp32 math path. The math kernel's own ``at::dropout`` goes through the
      ``dropout`` below (a bool mask). A kernel list without one that takes the call raises
      RuntimeError("No available kernel"), as torch does;
    * ``native_layer_norm``: fp32 mean and rstd for fp16 / bf16 inputs (CPU: the input's dtype).

    Conditions that make a size exact (a mask's rows aligned to 8 elements: s % 8 == 0) are
    assumed, not guarded, and listed in ``assumed``.
    """

    def __init__(self, names: dict, sdpa: tuple[str, ...] = SDPA_ORDER) -> None:
        if not sdpa or set(sdpa) - set(SDPA_ORDER):
            raise ValueError(f"sdpa kernels must be some of {SDPA_ORDER}")
        self.names = names  # torch symbol -> sympy Symbol("s" / "b")
        self.order = tuple(sdpa)
        self.assumed: list[str] = []

    def overrides(self) -> dict[str, Callable]:
        return {"dropout.default": self.dropout, "scaled_dot_product_attention.default": self.sdpa}

    @staticmethod
    def dropout(input, p, train):
        if not train or p == 0:
            return input
        if p == 1:
            return input * torch.zeros((), dtype=input.dtype, device=input.device)
        return torch.ops.aten.native_dropout.default(input, p, train)[0]

    def _assume_divisible(self, size, n: int) -> None:
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        if statically_known_true(size % n == 0):
            return
        expr = _expr(size).xreplace(self.names)
        self.assumed.append(f"{expr} % {n} == 0")

    @staticmethod
    def _additive(attn_mask, dtype):
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            return torch.where(attn_mask, torch.zeros((), dtype=dtype), torch.full((), float("-inf"), dtype=dtype))
        return attn_mask

    def _takes(self, kernel: str, query, key, value, attn_mask) -> bool:
        """Whether `kernel` takes the call (sdp_utils.cpp's checks that tiny and real configs meet)."""
        low = query.dtype in (torch.float16, torch.bfloat16)
        d_qk, d_v = int(query.shape[-1]), int(value.shape[-1])
        if kernel == "cudnn":
            return low and d_qk % 8 == 0 and d_v % 8 == 0 and max(d_qk, d_v) <= 256
        if kernel == "flash":
            return attn_mask is None and low and d_qk == d_v and d_qk <= 256
        if kernel == "efficient":
            align = 8 if low else 4
            return (d_qk % align == 0 and d_v % align == 0 and query.shape[1] == key.shape[1]
                    and query.dtype in (torch.float16, torch.bfloat16, torch.float32))
        return True

    def sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
        aten = torch.ops.aten
        kernel = next((k for k in self.order if self._takes(k, query, key, value, attn_mask)), None)
        if kernel is None:
            raise RuntimeError(f"No available kernel among {self.order} (the CUDA kernels' emulation)")
        d_qk = int(query.shape[-1])
        if kernel == "cudnn":
            return aten._scaled_dot_product_cudnn_attention.default(
                query, key, value, self._additive(attn_mask, query.dtype), True, dropout_p, is_causal, False,
                scale=scale)[0]
        if kernel == "flash":
            pad = -d_qk % 8
            scale_ = scale if scale is not None else 1.0 / math.sqrt(d_qk)
            if pad:
                query, key, value = (torch.nn.functional.pad(x, (0, pad)) for x in (query, key, value))
            out = aten._scaled_dot_product_flash_attention.default(query, key, value, dropout_p, is_causal, False,
                                                                    scale=scale_)[0]
            return out[..., :d_qk] if pad else out
        if kernel == "efficient":
            attn_mask = self._additive(attn_mask, query.dtype)
            if attn_mask is not None:
                # rows aligned to 8 elements: no padded copy (pad_bias); the outer strides are
                # multiples of the row stride (contiguous) or 0 (broadcast)
                self._assume_divisible(attn_mask.stride(-2), 8)
                attn_mask = attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
            return aten._scaled_dot_product_efficient_attention.default(
                query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale)[0]
        return aten._scaled_dot_product_attention_math.default(query, key, value, self._additive(attn_mask, query.dtype),
                                                               dropout_p, is_causal, None, scale=scale,
                                                               enable_gqa=enable_gqa)[0]

    def norm_stats(self):
        """A dispatch mode that gives native_layer_norm CUDA's fp32 mean and rstd."""
        from torch.utils._python_dispatch import TorchDispatchMode

        class NormStats(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func is torch.ops.aten.native_layer_norm.default and out[1].dtype in (torch.float16,
                                                                                         torch.bfloat16):
                    out = (out[0], out[1].to(torch.float32), out[2].to(torch.float32))
                return out

        return NormStats()


# ---------------------------------------------------------------------------------------------
# the symbolic trace


def symbolic_saves(build: Callable[[], torch.nn.Module], forward: Callable[..., torch.Tensor],
                   make_inputs: Callable[[Any, Any], tuple], s_hint: int = 4096, b_hint: int = 2,
                   python_dispatcher: bool = True, kernels: str = "cpu"
                   ) -> tuple[torch.nn.Module, list[dict], list[str]]:
    """Run ``forward(model, *make_inputs(s, b))`` once under FakeTensorMode with s and b symbolic.

    ``build()`` makes the module inside the fake mode (its parameters fake, concrete shapes);
    ``make_inputs(s, b)`` gets SymInts.  Returns the model, the saved storages (``_Saves.storages``
    with ``nbytes`` a sympy polynomial in the symbols ``s`` and ``b``) and the conditions the trace
    holds under (ranges of s and b, range guards, divisibility assumed).  Raises ``TraceRefused``
    when the ShapeEnv specialised s or b or a size is not a polynomial in them.
    """
    run = symbolic_run(build, forward, make_inputs, s_hint, b_hint, python_dispatcher, kernels)
    return run["model"], run["storages"], run["conditions"]


def symbolic_run(build: Callable[[], torch.nn.Module], forward: Callable[..., torch.Tensor],
                 make_inputs: Callable[[Any, Any], tuple], s_hint: int = 4096, b_hint: int = 2,
                 python_dispatcher: bool = True, kernels: str = "cpu", step: dict | None = None,
                 shapes: dict | None = None, sdpa: tuple[str, ...] = SDPA_ORDER) -> dict:
    """``symbolic_saves``' run, as a dict (model, storages, conditions); with ``step`` (``layers``:
    model -> (decoder layers' module path, their number), ``checkpoint``: gradient checkpointing on)
    also the backward (``loss.backward()`` under the same fake mode, so the gradients are symbolic
    too) with every live storage followed (validation/transients.py): ``sampler`` (the candidate
    moments per layer and of the head), ``kept`` (checkpointing: the tensors every checkpointed
    layer is given, alive when the backward starts, and a layer's input), ``args`` (decoder layers'
    input tensors by (argument, first layer): the records, to match the two runs).  ``shapes``: a dict the
    runs of one trace share, which keeps the first run's ShapeEnv, symbols s, b and their SymInts, so a
    later run finds the first one's fake-tensor dispatch cache (it lives on the ShapeEnv) and its guards
    (decided the same way again); the conditions and sizes come out as with a ShapeEnv of its own. ``sdpa``: the
    CUDA sdpa kernels tried, in order (``kernels="cuda"``; ``_CudaKernels``)."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    if s_hint < 2 or b_hint < 2 or s_hint == b_hint:
        raise ValueError("need distinct hints s_hint, b_hint >= 2 (torch specialises sizes 0 and 1)")
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}")
    if kernels == "cuda" and not python_dispatcher:
        raise ValueError("the CUDA kernels are emulated through the python dispatcher")
    shapes = {} if shapes is None else shapes
    if "env" not in shapes:
        env = ShapeEnv(duck_shape=False)
        symbols = {}
        sizes = {}
        for name, hint in (("s", s_hint), ("b", b_hint)):
            sym = env.create_symbol(hint, source=ConstantSource(f"memplan_{name}"), dynamic_dim=DimDynamic.DYNAMIC)
            symbols[sym] = name
            sizes[name] = env.create_symintnode(sym, hint=hint)
        shapes.update(env=env, symbols=symbols, sizes=sizes, hints=(s_hint, b_hint))
    elif shapes["hints"] != (s_hint, b_hint):
        raise ValueError("a shared ShapeEnv needs the same hints")
    env, symbols, sizes = shapes["env"], shapes["symbols"], shapes["sizes"]
    named = {sym: sympy.Symbol(name, integer=True, positive=True) for sym, name in symbols.items()}
    cuda = _CudaKernels(named, sdpa) if kernels == "cuda" else None
    run: dict = {}
    polys_conditions: list[str] = []
    with FakeTensorMode(shape_env=env, allow_non_fake_inputs=False):
        model = build()
        saves = _Saves(model)
        tracking = _tracking(model, saves, named, step, polys_conditions, run) if step else contextlib.nullcontext()
        with _eager_decisions(), saves.recording(), tracking as live:
            with _python_dispatcher(python_dispatcher, cuda.overrides() if cuda else None), \
                    (cuda.norm_stats() if cuda else contextlib.nullcontext()), _data_dependence_refused():
                # the inputs live as long as the model's code keeps them (a training loop's batch dies with its step)
                loss = forward(model, *make_inputs(sizes["s"], sizes["b"]))
                if step:
                    run["sampled"] = step.get("sampled") or _representatives(live, saves)
                    live.sampler.layers = set(run["sampled"])
                    live.set(phase="backward", layer=None)
                    # the lowest layer whose input the checkpoint keeps (Gemma 4's first layer's input, the
                    # embeddings, is saved outside the layers already, by its per-layer input projection)
                    first = min((k[1] for k, v in live.buckets.items() if k[0] == "input" and v), default=0)
                    run["kept"] = {"inputs": list(live.buckets.get(("input", first), {}).values()),
                                   "extras": list(live.buckets.get(("extra",), {}).values())}
                    hooks = order_.engine_hooks(loss, live) if step.get("order") else []
                    loss.backward()
                    for h in hooks:
                        h.remove()
                del loss
    conditions = _check_guards(env, symbols) + (cuda.assumed if cuda else [])
    out = []
    for st in saves.storages():
        st["nbytes"] = _as_poly_expr(st["nbytes"], named, st, conditions)
        out.append(st)
    run.update(model=model, storages=out, conditions=_merge_divisibility(conditions + polys_conditions))
    return run


def _representatives(live, saves: _Saves) -> list[int]:
    """The decoder layers whose backward is sampled: of each kind of layer (the same saves, by module,
    op, k, j, dtype and size) the first two and the last two; the others repeat them."""
    kinds: dict[tuple, list[int]] = {}
    for i in range(live.num_layers):
        recs = live.buckets.get(("saved", i), {}).values()
        sig = tuple(sorted((*(str(x) for x in saves.ctx[r.key][:4]), str(r.dtype), str(r.nbytes)) for r in recs))
        kinds.setdefault(sig, []).append(i)
    return sorted({i for layers in kinds.values() for i in layers[:2] + layers[-2:]})


def grad_hooks(model, live) -> list:
    """A hook on every trainable parameter telling ``live`` its gradient is made; a frozen one (AFMoE's expert_bias,
    Laguna's e_score_correction_bias: parameters with requires_grad false) gets no gradient and no hook."""
    return [p.register_post_accumulate_grad_hook(partial(lambda name, p: live.grad_made(p, name), name))
            for name, p in model.named_parameters() if p.requires_grad]


@contextlib.contextmanager
def _tracking(model, saves: _Saves, named: dict, step: dict, conditions: list[str], run: dict):
    """The live-storage tracker of a step's run (``symbolic_run``), with its hooks: forward and backward
    labels per decoder layer (validation/step.py), the layers' inputs, every save, every gradient."""
    from . import transients
    from .step import _LayerHooks

    path, n = step["layers"](model)
    checkpoint = step["checkpoint"]
    if checkpoint:  # transformers 5.x renamed gradient_checkpointing_enable (deprecated alias)
        kw = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    live = transients.LiveStorages(named, path, n)
    live.module = lambda: saves.modules.current
    polys = transients.Polys(named, conditions, _exact_divisions)
    sampler = transients.Sampler(live, polys, checkpointed=checkpoint, head=not checkpoint)
    run.update(sampler=sampler, polys=polys, args={})
    saves.live = live
    layers = list(model.get_submodule(path))
    handles = []

    def inputs(i, module, args, kwargs):
        if live.phase == "backward":  # a checkpointed layer's recompute
            return
        for label, rec in live.layer_inputs(i, args, kwargs, checkpoint).items():
            if rec is not None:
                run["args"].setdefault(rec.cdata, (label, i, rec))

    if step.get("order"):  # the allocations and frees in order (validation/layer_order.py)
        live.log = run["log"] = []
        for layer in layers if checkpoint else ():
            _flag_reruns(layer, live)
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(partial(inputs, i), with_kwargs=True))
    handles += grad_hooks(model, live)
    hooks = _LayerHooks(live, layers)
    live.sampler = sampler
    try:
        with live:
            yield live
    finally:
        live.sampler = None
        hooks.close()
        for h in handles:
            h.remove()


def _flag_reruns(layer, live) -> None:
    """``live.rerun`` set while a checkpointed layer's forward runs again in the backward: transformers checkpoints
    the layer's ``forward`` through ``_gradient_checkpointing_func`` (its module hooks stay outside the recompute)."""
    checkpointed = getattr(layer, "_gradient_checkpointing_func", None)
    if checkpointed is None:
        return

    def flagged(fn, *args, **kwargs):
        def run(*a, **k):
            again = live.phase == "backward"
            live.rerun = again
            try:
                return fn(*a, **k)
            finally:
                live.rerun = live.rerun and not again

        return checkpointed(run, *args, **kwargs)

    layer._gradient_checkpointing_func = flagged


@contextlib.contextmanager
def _data_dependence_refused():
    """Control flow or sizes that depend on tensor values cannot be traced symbolically: refuse."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    try:
        yield
    except (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException) as err:
        first = (str(err).strip().splitlines() or [""])[0]
        raise TraceRefused(
            "the forward depends on tensor values (data-dependent control flow or sizes, e.g. a loop over the "
            "experts that received tokens; transformers' grouped_mm experts, its default, route all k s b token "
            f"copies and trace): {type(err).__name__}: {first[:200]}") from None


def _merge_divisibility(conditions: list[str]) -> list[str]:
    """Conditions once each; ``s % 8 == 0`` and ``s % 32 == 0`` as ``s % 32 == 0``."""
    out: list[str] = []
    moduli: dict[str, int] = {}
    for c in conditions:
        m = re.fullmatch(r"(\w+) % (\d+) == 0", c)
        if m:
            sym, n = m.group(1), int(m.group(2))
            moduli[sym] = math.lcm(moduli.get(sym, 1), n)
            c = f"{sym} % == 0"  # placeholder at the first position of this symbol's condition
        if c not in out:
            out.append(c)
    return [f"{c.split()[0]} % {moduli[c.split()[0]]} == 0" if c.endswith(" % == 0") else c for c in out]


def _expr(x) -> sympy.Expr:
    if isinstance(x, torch.SymInt):
        return x.node.expr
    return sympy.Integer(int(x))


def _exact_divisions(expr: sympy.Expr, conditions: list[str]) -> sympy.Expr:
    """``CeilToInt(IntTrueDiv(s, 32))``, ``FloorDiv(s, 32)`` -> ``s/32`` with the condition
    ``s % 32 == 0`` (a kernel that pads s to a multiple of 32: exact for such s, an under-estimate
    of at most one block otherwise)."""
    if not expr.args:
        return expr
    name = type(expr).__name__
    inner = None
    if name in ("CeilToInt", "FloorToInt") and type(expr.args[0]).__name__ == "IntTrueDiv":
        inner = expr.args[0].args
    elif name in ("FloorDiv", "CleanDiv", "IntTrueDiv"):
        inner = expr.args
    if inner is not None:
        x, n = (_exact_divisions(a, conditions) for a in inner)
        if n.is_Integer and x.is_Symbol:
            conditions.append(f"{x} % {n} == 0")
            return x / n
    return expr.func(*(_exact_divisions(a, conditions) for a in expr.args))


def _as_poly_expr(nbytes, named: dict, st: dict, conditions: list[str]) -> sympy.Expr:
    expr = sympy.expand(_exact_divisions(_expr(nbytes).xreplace(named), conditions))
    allowed = set(named.values())
    where = f"{st['module'] or '<model>'}: {st['op']} ({st['dtype']})"
    if not expr.free_symbols <= allowed:
        extra = sorted(map(str, expr.free_symbols - allowed))
        raise TraceRefused(f"the size of a saved tensor depends on data ({where}: {expr}; symbols {extra}, "
                           "e.g. MoE routing or nonzero): not a polynomial in s and b")
    try:
        poly = sympy.Poly(expr, *sorted(allowed, key=str))
    except sympy.PolynomialError:
        raise TraceRefused(f"the size of a saved tensor is not a polynomial in s and b ({where}: {expr})") from None
    if not all(c.is_Rational for c in poly.coeffs()):
        raise TraceRefused(f"non-rational coefficient in the size of a saved tensor ({where}: {expr})")
    return expr


def _check_guards(env, symbols: dict) -> list[str]:
    """Refuse a trace that pinned s or b; return the conditions it holds under: the ranges of s and
    b the guards left (``s >= 2``; ``s >= 4096`` after a sliding window's ``kv_length >= window``)
    and any other guard on them, as text in s and b."""
    names = {sym: sympy.Symbol(n) for sym, n in symbols.items()}
    pinned = []
    for sym, value in env.replacements.items():
        if sym in symbols:
            pinned.append(f"replacement {symbols[sym]} -> {value.xreplace(names)}")
    others = []
    for g in env.guards:
        free = g.expr.free_symbols & set(symbols)
        if not free:
            continue
        text = str(g.expr.xreplace(names))
        if isinstance(g.expr, sympy.Eq):
            pinned.append(f"guard {text} at {g.sloc}")
        elif len(g.expr.free_symbols) == 1 and isinstance(g.expr, (sympy.Ge, sympy.Gt, sympy.Le, sympy.Lt)):
            continue  # a bound of one symbol: in its range below
        else:
            others.append(text)
    ranges = []
    for sym, name in symbols.items():
        vr = env.var_to_range.get(sym)
        lo, hi = (vr.lower, vr.upper) if vr is not None else (2, None)
        if vr is not None and vr.lower == vr.upper:
            pinned.append(f"the range of {name} is [{vr.lower}, {vr.upper}]")
        ranges.append(f"{name} >= {lo}")
        if isinstance(hi, sympy.Integer):  # not int_oo
            ranges.append(f"{name} <= {hi}")
    if pinned:
        raise TraceRefused("the trace specialised the sequence length s or the micro-batch b, so its sizes hold "
                           "only for the traced values: " + "; ".join(pinned))
    return ranges + list(dict.fromkeys(others))


# ---------------------------------------------------------------------------------------------
# polynomials in memplan's Poly syntax


@lru_cache(maxsize=4096)
def poly_text(expr: sympy.Expr) -> str:
    """'12 s^2 b + 64 s b' for 12*s**2*b + 64*s*b (memplan's ``Poly.parse_sum`` syntax; cached: a trace writes
    the same few sizes many times)."""
    expr = sympy.expand(expr)
    if expr == 0:
        return "0"
    s, b = sympy.Symbol("s", integer=True, positive=True), sympy.Symbol("b", integer=True, positive=True)
    expr = expr.xreplace({x: (s if str(x) == "s" else b) for x in expr.free_symbols})
    poly = sympy.Poly(expr, s, b)
    parts = []
    for (ps, pb), coef in sorted(poly.terms(), key=lambda t: (-(t[0][0] + t[0][1]), -t[0][0])):
        c = Fraction(int(coef.p), int(coef.q))
        tokens = []
        if c.numerator != 1 or (ps == 0 and pb == 0):
            tokens.append(str(c.numerator))
        tokens += [f"s^{ps}" if ps > 1 else "s"] if ps else []
        tokens += [f"b^{pb}" if pb > 1 else "b"] if pb else []
        if c.denominator != 1:
            tokens.append(f"/{c.denominator}")
        parts.append(" ".join(tokens))
    return " + ".join(parts)


def evaluate(text: str, s: int, b: int) -> int:
    """A polynomial of an inventory file (memplan's ``Poly`` syntax) at (s, b), exactly.  Parsed
    here: validation/ never imports memplan."""
    total = Fraction(0)
    for product in text.split("+"):
        value = Fraction(1)
        for token in product.split():
            divide = token.startswith("/")
            token = token.lstrip("/")
            if token[0].isdigit():
                factor = Fraction(token)
            else:
                sym, _, power = token.partition("^")
                factor = Fraction({"s": s, "b": b}[sym]) ** int(power or 1)
            value = value / factor if divide else value * factor
        total += value
    if total.denominator != 1:
        raise ValueError(f"{text} is not an integer at s={s}, b={b}")
    return int(total)


# ---------------------------------------------------------------------------------------------
# the inventory


_SHORT = re.compile(r"[^A-Za-z0-9_]+")


def _short_op(op: str) -> str:
    base = op.split("[")[0].rsplit(".", 1)[-1]
    return _SHORT.sub("_", base)


def _term_id(module: str, op: str, k: int, j: int) -> str:
    head = ".".join(p for p in (module, _short_op(op)) if p)
    return f"{head}{f'#{k}' if k else ''}.{j}"


def inventory_from_saves(storages: list[dict], layers_path: str, num_layers: int, ids: dict | None = None,
                         copies: dict[int, int] | None = None) -> dict:
    """Group saved storages into decoder-layer groups and the outside (the file's body); ``ids``, when
    given, receives each storage's term id by its ``key``; ``copies``: layers not traced -> the traced
    layer whose terms they have (validation/compose.py)."""
    layer_re = re.compile(rf"^{re.escape(layers_path)}\.(\d+)(?:\.(.*))?$")

    def place(module: str) -> tuple[int | None, str]:
        m = layer_re.match(module)
        return (int(m.group(1)), m.group(2) or "") if m else (None, module)

    # (sequence number of the place's first save of the storage, term) per place: a storage
    # shared by the layers sits where each layer saved it
    per_layer: list[list[tuple[int, dict]]] = [[] for _ in range(num_layers)]
    outside: list[tuple[int, dict]] = []
    shared_ids: set[str] = set()
    for st in storages:
        layer, rel = place(st["module"])
        places: dict[int | None, int] = {}
        for module, seq in st["savers"].items():
            p = place(module)[0]
            places[p] = min(places.get(p, seq), seq)
        itemsize = torch.empty((), dtype=st["dtype"]).element_size()
        elements = sympy.expand(st["nbytes"] / itemsize)
        term_id = _term_id(rel, st["op"], st["k"], st["j"])
        if len(places) > 1:
            # a shared storage is one storage for the whole file: its id is unique in the file (Gemma 3's
            # local and global rope tables are saved by the same op of different layers)
            if term_id in shared_ids:
                term_id = f"{term_id}@{layer if layer is not None else 'model'}"
            shared_ids.add(term_id)
        if ids is not None and "key" in st:
            ids[st["key"]] = term_id
        term = {
            "id": term_id,
            "module": rel,
            "op": st["op"],
            "dtype": str(st["dtype"]).replace("torch.", ""),
            "elements": poly_text(elements),
            "bytes": poly_text(st["nbytes"]),
            "shared": len(places) > 1,
        }
        for p, seq in places.items():
            (outside if p is None else per_layer[p]).append((seq, dict(term)))
    groups: list[dict] = []
    index: dict[str, int] = {}
    for i in range(num_layers):
        terms = [t for _, t in sorted(per_layer[(copies or {}).get(i, i)], key=lambda x: x[0])]
        ids = [t["id"] for t in terms]
        dup = [x for x, n in Counter(ids).items() if n > 1]
        if dup:
            raise RuntimeError(f"layer {i}: term ids not unique: {dup}")
        key = json.dumps(terms, sort_keys=True)
        if key not in index:
            index[key] = len(groups)
            groups.append({"layers": [], "terms": terms})
        groups[index[key]]["layers"].append(i)
    return {"num_layers": num_layers, "layer_groups": groups,
            "outside": [t for _, t in sorted(outside, key=lambda x: x[0])]}


def trace_hf_config(config: dict | str | Path, impl: str = "hf-sdpa", kernels: str = "cpu",
                    dtype: str = "bfloat16", s_hint: int = 4096, b_hint: int = 2,
                    python_dispatcher: bool = True, experts: str | None = None, moments: bool = True,
                    compose: bool = True, progress: Callable[[str], None] | None = None,
                    sdpa: tuple[str, ...] = SDPA_ORDER, layer_order: bool = False, steps: dict | None = None) -> dict:
    """The traced inventory of a transformers config: what one training forward + loss saves for
    backward, per decoder-layer group and outside the layers, as polynomials in s and b; with
    ``moments`` also the step's transient tensors (validation/transients.py): the backward run
    under the fake mode, once as is and once with gradient checkpointing.

    Returns the inventory file's data (plain, YAML-serialisable): ``format``, ``origin`` (library
    versions, the config's sha256, architecture, impl, kernels, dtype), ``conditions`` (what the
    polynomials assume about s and b), ``num_layers``, ``layer_groups``, ``outside`` and, with
    ``moments``, ``checkpoint`` (what gradient checkpointing keeps) and ``moments``.

    ``compose``: trace of each kind the first decoder layer and one in the middle, and the model's last two only
    (validation/compose.py ``representatives``), with the embedding,
    head and loss, and give every other layer the terms of its kind (validation/compose.py; False: the whole
    model, the reference the composition is tested against). ``progress`` is told, in one line, what is traced.
    ``sdpa``: with ``kernels="cuda"``, the sdpa kernels tried in order (default torch's on an H100: ``SDPA_ORDER``;
    one name forces that kernel, as ``torch.nn.attention.sdpa_kernel`` does). ``layer_order`` (with ``moments``):
    also ``layer_order``, one layer of each group's allocations and frees in order (validation/layer_order.py), and,
    into ``steps`` when a dict, each run's whole step in order (``layer_order.step_order``) by recompute (none, full).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}")
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}")
    cfg = load_config(config)
    # the key before transformers' config classes normalise the dict in place (a rope_scaling dict gains keys):
    # the key memplan looks a config.json up by (memplan/inventory/traced_file.py config_sha256)
    key = config_sha256(cfg)
    tf = _hf._transformers()
    vocab = int(hf_config(cfg).vocab_size)
    holder: dict = {}

    def build():
        model = build_model(cfg, impl, dtype, experts)
        n = num_hidden_layers(model)
        holder.update(layers=n, path=decoder_layers_path(model, n))
        holder["index"], holder["kinds"] = (compose_.reduce(model, holder["path"], n) if compose
                                            else (list(range(n)), None))
        if progress is not None and not holder.get("told"):
            holder["told"] = True
            kinds = f" ({len(holder['kinds'])} kind{'s' * (len(holder['kinds']) > 1)})" if compose else ""
            progress(f"tracing {cfg['model_type']} ({impl}, {kernels} kernels) with symbolic s and b: "
                     f"{len(holder['index'])} of {n} decoder layers{kinds}, the embedding, head and loss; "
                     f"forward and backward{', then with gradient checkpointing' if moments else ''}")
        return model

    def make_inputs(s, b):
        return torch.randint(0, vocab, (b, s)), torch.randint(0, vocab, (b, s))

    def layers(model):
        return holder["path"], len(holder["index"])

    sampled: list[int] = []  # the checkpointed run samples the layers the plain run chose
    shapes: dict = {}

    def run(checkpoint: bool) -> dict:
        out = symbolic_run(build, _forward_loss, make_inputs, s_hint, b_hint, python_dispatcher, kernels,
                           step={"layers": layers, "checkpoint": checkpoint, "sampled": sampled,
                                 "order": layer_order} if moments else None,
                           shapes=shapes, sdpa=sdpa)
        sampled[:] = out.get("sampled", [])
        return out

    runs = [run(checkpoint) for checkpoint in ((False, True) if moments else (False,))]
    model, storages = runs[0]["model"], runs[0]["storages"]
    conditions = list(dict.fromkeys(c for r in runs for c in r["conditions"]))
    num_layers, path = holder["layers"], holder["path"]
    for r in runs:
        compose_.renumber(r, path, holder["index"])
    same = compose_.copies(holder["kinds"]) if compose else {}
    ids: dict = {}
    body = inventory_from_saves(storages, path, num_layers, ids, same)
    origin = {
        "transformers": tf.__version__,
        "torch": torch.__version__.split("+")[0],
        "config_sha256": key,
        "architecture": type(model).__name__,
        "model_type": cfg["model_type"],
        "impl": impl,
        "kernels": kernels,
        "dtype": dtype,
    }
    data = {"format": FORMAT, "origin": origin, "conditions": conditions, **body}
    if moments:
        data.update(_moments_sections(runs, body, ids, path, num_layers, same,
                                      compose_.stand_ins(holder["kinds"]) if compose else {}))
    if layer_order and moments:
        data["layer_order"] = order_.file_rows(runs, body["layer_groups"], list(holder["index"]), num_layers,
                                                    poly_text, steps)
    return data


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _moments_sections(runs: list[dict], body: dict, ids: dict, path: str, num_layers: int,
                      copies: dict[int, int], stand_ins: dict[int, int]) -> dict:
    """The file's ``checkpoint`` and ``moments`` from the plain run and the checkpointed one; ``stand_ins``
    (validation/compose.py): a layer not traced -> the traced layer whose moments it has, less the kept tensors
    that layers above it are the first to be given."""
    from . import transients

    plain, ckpt = runs
    ckpt_ids: dict = {}
    inventory_from_saves(ckpt["storages"], path, num_layers, ckpt_ids, copies)
    polys = ckpt["polys"]

    def sized(rec, **fields) -> dict:
        e = polys.expr(rec.nbytes)
        return {**fields, "dtype": str(rec.dtype).replace("torch.", ""),
                "elements": poly_text(sympy.expand(e / _itemsize(rec.dtype))), "bytes": poly_text(e)}

    # a tensor every checkpointed layer is given is counted already when the run without checkpointing saves it
    # (a storage several layers save: the rotary tables), matched by argument and first layer
    plain_args = {(label, i): rec for label, i, rec in plain["args"].values()}
    kept = []
    for rec in ckpt["kept"]["extras"]:
        label, i, _ = ckpt["args"][rec.cdata]
        twin = plain_args.get((label, i))
        saved_as = ids.get(twin.key) if twin is not None and twin.bucket == ("shared",) else None
        kept.append(sized(rec, arg=label, layer=i, saved_as=saved_as))
    kept_index = {rec.cdata: k for k, rec in enumerate(ckpt["kept"]["extras"])}
    checkpoint = {"layer_input": sized(ckpt["kept"]["inputs"][0]) if ckpt["kept"]["inputs"] else None, "kept": kept}
    moments = []
    for run, run_ids, recompute in ((plain, ids, "none"), (ckpt, ckpt_ids, "full")):
        fronts = run["sampler"].fronts
        if recompute == "none" and ("last",) in fronts:
            moments += transients.entries(fronts[("last",)], run_ids, run["polys"], poly_text, _itemsize, scope="last")
        for k, group in enumerate(body["layer_groups"]):
            # each sampled layer's own candidates (the ends of a group differ: the top layer's gradient comes
            # from the head, the bottom ones free the checkpoint's tensors they were the last to use); a layer
            # not sampled repeats the second and the second-last sampled ones
            source = {i: i for i in group["layers"] if ("layer", i) in fronts}
            source.update({j: i for j, i in stand_ins.items() if i in source and j in group["layers"]})
            sampled = sorted(source)
            if not sampled:
                continue
            middle = {sampled[1], sampled[-2]} if len(sampled) >= 2 else {sampled[0]}
            rows: dict[str, tuple[dict, set]] = {}
            for i in sampled:
                where = {i} | ({j for j in group["layers"] if j not in sampled} if i in middle else set())
                for row in transients.entries(fronts[("layer", source[i])], run_ids, run["polys"], poly_text,
                                              _itemsize, kept_index if recompute == "full" else None, scope="layer",
                                              group=k, recompute=recompute):
                    if source[i] != i and "kept" in row:  # freed by then: what a layer above i is given first
                        row["kept"] = [x for x in row["kept"] if kept[x]["layer"] <= i]
                    key = json.dumps(row, sort_keys=True)
                    rows.setdefault(key, (row, set()))[1].update(where)
            for row, where in rows.values():
                moments.append({**row, "layers": sorted(where)})
    return {"checkpoint": checkpoint, "moments": moments}


# ---------------------------------------------------------------------------------------------
# measurement with real tensors (the check of a trace)


def measure_hf_config(config: dict | str | Path, s: int, b: int, impl: str = "hf-sdpa", dtype: str = "bfloat16",
                      seed: int = 0, device: str = "cpu") -> dict:
    """What the real model (real tensors on ``device``, random weights) saves for backward at (s, b), in bytes:
    ``layers[i]`` every storage layer i's modules saved (shared ones included), ``outside`` the
    storages saved outside the layers only, ``shared`` the storages saved by more than one layer
    (once), ``total`` every saved non-parameter storage once.  Read off tensors with
    ``validation.measure.Ledger``; nothing here knows the trace."""
    cfg = load_config(config)
    torch.manual_seed(seed)
    model = build_model(cfg, impl, dtype).to(device)
    num_layers = num_hidden_layers(model)
    layer_re = re.compile(rf"^{re.escape(decoder_layers_path(model, num_layers))}\.(\d+)(?:\.|$)")
    modules = _ModuleStack(model, "")
    ops = _OpRecorder()
    ledger = Ledger(list(model.parameters()) + list(model.buffers()), ops, modules)
    savers: dict[StorageWeakRef, set] = {}

    def pack(t):
        key = StorageWeakRef(t.untyped_storage())
        m = layer_re.match(modules.current.lstrip("."))
        savers.setdefault(key, set()).add(int(m.group(1)) if m else None)
        return ledger.pack(t)

    vocab = int(model.config.vocab_size)
    ids = torch.randint(0, vocab, (b, s), device=device)
    targets = torch.randint(0, vocab, (b, s), device=device)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, ledger.unpack), ops:
            loss = _forward_loss(model, ids, targets)
    finally:
        modules.close()
    out = {"layers": [0] * num_layers, "outside": 0, "shared": 0, "total": 0}
    for key, r in ledger.records.items():
        if r.is_param:
            continue
        where = savers[key]
        out["total"] += r.nbytes
        for i in where - {None}:
            out["layers"][i] += r.nbytes
        if where == {None}:
            out["outside"] += r.nbytes
        if len(where) > 1:
            out["shared"] += r.nbytes
    del loss
    return out


def saves_at(config: dict | str | Path, s: int, b: int, impl: str = "hf-sdpa", dtype: str = "bfloat16",
             seed: int = 0) -> dict:
    """The inventory of one real CPU run at (s, b), labelled as a trace is (same ids; every size a
    number): to compare a trace with reality term by term."""
    cfg = load_config(config)
    torch.manual_seed(seed)
    model = build_model(cfg, impl, dtype)
    num_layers = num_hidden_layers(model)
    saves = _Saves(model)
    vocab = int(model.config.vocab_size)
    ids, targets = torch.randint(0, vocab, (b, s)), torch.randint(0, vocab, (b, s))
    with saves.recording():
        loss = _forward_loss(model, ids, targets)
    storages = saves.storages()
    del loss
    for st in storages:
        st["nbytes"] = sympy.Integer(int(st["nbytes"]))
    return inventory_from_saves(storages, decoder_layers_path(model, num_layers), num_layers)


def predicted_bytes(inventory: dict, s: int, b: int) -> dict:
    """The same figures as ``measure_hf_config`` from an inventory file's polynomials."""
    layers = [0] * inventory["num_layers"]
    shared: dict[str, int] = {}
    total = 0
    for g in inventory["layer_groups"]:
        per = sum(evaluate(t["bytes"], s, b) for t in g["terms"])
        own = sum(evaluate(t["bytes"], s, b) for t in g["terms"] if not t["shared"])
        for i in g["layers"]:
            layers[i] = per
        total += own * len(g["layers"])
        for t in g["terms"]:
            if t["shared"]:
                shared[t["id"]] = evaluate(t["bytes"], s, b)
    outside = sum(evaluate(t["bytes"], s, b) for t in inventory["outside"] if not t["shared"])
    for t in inventory["outside"]:
        if t["shared"]:
            shared[t["id"]] = evaluate(t["bytes"], s, b)
    total += outside + sum(shared.values())
    return {"layers": layers, "outside": outside, "shared": sum(shared.values()), "total": total}


# ---------------------------------------------------------------------------------------------
# small configs of every family the tracer is checked on (tests/test_trace.py, memplan validate --hf)

def tiny(model_type: str, **kw) -> dict:
    """A small config.json of a family (h = 64, a = 4, g = 2, f = 160, v = 512, 2 layers)."""
    cfg = {"model_type": model_type, "hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 4096,
           "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}
    cfg.update(kw)
    return cfg


FAMILIES = {
    "qwen2": (tiny("qwen2", tie_word_embeddings=False), "hf-sdpa"),
    "qwen2-eager": (tiny("qwen2", tie_word_embeddings=False), "hf-eager"),
    "qwen3": (tiny("qwen3", head_dim=24, tie_word_embeddings=True), "hf-sdpa"),
    "gemma": (tiny("gemma", head_dim=24), "hf-sdpa"),
    "gemma-eager": (tiny("gemma", head_dim=24), "hf-eager"),
    # Gemma 2 has no sdpa in transformers (logit soft-capping): eager, alternating sliding / global layers
    "gemma2": (tiny("gemma2", head_dim=24, num_hidden_layers=3, sliding_window=16), "hf-eager"),
    # Gemma 3: sliding layers (an explicit mask once s >= the window) beside global ones: two layer groups,
    # each with its own rotary tables (local and global rope bases)
    "gemma3": (tiny("gemma3_text", head_dim=24, num_hidden_layers=4, sliding_window=16, sliding_window_pattern=2),
               "hf-sdpa"),
    "phi3": (tiny("phi3", sliding_window=None), "hf-sdpa"),
    "mistral-window": (tiny("mistral", sliding_window=16), "hf-sdpa"),
    # top-2 of 4 experts, transformers' grouped_mm experts: dropless, k s b tokens through the experts
    "mixtral": (tiny("mixtral", num_local_experts=4, num_experts_per_tok=2, sliding_window=None), "hf-sdpa"),
    # DeepSeek-V3: multi-head latent attention (q / k 24 wide, v 16: CPU sdpa falls back to fp32 math),
    # a dense first layer, then routed (top-2 of 8, grouped) + shared experts
    "deepseek-v3": (tiny("deepseek_v3", num_key_value_heads=4, num_hidden_layers=3, first_k_dense_replace=1,
                         moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                         n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                         qk_nope_head_dim=16, v_head_dim=16, rope_scaling=None), "hf-sdpa"),
}


# ---------------------------------------------------------------------------------------------
# CLI


def to_yaml(data: dict) -> str:
    """The inventory as YAML: keys in the file's order, layer index lists on one line."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def represent_list(dumper, items):
        flow = all(isinstance(x, int) for x in items)
        return dumper.represent_sequence("tag:yaml.org,2002:seq", items, flow_style=flow)

    Dumper.add_representer(list, represent_list)
    return yaml.dump(data, Dumper=Dumper, sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m validation.trace", description=__doc__.split("\n")[0])
    p.add_argument("--hf-config", required=True, help="a transformers config.json")
    p.add_argument("--impl", choices=IMPLS, default="hf-sdpa")
    p.add_argument("--kernels", choices=KERNELS, default="cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--s-hint", type=int, default=4096, help="the sequence length range guards are decided at")
    p.add_argument("--out", help="write the YAML here (default: stdout)")
    p.add_argument("--layer-order", action="store_true",
                   help="also record one layer of each group's allocations and frees in order (layer_order)")
    a = p.parse_args(argv)
    try:
        data = trace_hf_config(a.hf_config, a.impl, a.kernels, a.dtype, s_hint=a.s_hint,
                               progress=lambda line: print(line, file=sys.stderr, flush=True),
                               layer_order=a.layer_order)
    except (NotImplementedError, TraceRefused, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = to_yaml(data)
    if a.out:
        Path(a.out).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
