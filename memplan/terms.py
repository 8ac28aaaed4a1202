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

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional

from memplan.errors import MemplanError
from memplan.specs import ModelSpec, Recompute
from memplan.symbolic import Poly

Scope = Literal["layer", "chunk", "first", "last"]
Dtype = Literal["act", "mask", "fp32", "int64", "fp8"]

# Bytes per element of each storage kind that is not the configurable activation dtype.
MASK_BYTES = 1  # dropout keeps a bool mask (K22 section 4.1: "masks are 1 byte")
FP32_BYTES = 4  # fp32 logits for the cross-entropy (K22 section 4.3: 4sbv)
INT64_BYTES = 8  # token ids (Megatron-LM theoretical_memory_usage: 8sbp)
FP8_BYTES = 1  # Transformer Engine's FP8 copies of the linear layers' inputs (memplan/fp8.py)


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
    storages: int = 1  # separate allocations of equal size it is made of (LayerNorm's mean and rstd: 2)
    # an MoE layer's routed tokens after the dispatcher's all-gather over the expert-tensor-parallel group (h wide:
    # k s b h etp / t on one GPU); the routed experts' other terms are tp_split (/t: memplan/parallel.py)
    etp_gathered: bool = False
    needs_cp: bool = False  # exists only with context parallelism (cp > 1): its buffers
    only_selective: bool = False  # exists only under selective recompute (the attention checkpoint's own inputs)

    @property
    def recompute_flags(self) -> tuple:
        """What decides `kept` and the copy count: terms with equal flags share them."""
        return (self.scope, self.dropped_by_selective, self.kept_by_full, self.only_full, self.only_selective)

    def element_bytes(self, activation_bytes: int) -> int:
        return {"act": activation_bytes, "mask": MASK_BYTES, "fp32": FP32_BYTES, "int64": INT64_BYTES,
                "fp8": FP8_BYTES}[self.dtype]

    def size(self, activation_bytes: int) -> Poly:
        """Bytes on one GPU without parallelism, as a polynomial (e.g. 2as^2b)."""
        return self.elements * self.element_bytes(activation_bytes)

    def split_size(self, activation_bytes: int, sp: bool, cp: int = 1) -> Poly:
        """Bytes on one GPU of a tensor-parallel group, as a polynomial in t (and cp: the rank's s/cp tokens, as
        `bytes` divides them)."""
        size = self.size(activation_bytes)
        if cp > 1:
            size = size.divide_by("cp")
        if self.etp_gathered:
            size = size * Poly.parse("etp")
        return size.divide_by("t") if (self.tp_split or (sp and self.sp_split)) else size

    def bytes(self, values: Mapping[str, Any], activation_bytes: int, sp: Any) -> Any:
        """Bytes on one GPU; `values` and `sp` may be scalars or numpy arrays (one per plan)."""
        full = self.size(activation_bytes).evaluate(values)
        if self.needs_tp:
            full = full * (values["t"] > 1)
        # context parallelism: every tensor holds the rank's s/cp tokens (memplan/parallel.py); a term's own cp
        # factor (a buffer of all cp chunks) is in its polynomial
        cp = values.get("cp", 1)
        full = full // cp
        if self.needs_cp:
            full = full * (cp > 1)
        if self.etp_gathered:
            full = full * values.get("etp", values["t"])
        if self.tp_split:
            return full // values["t"]
        if self.sp_split:
            # sp is 0/1 (or an array of them): divide by t where SP is on, by 1 elsewhere.
            return full // (1 + (values["t"] - 1) * sp)
        return full

    def kept(self, recompute: Any) -> Any:
        """1 where the tensor is stored under this recompute mode, else 0 (scalar or array)."""
        if self.scope != "layer":
            # outside the layers only a checkpoint's inputs depend on recompute (the mask every
            # checkpointed layer is given)
            return 1 * (recompute == Recompute.FULL) if self.only_full else 1
        keep_none = 0 if (self.only_full or self.only_selective) else 1
        keep_selective = 0 if (self.dropped_by_selective or self.only_full) else 1
        keep_full = 1 if (self.kept_by_full or self.only_full) else 0
        return (
            (recompute == Recompute.NONE) * keep_none
            + (recompute == Recompute.SELECTIVE) * keep_selective
            + (recompute == Recompute.FULL) * keep_full
        )


