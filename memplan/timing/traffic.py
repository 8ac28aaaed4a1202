"""Bytes the memory-bound kernels of one layer move (LayerBytes, layer_traffic_bytes): Megatron-LM's
fused kernels or PyTorch's eager ops op by op (FUSED_IMPLS says which implementation runs which), and the
per-element constants (dropout masks, fp32 logits and cross-entropy accesses) the layer and LM head use.
layer.py's docstring says how the bytes become seconds."""

from __future__ import annotations

from dataclasses import dataclass

from memplan.core.model import ModelSpec
from memplan.timing.flops import active_ffn_width

# Implementations (memplan impls) whose elementwise work runs in fused kernels (Megatron-LM: fused
# scale-mask-softmax, bias-GeLU / SwiGLU, bias-dropout-add, apex / TE norms); every other one runs
# PyTorch's eager ops, one kernel (one pass over memory) per op (layer_traffic_bytes(fused=False)).
FUSED_IMPLS = ("megatron",)


# --- bytes moved per element by the memory-bound kernels (A = activation bytes) ----------------
MASK_BYTES = 1  # K22 section 4.1: dropout masks are 1 byte


FP32_BYTES = 4  # fp32 logits (cross-entropy) and fp32 main gradients (embedding accumulation)


# Vocabulary-parallel cross-entropy (Megatron-LM _VocabParallelCrossEntropy, one PyTorch op per
# pass), per logit: forward casts to fp32 (read A, write 4), then max (read 4), subtract the max
# (read 4, write 4), exp (read 4, write 4), sum (read 4) and divide (read 4, write 4): 9 fp32
# accesses; backward scales the saved softmax by the incoming gradient (read 4, write 4) and casts
# it back (read 4, write A): 3.
CROSS_ENTROPY_FWD_FP32_ACCESSES = 9


CROSS_ENTROPY_BWD_FP32_ACCESSES = 3


@dataclass(frozen=True)
class LayerBytes:
    """Memory-bound bytes of one layer for one sequence (no t split), forward and backward."""

    replicated_fwd: float  # norms, bias-dropout-residual adds (split by t only under SP)
    replicated_bwd: float
    tp_fwd: float  # softmax, attention dropout, activation function, rotary (split by t)
    tp_bwd: float
    attention_core_fwd: float  # softmax + attention dropout: what selective recompute re-runs


def layer_traffic_bytes(model: ModelSpec, activation_bytes: int = 2, fused: bool = True) -> LayerBytes:
    """Bytes the memory-bound kernels of one layer move for one sequence. `fused`: Megatron-LM's
    kernels (fused scale-mask-softmax, bias-GeLU, bias-dropout-add); otherwise PyTorch's eager ops,
    one pass over memory per op, as the reference torch layer (validation/layers.py) and
    transformers run them (bias adds ride in the GEMM epilogue either way)."""
    if not fused:
        return _eager_traffic_bytes(model, activation_bytes)
    A = activation_bytes
    s, h, f, a = (float(x) for x in (model.seq_length, model.hidden_size, active_ffn_width(model),
                                     model.num_attention_heads))
    sh, scores, sf = s * h, a * s * s, s * f
    drop = 1 if model.dropout else 0
    # Two norms (read + write), two residual adds (read 2, write 1), two dropout masks written.
    rep_fwd = (2 * 2 * A + 2 * 3 * A + 2 * drop * MASK_BYTES) * sh
    # Norm backward (read x and dy, write dx), dropout backward (read dy and the mask, write dx),
    # and the sum of residual and branch gradients at each sub-layer's input (read 2, write 1).
    rep_bwd = (2 * 3 * A + 2 * drop * (2 * A + MASK_BYTES) + 2 * 3 * A) * sh
    softmax_fwd, softmax_bwd = 2 * A * scores, 3 * A * scores  # fused scale-mask-softmax
    dropout = drop * (2 * A + MASK_BYTES) * scores  # forward writes the mask, backward reads it
    if model.attention == "flash":  # the scores never leave the chip (FlashAttention, Dao 2022)
        softmax_fwd = softmax_bwd = dropout = 0.0
    if model.mlp == "swiglu":  # read gate and up, write the product; backward reads 3, writes 2
        act_fwd, act_bwd = 3 * A * sf, 5 * A * sf
    else:  # fused bias-GeLU: read, write; backward reads input and dy, writes dx
        act_fwd, act_bwd = 2 * A * sf, 3 * A * sf
    rope = 0.0
    if model.position_embedding == "rope":  # rotate Q and K (read + write), in both passes
        rope = 2 * A * s * model.q * (1 + model.g / model.num_attention_heads)
    return LayerBytes(
        replicated_fwd=rep_fwd,
        replicated_bwd=rep_bwd,
        tp_fwd=softmax_fwd + dropout + act_fwd + rope,
        tp_bwd=softmax_bwd + dropout + act_bwd + rope,
        attention_core_fwd=softmax_fwd + dropout,
    )


