"""What HuggingFace transformers' real GPT-2 and Llama code saves for backward, labelled.

The models are built from a config (``AutoModelForCausalLM.from_config``: no weights, no network;
``HF_HUB_OFFLINE=1`` is set before transformers is imported), in bf16, in training mode, on CPU
(or under ``FakeTensorMode``), and measured with the saved-tensor ledger and the live-storage
tracker of ``validation.measure``.

HF code cannot be tagged, so every saved storage is labelled from the context of its *first* save:

* the module path of the op (forward pre/post hooks, ``_ModuleStack``), made relative to the decoder
  layer (``model.layers.<i>.`` / ``transformer.h.<i>.``) or to the model;
* the torch API call that saved it (``_OpRecorder``: a ``TorchFunctionMode``);
* ``k``: the how-many-th call of that op in that module this is (counting only calls that save);
* ``j``: the position of the tensor among the non-parameter tensors that call saved.

``(module, op, k, j)`` pins a tensor's role in a given code path (e.g. the two tensors the first
``torch.matmul`` in ``self_attn`` saves are K, then Q: bmm saves mat2 first), and the tables
``LLAMA_LAYER_RULES`` / ``LLAMA_MODEL_RULES`` / ``GPT2_*`` map it to a stable label.  For
``F.scaled_dot_product_attention`` the op is refined with the aten kernel it reached
(``sdpa[flash_cpu]`` or ``sdpa[math]``), seen by a ``TorchDispatchMode``.
A storage no rule matches is labelled ``"unlabeled"`` (tests demand there are none).

Scopes:

* ``"layer"``: one decoder layer (``model.model.layers[0]`` / ``model.transformer.h[0]``) run on
  its own, with the inputs the model would give it built *inside* the measured window by the
  model's own code (embedding under ``no_grad`` then made a leaf that requires grad, rotary
  cos/sin, ``create_causal_mask``).  So the live tracker sees exactly one layer, and tensors the
  model shares between layers (rope cos/sin) are counted in the layer, as the reference harness
  counts its causal mask.  ``HFMeasurement.per_layer`` of a model run gives the same dictionaries
  (tests check it).  One artefact of running a layer alone: its input is a leaf, and a leaf that
  requires grad stays alive with the graph (its AccumulateGrad node holds it) even when nothing
  saves it, as in Llama, whose RMSNorm saves an fp32 copy instead.  So for Llama the live
  tracker's retained bytes are saved + loss + the input (2sbh); inside a model the input of a
  layer is an ordinary activation and is freed.
* ``"model"``: ``model(input_ids, labels=targets, use_cache=False).loss``; every storage once, so
  the shared cos/sin appear once.  ``per_layer[i]`` lists what layer ``i``'s modules saved
  (shared storages in every layer that saved them; their labels are in ``shared_labels``).

Written against transformers 5.23.0 and torch 2.13.0: the (module, op, k, j) tables follow that
code path; another version that saves differently shows up as ``"unlabeled"`` entries or a failing
hand derivation in tests/validation/test_hf.py.  CPU facts the tables encode: ``F.dropout`` saves a
bf16 bernoulli mask (not native_dropout's bool); sdpa with dropout 0 and no mask reaches
``_scaled_dot_product_flash_attention_for_cpu`` (saves q, k, v, output, fp32 logsumexp), with
dropout > 0 it falls back to the math path, which computes in fp32.  CUDA is not supported here.

Nothing here computes a byte count from a formula; every number is read off a tensor.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

# Nothing here may touch the network (from_config needs no download anyway): set before
# transformers / huggingface_hub are imported, which read these at import time.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"

import torch  # noqa: E402
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402
from torch.overrides import resolve_name  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from .measure import (  # noqa: E402
    Case, Ledger, LiveTracker, Measurement, SavedEntry, _ModuleStack, _OpRecorder, _Record,
)
from .tags import PARAMETER, UNLABELED  # noqa: E402

Arch = Literal["gpt2", "llama"]
Attn = Literal["eager", "sdpa"]
HF_BACKENDS = ("ledger", "live", "fake")

# ---------------------------------------------------------------------------------------------
# label rules: (module relative to the layer / model, op, k-th saving call, j-th saved tensor)

SDPA = "torch.nn.functional.scaled_dot_product_attention"
FLASH = SDPA + "[flash_cpu]"
MATH = SDPA + "[math]"
MATMUL, MUL, LINEAR, ADDMM = "torch.matmul", "torch.Tensor.mul", "torch.nn.functional.linear", "torch.addmm"
DROPOUT, SOFTMAX = "torch.nn.functional.dropout", "torch.nn.functional.softmax"
LAYER_NORM = "torch.nn.functional.layer_norm"
EMBEDDING, CROSS_ENTROPY = "torch.nn.functional.embedding", "torch.nn.functional.cross_entropy"


# sdpa's math fallback (_scaled_dot_product_attention_math; on CPU it runs when dropout > 0) upcasts
# bf16 inputs to fp32 and then does what eager does: matmul(q*sqrt(scale), k^T*sqrt(scale)),
# softmax, dropout (bernoulli mask in fp32), matmul(attn, v): everything it saves is fp32.
_MATH_LABELS = ("k", "q", "softmax_out", "softmax_dropout_mask", "v", "attn_probs")


def _rmsnorm_rules(module: str, prefix: str) -> dict:
    """LlamaRMSNorm: x.to(fp32); pow(2) saves the fp32 x; rsqrt saves its result;
    x * rstd (call 0 of mul) saves both again; weight * normed.to(bf16) (call 1) saves the bf16 normed."""
    return {
        (module, "torch.Tensor.pow", 0, 0): f"{prefix}_fp32_input",
        (module, "torch.rsqrt", 0, 0): f"{prefix}_rstd",
        (module, MUL, 1, 0): f"{prefix}_normed",
    }


LLAMA_LAYER_RULES: dict[tuple[str, str, int, int], str] = {
    **_rmsnorm_rules("input_layernorm", "ln1"),
    ("self_attn.q_proj", LINEAR, 0, 0): "qkv_input",  # the one storage q/k/v_proj all read
    # apply_rotary_pos_emb: q * cos saves cos, rotate_half(q) * sin saves sin (q and k are
    # not saved there: cos / sin do not require grad); the same two storages for every layer
    ("self_attn", MUL, 0, 0): "rope_cos",
    ("self_attn", MUL, 1, 0): "rope_sin",
    # eager_attention_forward
    # (bmm saves mat2 first, then self)
    ("self_attn", MATMUL, 0, 0): "k",  # k after rope and repeat_kv, [b*a, d, s]
    ("self_attn", MATMUL, 0, 1): "q",  # q after rope, copied to [b*a, s, d] by matmul's reshape
    ("self_attn", SOFTMAX, 0, 0): "softmax_out",  # softmax(dtype=float32): fp32 [b, a, s, s]
    ("self_attn", DROPOUT, 0, 0): "softmax_dropout_mask",
    ("self_attn", MATMUL, 1, 0): "v",  # v after repeat_kv, [b*a, s, d]
    ("self_attn", MATMUL, 1, 1): "attn_probs",  # softmax out .to(bf16) (p = 0) / dropout out
    # sdpa, CPU flash kernel (aten._scaled_dot_product_flash_attention_for_cpu); it saves
    # key, query, value, logsumexp, output in this order
    ("self_attn", FLASH, 0, 0): "k",  # [b, g, s, d]: enable_gqa=True, no repeat
    ("self_attn", FLASH, 0, 1): "q",
    ("self_attn", FLASH, 0, 2): "v",
    ("self_attn", FLASH, 0, 3): "sdpa_logsumexp",  # fp32 [b, a, s]
    ("self_attn", FLASH, 0, 4): "attn_out",  # the kernel's output = o_proj input (one storage)
    # sdpa, math fallback (dropout > 0): fp32; k and v repeated to a heads (enable_gqa in math)
    **{("self_attn", MATH, 0, j): lab for j, lab in enumerate(_MATH_LABELS)},
    ("self_attn.o_proj", LINEAR, 0, 0): "attn_out",  # eager / math: the merged-heads context
    **_rmsnorm_rules("post_attention_layernorm", "ln2"),
    ("mlp.gate_proj", LINEAR, 0, 0): "mlp_input",  # = up_proj input
    ("mlp.act_fn", "torch.nn.functional.silu", 0, 0): "silu_input",  # gate_proj output
    ("mlp", MUL, 0, 0): "up_out",  # act(gate) * up saves up (for d/d act) ...
    ("mlp", MUL, 0, 1): "silu_out",  # ... and act(gate) (for d/d up)
    ("mlp.down_proj", LINEAR, 0, 0): "fc2_input",  # act(gate) * up
}

LLAMA_MODEL_RULES: dict[tuple[str, str, int, int], str] = {
    ("model.embed_tokens", EMBEDDING, 0, 0): "token_ids",
    **_rmsnorm_rules("model.norm", "final_norm"),
    ("lm_head", LINEAR, 0, 0): "head_input",
    # ForCausalLMLoss: logits.float() -> F.cross_entropy = log_softmax (saves its fp32 output)
    # + nll_loss (saves the shifted int64 targets and the fp32 total_weight scalar)
    ("", CROSS_ENTROPY, 0, 0): "logits_fp32",
    ("", CROSS_ENTROPY, 0, 2): "target_ids",  # (j = 1 is nll_loss saving the log_softmax again)
    ("", CROSS_ENTROPY, 0, 3): "nll_total_weight",
}

GPT2_LAYER_RULES: dict[tuple[str, str, int, int], str] = {
    # nn.LayerNorm -> native_layer_norm saves input, mean, rstd (mean / rstd bf16 [b, s, 1] on CPU)
    ("ln_1", LAYER_NORM, 0, 0): "ln1_input",
    ("ln_1", LAYER_NORM, 0, 1): "ln1_stats",
    ("ln_1", LAYER_NORM, 0, 2): "ln1_stats",
    ("attn.c_attn", ADDMM, 0, 0): "qkv_input",  # Conv1D: addmm(bias, x.view(-1, h), W)
    # eager_attention_forward: q, k, v are strided views of the c_attn output; matmul copies them
    ("attn", MATMUL, 0, 0): "k",  # [b*a, d, s] (bmm saves mat2, then self)
    ("attn", MATMUL, 0, 1): "q",  # [b*a, s, d]
    ("attn", SOFTMAX, 0, 0): "softmax_out",  # bf16 [b, a, s, s]
    ("attn", DROPOUT, 0, 0): "softmax_dropout_mask",
    ("attn", MATMUL, 1, 0): "v",
    ("attn", MATMUL, 1, 1): "attn_probs",  # dropout output (p > 0; at p = 0 it is softmax_out)
    # sdpa, CPU flash kernel (dropout 0): saves key, query, value, logsumexp, output; q, k, v
    # are views of ONE storage, the c_attn output [b, s, 3h]
    ("attn", FLASH, 0, 0): "qkv",
    ("attn", FLASH, 0, 3): "sdpa_logsumexp",
    ("attn", FLASH, 0, 4): "attn_out",  # = c_proj input (one storage)
    **{("attn", MATH, 0, j): lab for j, lab in enumerate(_MATH_LABELS)},
    ("attn.c_proj", ADDMM, 0, 0): "attn_out",  # eager / math: the merged-heads context
    ("attn.resid_dropout", DROPOUT, 0, 0): "attn_dropout_mask",
    ("ln_2", LAYER_NORM, 0, 0): "ln2_input",
    ("ln_2", LAYER_NORM, 0, 1): "ln2_stats",
    ("ln_2", LAYER_NORM, 0, 2): "ln2_stats",
    ("mlp.c_fc", ADDMM, 0, 0): "mlp_input",
    # NewGELUActivation: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))
    ("mlp.act", "torch.pow", 0, 0): "gelu_input",  # x (c_fc output), kept by pow
    ("mlp.act", "torch.tanh", 0, 0): "gelu_tanh_out",  # tanh keeps its result
    ("mlp.act", MUL, 0, 0): "gelu_one_plus_tanh",  # (0.5 * x) * (1 + tanh) keeps both factors
    ("mlp.act", MUL, 0, 1): "gelu_half_x",
    ("mlp.c_proj", ADDMM, 0, 0): "fc2_input",  # the GeLU output
    ("mlp.dropout", DROPOUT, 0, 0): "mlp_dropout_mask",
}

GPT2_MODEL_RULES: dict[tuple[str, str, int, int], str] = {
    ("transformer.wte", EMBEDDING, 0, 0): "token_ids",
    ("transformer.wpe", EMBEDDING, 0, 0): "position_ids",  # arange(s).unsqueeze(0): [1, s]
    ("transformer.drop", DROPOUT, 0, 0): "embedding_dropout_mask",
    ("transformer.ln_f", LAYER_NORM, 0, 0): "final_ln_input",
    ("transformer.ln_f", LAYER_NORM, 0, 1): "final_ln_stats",
    ("transformer.ln_f", LAYER_NORM, 0, 2): "final_ln_stats",
    ("lm_head", LINEAR, 0, 0): "head_input",  # = ln_f output
    ("", CROSS_ENTROPY, 0, 0): "logits_fp32",
    ("", CROSS_ENTROPY, 0, 2): "target_ids",
    ("", CROSS_ENTROPY, 0, 3): "nll_total_weight",
}

# peft LoRA (peft 0.21.2, lora.Linear.forward): x cast to the adapters' dtype, dropout (nn.Identity at p = 0),
# lora_A saves its input (the cast x, or the dropout output), lora_B saves A's output; the frozen base linear
# saves nothing for its weight. Labels lora_<module>_{mask,input,a_out} (memplan/inventory/lora.py).
LORA_MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
for _name, _parent in LORA_MODULES.items():
    _path = f"{_parent}.{_name}"
    LLAMA_LAYER_RULES[(f"{_path}.lora_dropout.default", DROPOUT, 0, 0)] = f"lora_{_name}_mask"
    LLAMA_LAYER_RULES[(f"{_path}.lora_A.default", LINEAR, 0, 0)] = f"lora_{_name}_input"
    LLAMA_LAYER_RULES[(f"{_path}.lora_B.default", LINEAR, 0, 0)] = f"lora_{_name}_a_out"

RULES = {
    "llama": (LLAMA_LAYER_RULES, LLAMA_MODEL_RULES),
    "gpt2": (GPT2_LAYER_RULES, GPT2_MODEL_RULES),
}
HF_LAYER_LABELS = {arch: tuple(dict.fromkeys(r[0].values())) for arch, r in RULES.items()}
HF_MODEL_LABELS = {arch: tuple(dict.fromkeys(r[1].values())) for arch, r in RULES.items()}
SHARED_LABELS = {"llama": ("rope_cos", "rope_sin"), "gpt2": ()}

_LAYER_RE = re.compile(r"^(?:model\.layers|transformer\.h)\.(\d+)(?:\.(.*))?$")


def split_module(path: str) -> tuple[int | None, str]:
    """``"model.layers.3.self_attn.q_proj"`` -> ``(3, "self_attn.q_proj")``; model-level -> (None, path)."""
    m = _LAYER_RE.match(path)
    if m:
        return int(m.group(1)), m.group(2) or ""
    return None, path


# ---------------------------------------------------------------------------------------------
# the case


@dataclass(frozen=True)
class HFCase(Case):
    """A ``Case`` plus the HF model: ``arch``, ``attn`` and ``g`` (Llama KV heads; None = a).
    ``p_drop`` is every dropout probability of the config (GPT-2: attn / resid / embd; Llama:
    attention_dropout).  ``f`` None means 4h (GPT-2 ``n_inner``, Llama ``intermediate_size``)."""

    arch: str = "llama"
    attn: str = "sdpa"
    g: int | None = None
    head_dim: int | None = None  # Llama: width of one head (None = h/a)
    lora_r: int = 0  # peft LoRA rank (0: none); the base model frozen by peft
    lora_p: float = 0.0  # LoRA dropout
    lora_targets: tuple[str, ...] = ()  # target modules (empty: peft's default for the family)

    @property
    def kv_heads(self) -> int:
        return self.a if self.g is None else self.g

    def check(self) -> None:
        super().check()
        if self.arch not in RULES:
            raise ValueError(f"arch must be one of {tuple(RULES)}")
        if self.attn not in ("eager", "sdpa"):
            raise ValueError("attn must be 'eager' or 'sdpa'")
        if self.backend not in HF_BACKENDS:
            raise ValueError(f"HF measurements support backends {HF_BACKENDS}")
        if self.t != 1 or self.sp or self.recompute != "none":
            raise ValueError("HF measurements are single-rank, no recompute")
        if self.arch == "gpt2" and self.g is not None and self.g != self.a:
            raise ValueError("GPT-2 has no grouped-query attention")
        if self.arch == "gpt2" and self.head_dim is not None:
            raise ValueError("GPT-2 heads are h/a wide")
        if self.lora_r and self.arch != "llama":
            raise ValueError("LoRA measurements are for the Llama layout")
        if (self.h % self.a and self.head_dim is None) or self.a % self.kv_heads:
            raise ValueError("need a | h (or a head_dim) and g | a")


@dataclass
class HFMeasurement(Measurement):
    """``Measurement`` plus where each entry came from (same order as ``entries``)."""

    contexts: list[tuple[str, str, int, int]] = field(default_factory=list)  # (module, op, k, j)
    producers: list[str] = field(default_factory=list)  # "module:op" that created the storage
    savers: list[list[str]] = field(default_factory=list)  # every module that saved it
    per_layer: list[dict[str, int]] = field(default_factory=list)  # model scope: by layer
    shared_labels: tuple[str, ...] = ()  # labels of storages saved by more than one layer
    kernels: dict[str, list[str]] = field(default_factory=dict)  # torch op -> aten ops of interest


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


# ---------------------------------------------------------------------------------------------
# building and running the models


def _transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def build_config(case: HFCase):
    tf = _transformers()
    f = case.ffn
    if case.arch == "gpt2":
        cfg = tf.GPT2Config(
            n_embd=case.h, n_head=case.a, n_layer=case.L, n_positions=case.s, vocab_size=case.v, n_inner=f,
            resid_pdrop=case.p_drop, embd_pdrop=case.p_drop, attn_pdrop=case.p_drop,
            bos_token_id=0, eos_token_id=0,
        )
    else:
        cfg = tf.LlamaConfig(
            hidden_size=case.h, intermediate_size=f, num_attention_heads=case.a,
            num_key_value_heads=case.kv_heads, num_hidden_layers=case.L, vocab_size=case.v,
            max_position_embeddings=case.s, tie_word_embeddings=False, attention_dropout=case.p_drop,
            bos_token_id=0, eos_token_id=0, **({"head_dim": case.head_dim} if case.head_dim else {}),
        )
    cfg.loss_type = "ForCausalLM"
    return cfg


def build_model(case: HFCase):
    tf = _transformers()
    model = tf.AutoModelForCausalLM.from_config(
        build_config(case), dtype=getattr(torch, case.dtype), attn_implementation=case.attn)
    if case.lora_r:
        import peft

        # get_peft_model injects the adapters into `model` in place and freezes its own parameters; the
        # adapters are fp32 (autocast_adapter_dtype=True, peft's default, upcasts bf16 adapters)
        peft.get_peft_model(model, peft.LoraConfig(r=case.lora_r, lora_alpha=2 * case.lora_r, lora_dropout=case.lora_p,
                                                   target_modules=list(case.lora_targets) or None))
    return model.train()


def _base(model):
    return model.model if hasattr(model, "model") else model.transformer


def _decoder_layer(model):
    base = _base(model)
    return base.layers[0] if hasattr(base, "layers") else base.h[0]


def _layer_path(case: HFCase) -> str:
    return "model.layers.0" if case.arch == "llama" else "transformer.h.0"


def _forward_fresh(model, case: HFCase, scope: str) -> torch.Tensor:
    """This step's inputs are created here and die on return unless autograd saved them."""
    ids = torch.randint(0, case.v, (case.b, case.s))
    if scope == "model":
        targets = torch.randint(0, case.v, (case.b, case.s))
        return model(input_ids=ids, labels=targets, use_cache=False).loss
    from transformers.masking_utils import create_causal_mask

    base, layer = _base(model), _decoder_layer(model)
    pos = torch.arange(case.s).unsqueeze(0)  # what LlamaModel / GPT2Model build when given none
    with torch.no_grad():
        emb = base.embed_tokens(ids) if case.arch == "llama" else base.wte(ids) + base.wpe(pos)
    hidden = emb.detach().requires_grad_()
    mask = create_causal_mask(config=model.config, inputs_embeds=hidden, attention_mask=None,
                              past_key_values=None, position_ids=pos)
    if case.arch == "llama":
        cos_sin = base.rotary_emb(hidden, position_ids=pos)
        out = layer(hidden, attention_mask=mask, position_embeddings=cos_sin, position_ids=pos, use_cache=False)
    else:
        out = layer(hidden, None, mask, use_cache=False, position_ids=pos)
    return out.sum()