def _t(id, name, block, elements, dtype="act", *, tp=False, sp=False, sel=False, full=False, scope="layer",
       k22=True, src, needs_tp=False, only_full=False, storages=1, etp_gathered=False, needs_cp=False,
       only_selective=False):
    return Term(id, name, block, Poly.parse_sum(elements), dtype, tp, sp, sel, full, scope, k22, src, needs_tp,
                only_full, storages, etp_gathered, needs_cp, only_selective)


# One transformer layer as Megatron-LM runs it. With eager attention, LayerNorm, a GeLU MLP of
# width f = 4h and dropout this is exactly K22's GPT layer (section 4.1); the other features
# (flash attention, GQA, SwiGLU, RMSNorm, no dropout) swap the tensors they change.
# Q and the attention output are q = a x head_dim wide (q = h unless a config sets head_dim); K and V
# have g heads (g = a in K22), so their elements are s b q g/a.
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
        swiglu = "Megatron-LM: bias_swiglu_impl saves its input; linear_fc2 its input"
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
        # Q (s b q) and K (s b q g/a) are saved together by QK^T.
        _t("qk", "Q and K (saved by QK^T)", "attention", "s b q + s b q g /a",
           tp=True, sp=False, src=f"{s41}: QK^T 4sbh", storages=2),
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
        _t("v", "V (saved by attention over V)", "attention", "s b q g /a",
           tp=True, sp=False, src=f"{s41}: attention over V 2sbh"),
        _t("proj_input", "input of the output projection", "attention", "s b q",
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
        _t("qk", "Q and K (saved by flash attention)", "attention", "s b q + s b q g /a",
           tp=True, sp=False, src=fa, storages=2),
        _t("v", "V (saved by flash attention)", "attention", "s b q g /a", tp=True, sp=False, src=fa),
        _t("proj_input", "attention output = input of the output projection", "attention", "s b q",
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
                   k22=False, src="measured: native_layer_norm saves mean and rstd (validation/)", storages=2)]
    return [_t(id, f"{which} rstd", "layer norms", "s b", stats, tp=False, sp=True, scope=scope,
               k22=False, src="Transformer Engine / apex: RMSNorm saves rstd (fp32)")]


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
class Moment:
    """A moment of the step when tensors beyond the saved ones are alive: inside a layer's backward
    (scope "layer") or around the loss (scope "last"). Its bytes are what the step holds anyway
    (states, saved tensors of the layers not yet back-propagated) plus, for the layer or head in
    question, its saved terms not in `freed`, its `transients` and the gradients of the parameter
    groups in `grads` (the step timeline, memplan/timeline.py, adds them up)."""

    id: str
    name: str
    phase: Literal["forward", "loss", "backward"]  # forward: inside a layer's forward (its later terms in `freed`)
    scope: Literal["layer", "last"]
    transients: tuple[Term, ...]
    freed: tuple[str, ...] = ()  # saved term ids of this layer / the head no longer alive
    grads: tuple[str, ...] = ()  # parameter groups (states.param_groups names) whose gradients exist by now
    recomputed: bool = True  # selective recompute: the attention core has been re-run by now
    fresh: bool = False  # the last group's new gradient is still its own tensor (not yet accumulated)
    source: str = ""
    grad_elements: int = 0  # gradients made so far of the layer's own parameters, in elements (traced moments)
    applies: Literal["any", "plain", "recomputed"] = "any"  # layers it happens in: all, not recomputed, recomputed
    layers: tuple[int, ...] = ()  # the model's layers (from 0) it happens in, when not all (a traced layer group)


def _x(id, name, elements, dtype="act", *, tp=False, sp=False, scope="layer", src="", needs_cp=False):
    """A transient tensor (a Term that no backward keeps)."""
    return _t(id, name, "transient", elements, dtype, tp=tp, sp=sp, scope=scope, k22=False, src=src,
              needs_cp=needs_cp)


# The gradient arriving at the embedding's output (the first layer's input gradient), alive while
# the embedding's backward makes its weight gradient.
EMBEDDING_OUTPUT_GRAD = _x("grad_embedding_output", "gradient of the embedding's output", "s b h", sp=True,
                           scope="first", src="measured: embedding backward (validation/step.py)")

