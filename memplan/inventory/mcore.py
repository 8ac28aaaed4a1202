"""`--impl megatron-local`: megatron-core's local spec (`get_gpt_layer_local_spec`), as data.

megatron-core 0.16.1 built only from its own modules (ColumnParallelLinear / RowParallelLinear,
the unfused DotProductAttention, torch LayerNorm / RMSNorm, its MLP), as Megatron-LM's
`--transformer-impl local` runs it with Megatron-LM's argument defaults (`attention_softmax_in_fp32`
False). Measured on CPU per term (validation/mcore.py, tests/test_validate_mcore.py): the local spec
keeps the terms of memplan's `megatron` inventory plus what its unfused code adds:

- the QKV projection's output is one storage that Q, K and V are views of (no rotary, no GQA); with
  rotary embeddings (applied unfused: `t * cos + rotate_half(t) * sin`) Q and K are new tensors and
  cos / sin are saved for Q and for K in every layer; with grouped-query attention DotProductAttention
  repeats K and V to all a heads before the matmuls (`repeat_interleave`), and those copies are saved;
- under selective recompute megatron-core's CheckpointFunction keeps the attention core's inputs
  (Q, K, V before the repeat: with rotary the QKV output that V is a view of), the mask and
  `attn_mask_type` as a 4-byte int32 tensor;
- SwiGLU unfused (`bias_activation_fusion` off): silu's input (fc1's 2f-wide output), `x_linear +
  glu_linear_offset` (a new f-wide tensor), silu's output and the product (fc2's input).

On CPU (`device="cpu"`, what is measured), torch's kernels add: `F.dropout` keeps a bf16 mask
(bernoulli) instead of native_dropout's 1-byte mask; LayerNorm's mean / rstd are bf16; RMSNorm runs
F.rms_norm's composite path, which keeps an fp32 copy of its input, rstd and the fp32 normalised
input (and not the bf16 input); the softmax is unfused (`masked_softmax_fusion` is CUDA-only), so
`masked_fill` keeps the causal mask, one storage for all layers.

On CUDA (`device="cuda"`) Megatron-LM's defaults (`--masked-softmax-fusion`, `--bias-gelu-fusion` /
`--bias-swiglu-fusion`, `--bias-dropout-fusion`: all on) change that; derived from code, not measured:
the fused upper-triangular softmax (megatron/core/fusions/fused_softmax.py ScaledUpperTriangMaskedSoftmax)
builds no mask; the fused SwiGLU (fusions/fused_bias_swiglu.py SwiGLUFunction) saves only its input;
dropout masks are 1 byte, LayerNorm statistics fp32, torch's fused RMSNorm kernel
(aten::_fused_rms_norm) keeps the input and an fp32 rstd, and TE's fused RoPE (`--rope-fusion`,
rope_utils.apply_rotary_pos_emb -> fused_apply_rotary_pos_emb) keeps no per-layer cos / sin.
Megatron-LM's --no-<name>-fusion switches turn these back to the unfused code's tensors
(memplan/inventory/fusions.py).
"""

from __future__ import annotations

import dataclasses

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.core.training import Recompute
from memplan.inventory.k22 import (
    causal_mask_term,
    k22_outside_layers,
    layer_backward_moments,
    megatron_layer,
    vocab_parallel_loss_moments,
)
from memplan.inventory.megatron import megatron_inventory
from memplan.inventory.mla import mla_terms
from memplan.inventory.types import Dtype, Inventory, Moment, Term, saved, transient

MCORE = "megatron-core 0.16.1 local spec"
MEASURED = f"mcore CPU: {MCORE}, measured on CPU (validation/mcore.py)"
DERIVED = f"mcore code: {MCORE} with Megatron-LM's CUDA fusion defaults, derived from code, not measured"
DROPOUT_MASKS = ("attn_dropout_mask", "mlp_dropout_mask", "softmax_mask", "embedding_dropout_mask")
# the attention terms measured together (one storage or the checkpoint's inputs): validation compares their sum
QKV_TERMS = ("qk", "v", "q", "k", "qkv_output", "kv_repeated")