@contextlib.contextmanager
def _fake_mode(enabled: bool):
    """FakeTensorMode, and one HF decision that reads tensor *values*, replayed.

    ``masking_utils.find_packed_sequence_indices`` looks at position_ids to detect packed
    sequences; with fake tensors it cannot read them and answers "packed", which materialises
    a mask that real runs never build (sdpa would then get an attn_mask instead of
    is_causal=True).  Our position ids are always ``arange(s)``: a real run returns None (not
    packed), so the fake run is told the same.  Tests check fake == real at small shapes.
    """
    if not enabled:
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensorMode
    import transformers.masking_utils as mu

    orig = mu.find_packed_sequence_indices
    mu.find_packed_sequence_indices = lambda position_ids: None
    try:
        with FakeTensorMode(allow_non_fake_inputs=False):
            yield
    finally:
        mu.find_packed_sequence_indices = orig


def _measure(case: HFCase, scope: str) -> HFMeasurement:
    case.check()
    if scope not in ("layer", "model"):
        raise ValueError("scope must be 'layer' or 'model'")
    with _fake_mode(case.backend == "fake"):
        torch.manual_seed(case.seed)
        model = build_model(case)
        if case.backend == "live":  # warm-up: lazy initialisation outside the window
            _forward_fresh(model, case, scope).backward()
            model.zero_grad(set_to_none=True)
            gc.collect()
        return _measure_step(model, case, scope)