# Parameter groups (memplan/states.py) by role.
QKV_W, PROJ_W = "QKV projection weight", "attention output projection weight"
FC1_W, FC2_W = "MLP input projection weight", "MLP output projection weight"


def layer_backward_moments(model: ModelSpec, attention: str, device: str, src: str,
                           recompute_outputs: Optional[tuple[str, str, str]] = None) -> list[Moment]:
    """The two moments a Megatron-style layer's backward peaks at (read off torch's autograd on the
    reference layer, validation/; Megatron-LM's fused kernels free and allocate in the same order):

    - MLP: the second linear has produced its input gradient (f wide) while its saved input is still
      alive, on top of the residual gradient and, with dropout or SP, the gradient of the MLP output
      (dropout backward / the all-gather of the row-parallel output's gradient). For SwiGLU the
      activation's backward then makes a 2f-wide gradient once the down projection's input is freed.
    - attention: attention over V has produced the gradients of V and of the (dropout) probabilities,
      a s^2 b for eager attention; flash attention's backward makes dQ, dK, dV (and on CUDA the FA2
      kernel's fp32 dQ accumulator and row sums).
    """
    dy = _x("grad_residual", "gradient of the layer output (residual stream)", "s b h", sp=True, src=src)
    d_out = ([_x("grad_mlp_output", "gradient of the MLP output (after dropout backward / all-gather)", "s b h",
                 src=src)] if model.dropout else [])
    d_fc2_in = _x("grad_fc2_input", "gradient of the second MLP linear's input", "s b f", tp=True, src=src)
    mlp_masks = ("mlp_dropout_mask",) if model.dropout else ()
    # A recomputed layer's forward runs again up to its last saved tensor; what that leaves alive
    # (only_full: counted for recomputed layers) stays until the layer's backward ends.
    rerun = [_t("recompute_outputs", recompute_outputs[1], "transient", recompute_outputs[0], sp=True,
                k22=False, only_full=True, src=recompute_outputs[2])] if recompute_outputs else []
    moments = [Moment("mlp_backward", "MLP backward: input gradient of the second linear", "backward", "layer",
                      (dy, *d_out, d_fc2_in, *rerun), mlp_masks, (FC2_W,), recomputed=False, fresh=True,
                      source=src)]
    act_in = "2 s b f" if model.mlp == "swiglu" else "s b f"
    moments.append(Moment(
        "mlp_activation_backward", "MLP backward: gradient of the activation's input", "backward", "layer",
        (dy, d_fc2_in, _x("grad_activation_input", "gradient of the activation's input", act_in, tp=True, src=src),
         *rerun),
        mlp_masks + ("fc2_input",), (FC2_W,), recomputed=False, source=src))
    mlp_terms = ("ln2_input", "ln2_stats", "fc1_input", "gelu_input", "swiglu_input", "fc2_input",
                 "mlp_dropout_mask", "attn_dropout_mask")
    d_ctx = _x("grad_attention_output", "gradient of the attention output (output projection input)", "s b q",
               tp=True, src=src)
    if attention == "eager":
        extra = (_x("grad_v", "gradient of V", "s b q g /a", tp=True, src=src),
                 _x("grad_probs", "gradient of the attention probabilities", "a s^2 b", tp=True, src=src))
        freed = mlp_terms + ("proj_input",)
    else:
        extra = (_x("grad_qkv", "dQ, dK, dV of flash attention", "s b q + 2 s b q g /a", tp=True, src=src),)
        if device == "cuda":
            fa2 = "FlashAttention-2 backward (Dao 2023): fp32 dq_accum and softmax_d, freed when the kernel returns"
            extra += (_x("flash_dq_accum", "fp32 dQ accumulator inside the flash backward", "s b q", "fp32", tp=True,
                         src=fa2),
                      _x("flash_softmax_d", "fp32 row sums inside the flash backward", "a s b", "fp32", tp=True, src=fa2))
        freed = mlp_terms
    moments.append(Moment("attention_backward", "attention backward: gradients inside the attention core",
                          "backward", "layer", (dy, d_ctx, *extra, *rerun), freed, (FC2_W, FC1_W, PROJ_W),
                          source=src))
    return moments


