"""THE inventory: every tensor a training step keeps for the backward pass, as data.

Each `Term` is one saved tensor (or a small group the same op saves): its size in
elements as a polynomial in the K22 symbols, the byte size of an element, how tensor
and sequence parallelism split it, what recompute does to it, where it lives (every
layer, the first pipeline stage, the last one) and where the number comes from.
Everything else (per-layer bytes, stage totals, the symbolic text, report rows,
the planner's vectorised sums) is derived from these rows; the paper's closed forms
exist only in the tests, as checks of this table.

Sources: K22 = Korthikanti et al. 2022, arXiv 2205.05198 (section 4.1 for the layer,
4.2 for TP/SP, 4.3 and appendix B for the embedding and output layer). Terms that
real PyTorch code stores but K22 ignores carry in_k22=False; the paper-only view
leaves them out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping

from memplan.errors import MemplanError
from memplan.specs import ModelSpec, Recompute
from memplan.symbolic import Poly

Scope = Literal["layer", "chunk", "first", "last"]
Dtype = Literal["act", "mask", "fp32", "int64"]

# Bytes per element of each storage kind that is not the configurable activation dtype.
MASK_BYTES = 1  # dropout keeps a bool mask (K22 section 4.1: "masks are 1 byte")
FP32_BYTES = 4  # fp32 logits for the cross-entropy (K22 section 4.3: 4sbv)
INT64_BYTES = 8  # token ids (Megatron-LM theoretical_memory_usage: 8sbp)


@dataclass(frozen=True)
class Term:
    """One saved tensor."""

    id: str
    name: str
    block: str
    elements: Poly
    dtype: Dtype
    tp_split: bool  # split over t by tensor parallelism (inside column/row-parallel regions)
    sp_split: bool  # replicated under TP, split over t along s when sequence parallelism is on
    dropped_by_selective: bool = False  # recomputed by selective recompute (the attention core)
    kept_by_full: bool = False  # the layer input: the only tensor full recompute keeps
    scope: Scope = "layer"  # every layer; once per model chunk; the first / last stage only
    in_k22: bool = True
    source: str = ""
    needs_tp: bool = False  # exists only with tensor parallelism (t > 1)
    only_full: bool = False  # exists only under full recompute (a checkpoint's own copy of the input)

    @property
    def recompute_flags(self) -> tuple:
        """What decides `kept` and the copy count: terms with equal flags share them."""
        return (self.scope, self.dropped_by_selective, self.kept_by_full, self.only_full)

    def element_bytes(self, activation_bytes: int) -> int:
        return {"act": activation_bytes, "mask": MASK_BYTES, "fp32": FP32_BYTES, "int64": INT64_BYTES}[
            self.dtype
        ]

    def size(self, activation_bytes: int) -> Poly:
        """Bytes on one GPU without parallelism, as a polynomial (e.g. 2as^2b)."""
        return self.elements * self.element_bytes(activation_bytes)

    def split_size(self, activation_bytes: int, sp: bool) -> Poly:
        """Bytes on one GPU of a tensor-parallel group, as a polynomial in t."""
        size = self.size(activation_bytes)
        return size.divide_by("t") if (self.tp_split or (sp and self.sp_split)) else size

    def bytes(self, values: Mapping[str, Any], activation_bytes: int, sp: Any) -> Any:
        """Bytes on one GPU; `values` and `sp` may be scalars or numpy arrays (one per plan)."""
        full = self.size(activation_bytes).evaluate(values)
        if self.needs_tp:
            full = full * (values["t"] > 1)
        if self.tp_split:
            return full // values["t"]
        if self.sp_split:
            # sp is 0/1 (or an array of them): divide by t where SP is on, by 1 elsewhere.
            return full // (1 + (values["t"] - 1) * sp)
        return full

    def kept(self, recompute: Any) -> Any:
        """1 where the tensor is stored under this recompute mode, else 0 (scalar or array)."""
        if self.scope != "layer":
            return 1
        keep_none = 0 if self.only_full else 1
        keep_selective = 0 if (self.dropped_by_selective or self.only_full) else 1
        keep_full = 1 if (self.kept_by_full or self.only_full) else 0
        return (
            (recompute == Recompute.NONE) * keep_none
            + (recompute == Recompute.SELECTIVE) * keep_selective
            + (recompute == Recompute.FULL) * keep_full
        )


def _t(id, name, block, elements, dtype="act", *, tp=False, sp=False, sel=False, full=False, scope="layer",
       k22=True, src, needs_tp=False, only_full=False):
    return Term(id, name, block, Poly.parse_sum(elements), dtype, tp, sp, sel, full, scope, k22, src, needs_tp,
                only_full)


# One transformer layer as Megatron-LM runs it. With eager attention, LayerNorm, a GeLU MLP of
# width f = 4h and dropout this is exactly K22's GPT layer (section 4.1); the other features
# (flash attention, GQA, SwiGLU, RMSNorm, no dropout) swap the tensors they change.
# K and V have g heads of h/a each (g = a in K22), so their elements are s b h g/a.
def megatron_layer(model: ModelSpec, attention: str, stats: Dtype = "fp32") -> list[Term]:
    s41 = "K22 section 4.1"
    norm = "layer norm" if model.norm == "layernorm" else "RMSNorm"
    terms = [
        _t("ln1_input", f"input of {norm} 1 (the layer input)", "layer norms", "s b h",
           tp=False, sp=True, full=True, src=f"{s41}: layer norms 4sbh"),
        *_norm_stats("ln1_stats", f"{norm} 1", "layer", stats, model.norm),
        _t("qkv_input", "input of the QKV projection", "attention", "s b h",
           tp=False, sp=True, src=f"{s41}: QKV input 2sbh"),
    ]
    terms += _eager_core(model) if attention == "eager" else _flash_core(model)
    if model.dropout:
        terms.append(_t("attn_dropout_mask", "dropout mask after attention", "attention", "s b h", "mask",
                        tp=False, sp=True, src=f"{s41}: attention dropout sbh"))
    terms += [
        _t("ln2_input", f"input of {norm} 2", "layer norms", "s b h",
           tp=False, sp=True, src=f"{s41}: layer norms 4sbh"),
        *_norm_stats("ln2_stats", f"{norm} 2", "layer", stats, model.norm),
        _t("fc1_input", "input of the first MLP linear", "MLP", "s b h",
           tp=False, sp=True, src=f"{s41}: MLP 2sbh"),
    ]
    if model.mlp == "gelu":
        terms += [
            _t("gelu_input", "GeLU input", "MLP", "s b f",
               tp=True, sp=False, src=f"{s41}: GeLU 8sbh (f = 4h)"),
            _t("fc2_input", "input of the second MLP linear (GeLU output)", "MLP", "s b f",
               tp=True, sp=False, src=f"{s41}: second linear 8sbh (f = 4h)"),
        ]
    else:
        swiglu = "Megatron-LM bias_swiglu_impl saves its input; linear_fc2 its input"
        terms += [
            _t("swiglu_input", "gate and up projections (the SwiGLU input, 2f wide)", "MLP", "2 s b f",
               tp=True, sp=False, src=swiglu),
            _t("fc2_input", "input of the down projection (SiLU(gate) * up)", "MLP", "s b f",
               tp=True, sp=False, src=swiglu),
        ]
    if model.dropout:
        terms.append(_t("mlp_dropout_mask", "dropout mask after the MLP", "MLP", "s b h", "mask",
                        tp=False, sp=True, src=f"{s41}: MLP dropout sbh"))
    return terms


def _eager_core(model: ModelSpec) -> list[Term]:
    """QK^T -> softmax -> dropout -> attention over V with the s x s tensors stored (K22 4.1)."""
    s41 = "K22 section 4.1"
    terms = [
        # Q (s b h) and K (s b h g/a) are saved together by QK^T.
        _t("qk", "Q and K (saved by QK^T)", "attention", "s b h + s b h g /a",
           tp=True, sp=False, src=f"{s41}: QK^T 4sbh"),
    ]
    if model.dropout:
        terms += [
            _t("softmax_out", "softmax output", "attention", "a s^2 b",
               tp=True, sp=False, sel=True, src=f"{s41}: softmax 2as^2b"),
            _t("softmax_mask", "softmax dropout mask", "attention", "a s^2 b", "mask",
               tp=True, sp=False, sel=True, src=f"{s41}: softmax dropout as^2b"),
            _t("attn_dropout_out", "softmax dropout output (saved by attention over V)", "attention",
               "a s^2 b", tp=True, sp=False, sel=True, src=f"{s41}: attention over V 2as^2b"),
        ]
    else:
        # Without dropout, attention over V saves the softmax output, which softmax's own
        # backward also needs: one tensor, stored once.
        terms.append(_t("softmax_out", "softmax output (saved by softmax and by attention over V)", "attention",
                        "a s^2 b", tp=True, sp=False, sel=True, src=f"{s41} without the dropout terms"))
    terms += [
        _t("v", "V (saved by attention over V)", "attention", "s b h g /a",
           tp=True, sp=False, src=f"{s41}: attention over V 2sbh"),
        _t("proj_input", "input of the output projection", "attention", "s b h",
           tp=True, sp=False, src=f"{s41}: output projection 2sbh"),
    ]
    return terms


def _flash_core(model: ModelSpec) -> list[Term]:
    """Fused / flash attention (FlashAttention-2, cuDNN via Transformer Engine): no s x s tensor;
    the kernel saves Q, K, V, its output and a fp32 log-sum-exp per query row and head; dropout
    inside the kernel keeps an RNG state, not a mask. The output is also the output projection's
    input: one tensor."""
    fa = "FlashAttention-2 (Dao 2023) forward saves q, k, v, out, softmax_lse"
    return [
        _t("qk", "Q and K (saved by flash attention)", "attention", "s b h + s b h g /a",
           tp=True, sp=False, src=fa),
        _t("v", "V (saved by flash attention)", "attention", "s b h g /a", tp=True, sp=False, src=fa),
        _t("proj_input", "attention output = input of the output projection", "attention", "s b h",
           tp=True, sp=False, src=fa),
        _t("softmax_lse", "log-sum-exp per row and head (fp32)", "attention", "a s b", "fp32",
           tp=True, sp=False, sel=True, k22=False, src=fa),
    ]


def _norm_stats(id: str, which: str, scope: Scope, stats: Dtype, kind: str = "layernorm") -> list[Term]:
    """A norm's saved statistics: LayerNorm keeps mean and rstd (2 values per token), RMSNorm only
    rstd; fp32 from CUDA kernels (apex, Transformer Engine, torch), the activation dtype from
    torch's CPU kernel. K22 section 4.1 ignores them."""
    if kind == "layernorm":
        return [_t(id, f"{which} mean and rstd", "layer norms", "2 s b", stats, tp=False, sp=True, scope=scope,
                   k22=False, src="measured: native_layer_norm saves mean and rstd (validation/)")]
    return [_t(id, f"{which} rstd", "layer norms", "s b", stats, tp=False, sp=True, scope=scope,
               k22=False, src="Transformer Engine / apex RMSNorm saves rstd (fp32)")]