def _measure_step(model, case: HFCase, scope: str) -> HFMeasurement:
    root = model if scope == "model" else _decoder_layer(model)
    modules = _ModuleStack(root, "" if scope == "model" else _layer_path(case))
    rec = _CallRecorder(modules)
    ledger = _HFLedger(list(model.parameters()), rec, modules)
    aten = _AtenLog(rec)
    tracker = LiveTracker() if case.backend in ("live", "fake") else None
    try:
        with (tracker or contextlib.nullcontext()):
            with torch.autograd.graph.saved_tensors_hooks(ledger.pack, ledger.unpack), rec, aten:
                loss = _forward_fresh(model, case, scope)
            retained = tracker.live if tracker else None
            loss_bytes = loss.untyped_storage().nbytes()
            loss.backward()
            del loss
            peak = tracker.peak if tracker else None
    finally:
        modules.close()
    return _collect(case, scope, ledger, rec, aten, retained, peak, loss_bytes)


def _collect(case, scope, ledger: _HFLedger, rec, aten, retained, peak, loss_bytes) -> HFMeasurement:
    layer_rules, model_rules = RULES[case.arch]
    acts, params = [], []
    for key, r in ledger.records.items():
        module, op, k, j, call = ledger.ctx[key]
        module = module.lstrip(".")
        if op == SDPA:
            op = f"{SDPA}[{aten.kernel_tag(call)}]"
        layer, rel = split_module(module)
        rules = layer_rules if layer is not None else model_rules
        label = PARAMETER if r.is_param else rules.get((rel, op, k, j), UNLABELED)
        entry = SavedEntry(label, r.shape, r.dtype, r.nbytes, " + ".join(r.ops), module)
        item = (entry, (rel if layer is None else f"<layer>.{rel}".rstrip("."), op, k, j),
                rec.producers.get(key, "-").lstrip("."), [m.lstrip(".") for m in ledger.savers[key]])
        (params if r.is_param else acts).append(item)
    items = acts + params
    entries = [i[0] for i in items]
    by_label: dict[str, int] = {}
    for e in entries:
        if e.label != PARAMETER:
            by_label[e.label] = by_label.get(e.label, 0) + e.bytes
    per_layer: list[dict[str, int]] = []
    shared: list[str] = []
    if scope == "model":
        per_layer = [{} for _ in range(case.L)]
        for e, _, _, savers in acts:
            layers = sorted({split_module(m)[0] for m in savers} - {None})
            for i in layers:
                per_layer[i][e.label] = per_layer[i].get(e.label, 0) + e.bytes
            if len(layers) > 1 and e.label not in shared:
                shared.append(e.label)
    kernels: dict[str, list[str]] = {}
    for call, names in aten.by_call.items():
        op = aten.op_of_call[call]
        lst = kernels.setdefault(op, [])
        tag = [f"<{aten.kernel_tag(call)}>"] if op == SDPA else []
        for n in names + tag:
            if n not in lst:
                lst.append(n)
    return HFMeasurement(
        case=case,
        scope=scope,
        saved_bytes_by_label=by_label,
        entries=entries,
        saved_bytes_total=sum(by_label.values()),
        retained_after_forward_bytes=retained,
        peak_bytes=peak,
        loss_bytes=loss_bytes,
        saved_parameter_bytes=sum(e.bytes for e in entries if e.label == PARAMETER),
        notes=[f"{case.arch} attn={case.attn} g={case.kv_heads} transformers={_transformers().__version__}"],
        contexts=[i[1] for i in items],
        producers=[i[2] for i in items],
        savers=[i[3] for i in items],
        per_layer=per_layer,
        shared_labels=tuple(shared),
        kernels=kernels,
    )