def _eager_traffic_bytes(model: ModelSpec, A: int) -> LayerBytes:
    """PyTorch eager ops, per element of the tensor each op streams (read + write bytes), counted op
    by op on the reference layer (validation/layers.py: attention_core, ParallelAttention, GPTLayer)
    and autograd's backward of each op. Per token and hidden unit (sh) unless named:

    forward: LayerNorm read + write 2A, each; Q, K, V made contiguous from the fused QKV output
    2A(1 + 2g/a); the context transposed back 2A; dropout read + write + mask 2A + 1 and the
    residual add (read 2, write 1) 3A after each sub-layer; per score (as^2): scale 2A, causal
    masked_fill 2A, softmax 2A, dropout 2A + 1 (the QK^T output and attention-over-V input belong
    to the batched matmuls' time); per MLP element (sf): GeLU 2A (SwiGLU: SiLU 2A, product 3A).
    backward: the gradient sum at each residual 3A, dropout 2A + 1, LayerNorm dx (read x, dy,
    write) and its weight gradients (read x, dy) 5A, bias gradients (read dy) A per output element,
    the transposed context 2A, and the QKV split: each of Q, K, V's select-backward zero-fills a
    QKV-sized gradient and copies its slice, and autograd sums the three, 11A(1 + 2g/a); per score
    dropout 2A + 1, softmax 3A, masked_fill 2A, scale 2A; GeLU 3A per sf (SwiGLU 9A).
    RMSNorm (transformers' LlamaRMSNorm): fp32 upcast, square, mean, scale, downcast, weight:
    4A + 28 forward, twice that backward. RoPE (transformers' apply_rotary_pos_emb: two products,
    rotate_half, a sum) 9A per element of Q and K, in both passes.

    The K22 layer, A = 2: forward 46sh + 17as^2 + 4sf, backward 122sh + 19as^2 + 8sf bytes."""
    s, h, f, a = (float(x) for x in (model.seq_length, model.hidden_size, active_ffn_width(model),
                                     model.num_attention_heads))
    sh, scores, sf = s * h, a * s * s, s * f
    drop = 1 if model.dropout else 0
    wq = model.q / h  # the attention width in units of h
    qkv = wq * (1 + 2 * model.g / model.num_attention_heads)  # the QKV output in units of h
    if model.norm == "layernorm":
        norm_fwd, norm_bwd = 2 * A, 5 * A
    else:
        norm_fwd = 4 * A + 7 * FP32_BYTES
        norm_bwd = 2 * norm_fwd
    bias = 1 if model.bias else 0
    mlp_in = 2 if model.mlp == "swiglu" else 1  # fc1 output width in units of f
    rep_fwd = (2 * norm_fwd + 2 * drop * (2 * A + MASK_BYTES) + 2 * 3 * A) * sh
    rep_bwd = (2 * 3 * A + 2 * drop * (2 * A + MASK_BYTES) + 2 * norm_bwd + bias * 2 * A) * sh
    core_fwd = (3 * 2 * A + drop * (2 * A + MASK_BYTES)) * scores
    core_bwd = (3 * A + 2 * 2 * A + drop * (2 * A + MASK_BYTES)) * scores
    if model.attention == "flash":
        core_fwd = core_bwd = 0.0
    if model.mlp == "swiglu":
        act_fwd, act_bwd = 5 * A * sf, 9 * A * sf
    else:
        act_fwd, act_bwd = 2 * A * sf, 3 * A * sf
    rope = 9 * A * sh * wq * (1 + model.g / model.num_attention_heads) if model.position_embedding == "rope" else 0.0
    split_fwd, split_bwd = 2 * A * qkv * sh, 11 * A * qkv * sh
    context = 2 * A * wq * sh
    return LayerBytes(
        replicated_fwd=rep_fwd,
        replicated_bwd=rep_bwd,
        tp_fwd=split_fwd + context + core_fwd + act_fwd + rope,
        tp_bwd=split_bwd + context + core_bwd + act_bwd + rope + bias * A * (qkv * sh + mlp_in * sf),
        attention_core_fwd=core_fwd,
    )