def vocab_parallel_loss_moments(src: str, forward_extra: tuple[Term, ...] = ()) -> list[Moment]:
    """Megatron-LM's output layer and vocab-parallel cross-entropy (cross_entropy.py): the bf16
    logits and their fp32 copy are alive while the cross-entropy computes the softmax (the saved
    term) in a third buffer; the backward turns the saved softmax into the gradient in place and
    casts it to bf16 for the output layer's backward."""
    logits = _x("logits", "logits (output layer, activation dtype)", "s b v", tp=True, scope="last", src=src)
    logits32 = _x("logits_fp32_copy", "fp32 copy of the logits (input of the cross-entropy)", "s b v", "fp32",
                  tp=True, scope="last", src=src)
    d_logits = _x("grad_logits", "gradient of the logits (activation dtype)", "s b v", tp=True, scope="last", src=src)
    d_head_in = _x("grad_head_input", "gradient of the output layer's input", "s b h", scope="last", src=src)
    return [
        Moment("loss_forward", "cross-entropy forward: logits, fp32 copy and softmax", "loss", "last",
               (logits, logits32, *forward_extra), source=src),
        Moment("loss_backward", "output-layer backward: the logits' gradient and the input gradient", "backward",
               "last", (d_logits, d_head_in), ("head_input",), ("output layer (LM head)",), source=src),
    ]


GradLifetime = Literal["buffer", "backward"]


@dataclass(frozen=True)
class Inventory:
    """The saved tensors of one architecture as one implementation runs it, the moments its step
    peaks at, and how its training loop holds gradients and steps the optimizer."""

    name: str
    terms: tuple[Term, ...]
    moments: tuple[Moment, ...] = ()
    grad_lifetime: GradLifetime = "buffer"  # a main-gradient buffer for the whole step, or torch .grad
    grad_hook_transient: bool = False  # each bf16 .grad lives until a hook adds it to the fp32 buffer
    optimizer_impl: str = "fused"  # the implementation's default AdamW
    runtime: Literal["torch", "megatron"] = "torch"  # which process figure of the GPU preset applies
    held: tuple[Term, ...] = ()  # inputs the training loop holds for the micro-batch (not saved by autograd)
    # torch autograd keeps a tied output layer's weight gradient in its input buffer until the
    # embedding's backward adds its own (out of place); Megatron-LM's fused wgrad writes it to the buffer
    tied_grad_waits: bool = True
    # every allocation is rounded up to this many bytes: 512 for PyTorch's CUDA caching allocator
    # (c10/cuda/CUDACachingAllocator.cpp kMinBlockSize), 1 on CPU
    granularity: int = 1
    origin: str = ""  # a traced inventory's origin (memplan/traced.py); empty for hand-written ones
    traced_from: tuple[tuple[str, int], ...] = ()  # (symbol, least value) a trace's sizes hold from: (("b", 2),)
    # how the weight matrices are stored (states.weight_shapes): transformers keeps a gated model's
    # q/k/v_proj and gate/up_proj apart ("separate"; Phi-3's fused qkv_proj is not modelled), Megatron-LM,
    # the reference layer and transformers' GPT-2 (Conv1D c_attn, c_fc) fuse them
    weight_layout: Literal["fused", "separate"] = "fused"