def mcore_local_inventory(model: ModelSpec, device: str, loss_chunks: int = 1) -> Inventory:
    if loss_chunks > 1:
        raise MemplanError("--loss-chunks is not modelled for --impl megatron-local (megatron-core's local spec has "
                           "no chunked loss measured here); use --impl megatron")
    terms = mcore_local_terms(model, device)
    if model.is_mla:
        terms = mla_terms(terms, model, "megatron-local", device)
    src = DERIVED if device == "cuda" else MEASURED
    rerun = ("s b h", "the recomputed layer's output (megatron-core CheckpointFunction)",
             f"{src}; step transients derived as for --impl megatron")
    moments = layer_backward_moments(model, "eager", device, src, rerun) + vocab_parallel_loss_moments(src, softmax_in_copy=True)
    if model.mlp == "swiglu" and device == "cpu":
        moments = [unfused_swiglu_backward(m) if m.id == "mlp_activation_backward" else m for m in moments]
    return megatron_inventory(f"megatron-local/eager/{device}", terms, moments, model,
                              "act" if device == "cpu" else "fp32", moe_cpu=device == "cpu")


def held_decoder_input(inv: Inventory, model: ModelSpec, impl: str, device: str, recompute: Recompute,
                       modules: tuple[str, ...]) -> Inventory:
    """megatron-core's GPTModel.forward keeps the embedding's output (`decoder_input`, s b h) in a local until it
    returns, the loss included. On CPU an RMSNorm saves an fp32 copy of its input, not the input itself, so with no
    checkpoint on the first layer's input (full recompute, or "layernorm" among the selective modules, saves it)
    that tensor is counted by no saved term: alive beside the cross-entropy's (measured: validation/mcore_step.py)."""
    saved_anyway = recompute == Recompute.FULL or (recompute == Recompute.SELECTIVE and "layernorm" in modules)
    if impl != "megatron-local" or device != "cpu" or model.norm != "rmsnorm" or saved_anyway:
        return inv
    held = transient("decoder_input", "the embedding's output, a local of GPTModel.forward until the loss", "s b h",
                     sp=True, scope="last", src=f"{MEASURED} (validation/mcore_step.py: the whole step)")
    moments = tuple(dataclasses.replace(m, transients=m.transients + (held,)) if m.id == "loss_forward" else m
                    for m in inv.moments)
    return dataclasses.replace(inv, moments=moments)


def mcore_local_terms(model: ModelSpec, device: str) -> list[Term]:
    cpu = device == "cpu"
    stats: Dtype = "act" if cpu else "fp32"
    src = MEASURED if cpu else DERIVED
    base = megatron_layer(model, "eager", stats) + k22_outside_layers(model, stats)
    terms: list[Term] = []
    for t in base:
        if t.id in ("qk", "v"):
            continue  # replaced by the local spec's Q / K / V below
        if cpu and t.id in DROPOUT_MASKS:
            t = dataclasses.replace(t, dtype="act", source=f"{MEASURED}: F.dropout on CPU keeps a bf16 mask")
        terms.append(t)
    terms = _swap_norms(terms, model, cpu) if model.norm == "rmsnorm" else terms
    if model.mlp == "swiglu" and cpu:
        terms = unfused_swiglu(terms, f"{MEASURED}: MLP.glu (bias_activation_fusion off)")
    at = next(i for i, t in enumerate(terms) if t.id == "qkv_input") + 1
    terms[at:at] = _qkv_terms(model, src, unfused_rope=cpu)
    if cpu:
        terms.append(causal_mask_term())
    if model.position_embedding == "rope":
        terms.append(saved("rope_freqs", "rotary freqs (fp32), an input of every layer's checkpoint", "attention",
                        "s q /a", "fp32", scope="chunk", k22=False, only_full=True, src=src))
    return terms


def _qkv_terms(model: ModelSpec, src: str, unfused_rope: bool) -> list[Term]:
    """What the attention core keeps of Q, K, V (see the module docstring): the QKV projection's output M
    is s b q (1 + 2g/a) wide; `unfused_rope`: rotary applied unfused (on CPU; on CUDA with --no-rope-fusion,
    memplan/inventory/fusions.py), which keeps cos and sin."""
    rope, gqa = model.position_embedding == "rope", model.g < model.num_attention_heads
    mixed = "s b q + 2 s b q g /a"
    out = []
    if rope:
        out += [saved("q", "Q after rotary (saved by QK^T / the checkpoint)", "attention", "s b q", tp=True, k22=False,
                   src=src),
                saved("k", "K after rotary, g heads (saved by QK^T / the checkpoint)", "attention", "s b q g /a", tp=True,
                   k22=False, src=src, only_selective=gqa)]
        out += [rope_cos_sin_term(src)] if unfused_rope else []
    # V is a view of the QKV output, and without rotary so are Q and K: that storage is kept whenever one of
    # them is (with GQA and no recompute only the repeated copies are)
    out.append(saved("qkv_output", "QKV projection output (Q, K, V are views of it)", "attention", mixed, tp=True,
                  k22=not rope, src=src, only_selective=gqa and rope))
    if gqa:
        out.append(saved("kv_repeated", "K and V repeated to all a heads (DotProductAttention repeat_interleave)",
                      "attention", "2 s b q", tp=True, sel=True, k22=False, src=src))
    out.append(saved("attn_mask_type", "attn_mask_type as an int32 tensor, an input of the attention checkpoint",
                  "attention", "1", "fp32", k22=False, only_selective=True, src=src))
    return out