def k22_outside_layers(model: ModelSpec, stats: Dtype = "fp32") -> list[Term]:
    """Embedding on the first stage; final norm, output layer and loss on the last (K22 4.3),
    and the index tensors the real code keeps (Megatron-LM embedding and vocab-parallel loss)."""
    terms = [
        _t("token_ids", "token ids (int64 embedding input)", "embedding", "s b", "int64",
           tp=False, sp=False, scope="first", k22=False,
           src="Megatron-LM theoretical_memory_usage.py: 8sbp"),
        _t("embedding_input_mask", "out-of-shard token mask of the vocab-parallel embedding", "embedding", "s b",
           "mask", tp=False, sp=False, scope="first", k22=False, needs_tp=True,
           src="measured: VocabParallelEmbedding zeroes rows of other shards (index_put)"),
    ]
    if model.position_embedding == "learned":
        terms.append(_t("position_ids", "position ids (int64, one row broadcast over b)", "embedding", "s", "int64",
                        tp=False, sp=False, scope="first", k22=False,
                        src="measured: position embedding lookup saves its indices"))
    if model.dropout:
        terms.append(_t("embedding_dropout_mask", "embedding dropout mask", "embedding", "s b h", "mask",
                        tp=False, sp=True, scope="first", src="K22 section 4.3: sbhp/t"))
    terms += [
        _t("final_ln_input", "input of the final layer norm", "output layer", "s b h",
           tp=False, sp=True, scope="last", src="K22 section 4.3: 2sbh/t"),
        *_norm_stats("final_ln_stats", "final norm", "last", stats, model.norm),
        _t("head_input", "input of the output projection (LM head)", "output layer", "s b h",
           tp=False, sp=True, scope="last", src="K22 section 4.3: 2sbh/t"),
        _t("logits_fp32", "fp32 logits for the cross-entropy", "output layer", "s b v", "fp32",
           tp=True, sp=False, scope="last", src="K22 section 4.3: 4sbv/t"),
        _t("target_ids", "target ids (int64) kept by the vocab-parallel cross-entropy", "output layer", "s b",
           "int64", tp=False, sp=False, scope="last", k22=False,
           src="measured: Megatron-style VocabParallelCrossEntropy saves the masked targets"),
        _t("target_mask", "out-of-shard target mask of the vocab-parallel cross-entropy", "output layer", "s b",
           "mask", tp=False, sp=False, scope="last", k22=False,
           src="measured: Megatron-style VocabParallelCrossEntropy saves the target mask"),
    ]
    return terms