IMPLEMENTATIONS: dict[str, str] = {
    "megatron": "Megatron-LM on GPU: fused scaled upper-triangular masked softmax (no mask tensor), "
                "fp32 layer-norm statistics, vocab-parallel embedding and cross-entropy; one fp32 "
                "main-gradient buffer, fused AdamW (default). Step transients derived from its code, not measured. "
                "Beside megatron-local (measured): K / V kept with g heads and rotary fused into the attention "
                "(Transformer Engine), derived from TE / megatron-core code. Mixture of experts (memplan/terms_moe.py): "
                "megatron-core's MoELayer with Transformer Engine's grouped experts and the fused weighted SwiGLU, "
                "derived from code, not measured. Multi-head latent attention (memplan/terms_mla.py): latent norms fused "
                "into the up projections, cuDNN fused attention, fused MLA RoPE, derived from megatron-core / TE code, not "
                "measured; multi-token prediction (--mtp-num-layers) on the last stage derived from megatron-core's "
                "multi_token_prediction.py, not measured",
    "megatron-local": "megatron-core 0.16.1's local spec (get_gpt_layer_local_spec, Megatron-LM "
                      "--transformer-impl local): unfused DotProductAttention, torch LayerNorm / RMSNorm, unrotated QKV "
                      "one storage, rotary unfused, K / V repeated for GQA. Measured per term on CPU against megatron-core "
                      "(validation/mcore.py: t = 1, 2, SP, recompute none / selective / full, layer and GPTModel); "
                      "--device cuda applies Megatron-LM's fusion defaults, derived from its code, not measured. "
                      "`megatron` (the Transformer Engine spec) differs from it by: no mask tensor (fused softmax), "
                      "K / V not repeated, rotary fused, one QKV storage: derived from megatron-core / TE code. "
                      "Mixture of experts: megatron-core's MoELayer (router, alltoall / allgather dispatcher, "
                      "SequentialMLP experts, shared experts, aux loss, capacity factor) measured per term on CPU with "
                      "balanced routing, ep = 1 and 2 (memplan/terms_moe.py, validation/mcore.py). Multi-head latent "
                      "attention: megatron-core's MLASelfAttention with its latent norms measured per term on CPU (t = 1, "
                      "2, SP, recompute none / selective / full; memplan/terms_mla.py)",
    "torch": "memplan's reference PyTorch layer (validation/): eager attention with an explicit causal "
             "mask, torch layer norm (fp32 statistics on CUDA, activation dtype on CPU), in a Megatron-like "
             "loop (fp32 main-gradient buffer fed by hooks); torch AdamW foreach (default) or fused",
    "hf-eager": "HF transformers 5.x, attn_implementation='eager' (GPT-2, Llama layout): Python attention "
                "and norms, as measured in validation/hf.py; torch .grad tensors, AdamW fused (the "
                "Trainer's default with torch >= 2.8; a plain torch.optim.AdamW is foreach on CUDA)",
    "hf-sdpa": "HF transformers 5.x, attn_implementation='sdpa': torch's fused attention kernel, "
               "as measured in validation/hf.py; torch .grad tensors, AdamW fused (as hf-eager). "
               "For both hf-*: GPT-2 and the Llama layout use the hand-written inventories; other "
               "architectures (Qwen2/3, Gemma 1-3, Phi-3, the mixture-of-experts Mixtral, Qwen3-MoE and "
               "DeepSeek-V3, ...) a traced one (memplan trace: saved tensors traced from transformers' code, checked "
               "against CPU runs; the backward's transients derived)",
}
HF_IMPLS = ("hf-eager", "hf-sdpa")
DEVICES = ("cuda", "cpu")