def _swap_norms(terms: list[Term], model: ModelSpec, cpu: bool) -> list[Term]:
    """torch.nn.RMSNorm on CPU (F.rms_norm's composite path): an fp32 copy of the input, rstd, the fp32 normalised
    input; the bf16 input is not kept (full recompute's checkpoint keeps the layer input). On CUDA the fused
    kernel keeps the input and rstd, as megatron_layer has it."""
    if not cpu:
        return terms
    src = f"{MEASURED}: torch.nn.RMSNorm (F.rms_norm composite path on CPU)"
    out: list[Term] = []
    for t in terms:
        prefix = {"ln1_input": "ln1", "ln2_input": "ln2", "final_ln_input": "final_ln"}.get(t.id)
        if prefix is None:
            out.append(t)
            continue
        if t.id == "ln1_input":
            out.append(dataclasses.replace(t, name="layer input (kept only by the full-recompute checkpoint)",
                                           only_full=True, kept_by_full=False, in_k22=False, source=src))
        fp32 = dict(sp=True, scope=t.scope, k22=False, src=src)
        out += [saved(f"{prefix}_fp32_input", f"{t.name}: fp32 copy", t.block, "s b h", "fp32", **fp32),
                saved(f"{prefix}_normed", f"{t.name}: fp32 normalised input", t.block, "s b h", "fp32", **fp32)]
    return [dataclasses.replace(t, dtype="fp32") if t.id.endswith("_stats") else t for t in out]


def rope_cos_sin_term(src: str) -> Term:
    """Rotary embeddings applied unfused (megatron-core rope_utils._apply_rotary_pos_emb_bshd: `t * cos +
    rotate_half(t) * sin`, cos and sin cast to the activation dtype per call): the two muls save cos and sin,
    made for Q and for K in every layer; TE's fused kernel (fused_apply_rotary_pos_emb) saves only the shared
    freqs."""
    return saved("rope_cos_sin", "rotary cos and sin, made for Q and for K in every layer", "attention", "4 s q /a",
                 k22=False, src=src)


def unfused_swiglu(terms: list[Term], src: str) -> list[Term]:
    """megatron-core MLP.glu with bias_activation_fusion off (Megatron-LM --no-bias-swiglu-fusion, or on CPU):
    besides silu's input, `x_linear + glu_linear_offset` and SiLU's output, both kept by the product."""
    out: list[Term] = []
    for t in terms:
        out.append(t)
        if t.id == "swiglu_input":
            out += [saved("swiglu_up", "x_linear + glu_linear_offset (kept by the product)", "MLP", "s b f", tp=True,
                       k22=False, src=src),
                    saved("swiglu_silu_out", "SiLU(gate) (kept by the product)", "MLP", "s b f", tp=True, k22=False,
                       src=src)]
    return out



def unfused_swiglu_backward(m: Moment) -> Moment:
    """The activation's backward of the unfused SwiGLU (`unfused_swiglu`: torch.chunk, F.silu, the product): the
    product's backward makes the gradients of SiLU's output and of the up half (s b f each) and frees its saved
    operands and the down projection's input gradient, SiLU's backward frees its input (the gate half, a view of the
    2f-wide fc1 output, the last view of it), then chunk's backward concatenates the two halves' gradients into a
    new 2f-wide tensor (recorded in order: validation/mcore_alloc.py, tests/test_alloc_fixtures.py)."""
    src = f"{MEASURED}: the unfused SwiGLU's backward (recorded allocation order)"
    halves = (transient("grad_swiglu_gate", "gradient of the gate half (SiLU backward)", "s b f", tp=True, src=src),
              transient("grad_swiglu_up", "gradient of the up half (the product's backward)", "s b f", tp=True,
                        src=src))
    kept = tuple(t for t in m.transients if t.id != "grad_fc2_input")
    return dataclasses.replace(m, transients=kept[:1] + halves + kept[1:],
                               freed=m.freed + ("swiglu_input", "swiglu_up", "swiglu_silu_out"))