# ---------------------------------------------------------------------------------------------
# public API


def measure_hf(
    arch: Arch,
    attn: Attn,
    s: int,
    b: int,
    h: int,
    a: int,
    f: int | None = None,
    g: int | None = None,
    head_dim: int | None = None,
    v: int = 512,
    L: int = 1,
    dropout: float = 0.0,
    scope: Literal["layer", "model"] = "layer",
    backend: Literal["ledger", "live", "fake"] = "ledger",
    seed: int = 0,
    lora: tuple[int, float, tuple[str, ...]] = (0, 0.0, ()),
) -> HFMeasurement:
    """Saved tensors of one decoder layer (``scope="layer"``) or of the whole ``*ForCausalLM``
    (``scope="model"``, loss included) of HF ``arch`` with ``attn_implementation=attn``, bf16,
    training mode, CPU (``backend="fake"``: FakeTensorMode, nothing allocated)."""
    case = HFCase(s=s, b=b, h=h, a=a, f=f, v=v, L=L, p_drop=dropout, backend=backend, seed=seed,
                  arch=arch, attn=attn, g=g, head_dim=head_dim, lora_r=lora[0], lora_p=lora[1], lora_targets=lora[2])
    return _measure(case, scope)


def format_table(m: HFMeasurement) -> str:
    rows = [("label", "shape", "dtype", "bytes", "saved by", "context (module, op, k, j)", "producer")]
    for e, ctx, prod in zip(m.entries, m.contexts, m.producers):
        if e.label == PARAMETER:
            continue
        rows.append((e.label, "x".join(map(str, e.shape)), e.dtype, str(e.bytes), f"{e.module}: {e.op}",
                     f"{ctx[0]} | {ctx[1]} | {ctx[2]} | {ctx[3]}", prod))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.append(f"saved total {m.saved_bytes_total:,}  retained {m.retained_after_forward_bytes}  "
                 f"peak {m.peak_bytes}  loss {m.loss_bytes}")
    lines.append(f"kernels: {m.kernels}")
    if m.shared_labels:
        lines.append(f"shared by layers: {m.shared_labels}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m validation.hf", description=__doc__.split("\n")[0])
    p.add_argument("--arch", choices=tuple(RULES), default="llama")
    p.add_argument("--attn", choices=("eager", "sdpa"), default="sdpa")
    p.add_argument("--scope", choices=("layer", "model"), default="layer")
    p.add_argument("--backend", choices=HF_BACKENDS, default="live")
    for name, default in (("s", 32), ("b", 2), ("h", 64), ("a", 4), ("v", 256), ("L", 1)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--f", type=int, default=None)
    p.add_argument("--g", type=int, default=None)
    p.add_argument("--dropout", type=float, default=0.0)
    a = p.parse_args(argv)
    m = measure_hf(a.arch, a.attn, a.s, a.b, a.h, a.a, a.f, a.g, a.v, a.L, a.dropout, a.scope, a.backend)
    print(m.notes[0], m.scope)
    print(format_table(m))


if __name__ == "__main__":
    main()
