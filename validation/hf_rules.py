"""How a saved storage of HuggingFace transformers' GPT-2 / Llama code is labelled: the rule tables.

HF code cannot be tagged, so every saved storage is labelled from the context of its *first* save
(recorded by validation/instruments.py's ``_HFLedger``):

* the module path of the op (forward pre/post hooks, ``_ModuleStack``), made relative to the decoder
  layer (``model.layers.<i>.`` / ``transformer.h.<i>.``) or to the model (``split_module``);
* the torch API call that saved it (``_OpRecorder``: a ``TorchFunctionMode``);
* ``k``: the how-many-th call of that op in that module this is (counting only calls that save);
* ``j``: the position of the tensor among the non-parameter tensors that call saved.

``(module, op, k, j)`` pins a tensor's role in a given code path (e.g. the two tensors the first
``torch.matmul`` in ``self_attn`` saves are K, then Q: bmm saves mat2 first), and the tables
``LLAMA_LAYER_RULES`` / ``LLAMA_MODEL_RULES`` / ``GPT2_*`` map it to a stable label.  For
``F.scaled_dot_product_attention`` the op is refined with the aten kernel it reached
(``sdpa[flash_cpu]`` or ``sdpa[math]``), seen by a ``TorchDispatchMode``.
A storage no rule matches is labelled ``"unlabeled"`` (tests demand there are none).

Written against transformers 5.23.0 and torch 2.13.0: the tables follow that code path (see validation/hf.py,
which labels its measurements with them).
"""

from __future__ import annotations

import re

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