def inventory_for(model: ModelSpec, impl: str = "megatron", device: str = "cuda", loss_chunks: int = 1,
                  fp8: Optional[str] = None, mst: tuple[int, int] = (1, 1)) -> Inventory:
    """The saved tensors of `model` as implementation `impl` runs it on `device`, with the LM head
    and loss computed in `loss_chunks` sequence chunks (1: the implementation's own loss), with
    `fp8` (a recipe), Transformer Engine's FP8 linear layers (memplan/fp8.py), and MsT's
    mini-sequences `mst` = (MLP pieces, LM-head pieces) (memplan/mst.py; (1, 1): none)."""
    if impl not in IMPLEMENTATIONS:
        raise MemplanError(f"unknown implementation '{impl}'; known: {', '.join(IMPLEMENTATIONS)}")
    if device not in DEVICES:
        raise MemplanError(f"unknown device '{device}'; known: {', '.join(DEVICES)}")
    if fp8 is not None:
        from memplan.fp8 import check_fp8

        check_fp8(fp8, impl)
    if model.is_moe and impl == "torch":
        raise MemplanError("no reference torch layer (--impl torch) MoE inventory: use --impl megatron, "
                           "megatron-local, hf-sdpa or hf-eager")
    if model.is_moe and impl in HF_IMPLS and (model.moe_imbalance != 1.0 or model.moe_capacity_factor is not None):
        raise MemplanError("--moe-imbalance and --moe-capacity-factor are modelled for --impl megatron / "
                           "megatron-local (memplan/terms_moe.py), not for the traced --impl hf-* inventories")
    if model.is_moe and impl not in HF_IMPLS and (model.bias or model.mlp != "swiglu"):
        raise MemplanError("the Megatron-LM MoE inventory models SwiGLU experts without biases (Mixtral, Qwen3-MoE, "
                           "DeepSeek-V3): set mlp: swiglu and bias: false")
    if model.is_mla and impl == "torch":
        raise MemplanError("no reference torch layer (--impl torch) inventory for multi-head latent attention: use "
                           "--impl megatron, megatron-local, hf-sdpa or hf-eager")
    if (model.is_moe or model.is_mla) and model.inventory is None and impl in HF_IMPLS:
        what = "mixture-of-experts" if model.is_moe else "multi-head latent attention"
        raise MemplanError(f"a {what} model's --impl hf-* activations come from a traced inventory: "
                           "give its transformers config.json (--hf-config), or the model's inventory directory")
    inv = _inventory(model, impl, device, loss_chunks)
    if fp8 is not None:
        from memplan.fp8 import fp8_moments, fp8_terms

        inv = dataclasses.replace(inv, name=f"{inv.name}/fp8-{fp8}", terms=tuple(fp8_terms(list(inv.terms), fp8,
                                                                                          model.attention)),
                                  moments=tuple(fp8_moments(list(inv.moments), model.attention)))
    if mst != (1, 1):
        from memplan import mst as minis

        if loss_chunks > 1:
            raise MemplanError("--mst computes the LM head and loss in its own pieces: drop --loss-chunks")
        inv = minis.apply(inv, model, *mst)
    layout = "separate" if impl in HF_IMPLS and model.mlp == "swiglu" else "fused"
    return dataclasses.replace(inv, granularity=CUDA_BLOCK_BYTES if device == "cuda" else 1, weight_layout=layout)


def training_inventory(model: ModelSpec, impl: str, device: str, training: Any) -> Inventory:
    """`inventory_for` with what the training settings change in it: the loss chunks, FP8 and MsT's pieces
    (memplan/mst.py, which checks that MsT is modelled for this model, implementation and micro-batch)."""
    from memplan import mst

    inventory = inventory_for(model, impl, device, training.loss_chunks, training.fp8,
                              mst.pieces_for(model, training, impl))
    if training.optimizer_in_backward and inventory.grad_lifetime != "backward":
        raise MemplanError(f"the optimizer step in the backward is modelled for torch .grad training loops "
                           f"(--impl hf-*), not --impl {impl}")
    return inventory


CUDA_BLOCK_BYTES = 512  # PyTorch's CUDA caching allocator rounds every block up to a multiple of this


def _inventory(model: ModelSpec, impl: str, device: str, loss_chunks: int) -> Inventory:
    stats: Dtype = "fp32" if device == "cuda" else "act"
    if impl in HF_IMPLS:
        if model.inventory is not None:
            from memplan.traced import traced_inventory

            return traced_inventory(model, impl, device, loss_chunks)
        from memplan.terms_hf import hf_inventory

        return hf_inventory(model, impl, device, loss_chunks)
    if impl == "megatron-local":
        from memplan.terms_mcore import mcore_local_inventory

        return mcore_local_inventory(model, device, loss_chunks)
    if impl == "torch":
        if model.attention != "eager" or model.mlp != "gelu" or model.norm != "layernorm":
            raise MemplanError("the reference torch layer (--impl torch) is the K22 GPT layer: eager attention, "
                               "GeLU MLP, LayerNorm")
        terms = megatron_layer(model, "eager", stats) + k22_outside_layers(model, stats) + [causal_mask_term()]
        src = "measured: reference layer in a Megatron-like loop (validation/step.py)"
        emb = _x("embedding_sum", "word + position embedding sum (a local of the reference forward)", "s b h",
                 scope="last", src=src)
        # torch.utils.checkpoint (non-reentrant) stops re-running the layer after its last saved tensor and
        # keeps none of the re-run's outputs.
        moments = layer_backward_moments(model, "eager", device, src) + _loss_moments(impl, loss_chunks, src, (emb,))
        terms = _loss_terms(terms, impl, loss_chunks)
        # The reference loop (validation/step.py) accumulates each bf16 .grad into the fp32 buffer
        # with a hook (Megatron-LM without gradient-accumulation fusion); torch AdamW defaults to
        # foreach on CUDA tensors.
        return Inventory(f"{impl}/{model.attention}/{device}", tuple(terms), tuple(moments), "buffer", True,
                         "foreach", "torch", (labels_term(),))
    terms = megatron_layer(model, model.attention, stats) + k22_outside_layers(model, stats)
    if model.is_mla:
        from memplan.terms_mla import mla_terms

        terms = mla_terms(terms, model, impl, device)
    src = "derived from Megatron-LM code (autograd order of the reference layer), not measured"
    # Megatron-LM's CheckpointFunction re-runs a layer's whole forward and back-propagates from its output.
    rerun = ("s b h", "the recomputed layer's output (Megatron-LM CheckpointFunction)", src)
    moments = layer_backward_moments(model, model.attention, device, src, rerun) + _loss_moments(impl, loss_chunks, src)
    terms = _loss_terms(terms, impl, loss_chunks)
    return megatron_inventory(f"{impl}/{model.attention}/{device}", terms, moments, model, stats, moe_cpu=False)