def causal_mask_term() -> Term:
    """Eager attention with an explicit [s, s] bool mask: built once per forward of a model chunk
    and saved by every layer's masked_fill (one storage). Megatron-LM's fused upper-triangular
    softmax builds no mask."""
    return _t("causal_mask", "causal mask (bool, shared by the chunk's layers)", "attention", "s^2", "mask",
              tp=False, sp=False, scope="chunk", k22=False, src="measured: masked_fill saves the mask (validation/)")


@dataclass(frozen=True)
class Inventory:
    """The saved tensors of one architecture as one implementation runs it."""

    name: str
    terms: tuple[Term, ...]


IMPLEMENTATIONS: dict[str, str] = {
    "megatron": "Megatron-LM on GPU: fused scaled upper-triangular masked softmax (no mask tensor), "
                "fp32 layer-norm statistics, vocab-parallel embedding and cross-entropy",
    "torch": "memplan's reference PyTorch layer (validation/): eager attention with an explicit causal "
             "mask, torch layer norm (fp32 statistics on CUDA, activation dtype on CPU)",
    "hf-eager": "HF transformers 5.x, attn_implementation='eager' (GPT-2, Llama layout): Python attention "
                "and norms, as measured in validation/hf.py",
    "hf-sdpa": "HF transformers 5.x, attn_implementation='sdpa': torch's fused attention kernel, "
               "as measured in validation/hf.py",
}
HF_IMPLS = ("hf-eager", "hf-sdpa")
DEVICES = ("cuda", "cpu")


def inventory_for(model: ModelSpec, impl: str = "megatron", device: str = "cuda") -> Inventory:
    """The saved tensors of `model` as implementation `impl` runs it on `device`."""
    if impl not in IMPLEMENTATIONS:
        raise MemplanError(f"unknown implementation '{impl}'; known: {', '.join(IMPLEMENTATIONS)}")
    if device not in DEVICES:
        raise MemplanError(f"unknown device '{device}'; known: {', '.join(DEVICES)}")
    stats: Dtype = "fp32" if device == "cuda" else "act"
    if impl in HF_IMPLS:
        from memplan.terms_hf import hf_inventory

        return Inventory(f"{impl}/{device}", tuple(hf_inventory(model, impl, device)))
    if impl == "torch":
        if model.attention != "eager" or model.mlp != "gelu" or model.norm != "layernorm":
            raise MemplanError("the reference torch layer (--impl torch) is the K22 GPT layer: eager attention, "
                               "GeLU MLP, LayerNorm")
        terms = megatron_layer(model, "eager", stats) + k22_outside_layers(model, stats) + [causal_mask_term()]
    else:
        terms = megatron_layer(model, model.attention, stats) + k22_outside_layers(model, stats)
    return Inventory(f"{impl}/{model.attention}/{device}", tuple(terms))


def display_poly(poly: Poly, model: ModelSpec) -> Poly:
    """Write a size in the model's own terms: f = 4h and g = a are substituted when they hold."""
    if model.f == 4 * model.hidden_size:
        poly = poly.substitute("f", Poly.parse("4 h"))
    if model.g == model.num_attention_heads:
        poly = poly.rename("g", "a")
    return poly