def megatron_inventory(name: str, terms: list[Term], moments: list[Moment], model: ModelSpec, stats: Dtype,
                       moe_cpu: bool) -> Inventory:
    """A Megatron-LM inventory (--impl megatron, megatron-local) from its dense layer's terms and moments: an MoE
    model's expert layers (memplan/terms_moe.py; `moe_cpu`: the unfused SwiGLU measured on CPU) and the
    multi-token-prediction modules on the last stage (memplan/terms_mla.py) added, with the batch tensors
    Megatron-LM's get_batch holds."""
    if model.is_moe:
        from memplan.terms_moe import moe_layer_terms, moe_moments

        terms = moe_layer_terms(terms, model, unfused=moe_cpu, measured=moe_cpu)
        moments = moe_moments(moments, model, terms)
    if model.mtp_layers:
        from memplan.terms_mla import mtp_terms

        terms = terms + mtp_terms(terms, model, stats)
    # Megatron-LM: gradient-accumulation fusion writes weight gradients straight into the fp32
    # main-gradient buffer; Transformer Engine / apex FusedAdam (no temporaries).
    held = (labels_term(), _x("loss_mask", "loss mask (fp32) of the batch", "s b", "fp32", scope="last",
                               src="Megatron-LM pretrain_gpt.get_batch: tokens, labels, loss_mask, position_ids"))
    return Inventory(name, tuple(terms), tuple(moments), "buffer", False, "fused", "megatron", held,
                     tied_grad_waits=False)


def _loss_moments(impl: str, chunks: int, src: str, forward_extra: tuple[Term, ...] = ()) -> list[Moment]:
    """The vocab-parallel loss's moments, or with chunks > 1 those of the chunked head + loss
    (memplan/chunked_loss.py)."""
    if chunks == 1:
        return vocab_parallel_loss_moments(src, forward_extra)
    from memplan.chunked_loss import chunked_loss_moments

    return chunked_loss_moments(chunks, impl, forward_extra)


def _loss_terms(terms: list[Term], impl: str, chunks: int) -> list[Term]:
    if chunks == 1:
        return terms
    from memplan.chunked_loss import chunked_head_terms

    return chunked_head_terms(terms, impl)


def labels_term() -> Term:
    """The batch's target ids, held by the training loop from the forward to the loss."""
    return _x("labels", "target ids of the batch (int64, held by the training loop)", "s b", "int64", scope="last",
              src="measured: the step's labels tensor (validation/step.py)")


def display_poly(poly: Poly, model: ModelSpec) -> Poly:
    """Write a size in the model's own terms: f = 4h, g = a and q = h are substituted when they hold."""
    if model.q == model.hidden_size:
        poly = poly.rename("q", "h")
    if model.f == 4 * model.hidden_size:
        poly = poly.substitute("f", Poly.parse("4 h"))
    if model.g == model.num_attention_heads:
        poly = poly.rename("g", "a")
    return poly
