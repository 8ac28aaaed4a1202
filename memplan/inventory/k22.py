"""The K22 / Megatron-LM transformer layer as data: its saved tensors (`megatron_layer`), those outside the
layers (embedding, final norm, output layer and loss), the moments its backward and its vocab-parallel loss peak
at, and the batch's labels.

K22 = Korthikanti et al. 2022, arXiv 2205.05198 (section 4.1 for the layer, 4.2 for TP/SP, 4.3 and appendix B
for the embedding and output layer).
"""

from __future__ import annotations

from typing import Optional

from memplan.core.model import ModelSpec
from memplan.inventory.types import FC1_W, FC2_W, OUTPUT_LAYER_W, PROJ_W, Dtype, Moment, Scope, Term, saved, transient


# One transformer layer as Megatron-LM runs it. With eager attention, LayerNorm, a GeLU MLP of
# width f = 4h and dropout this is exactly K22's GPT layer (section 4.1); the other features
# (flash attention, GQA, SwiGLU, RMSNorm, no dropout) swap the tensors they change.
# Q and the attention output are q = a x head_dim wide (q = h unless a config sets head_dim); K and V
# have g heads (g = a in K22), so their elements are s b q g/a.
def megatron_layer(model: ModelSpec, attention: str, stats: Dtype = "fp32") -> list[Term]:
    s41 = "K22 section 4.1"
    norm = "layer norm" if model.norm == "layernorm" else "RMSNorm"
    terms = [
        saved("ln1_input", f"input of {norm} 1 (the layer input)", "layer norms", "s b h",
           tp=False, sp=True, full=True, src=f"{s41}: layer norms 4sbh"),
        *_norm_stats("ln1_stats", f"{norm} 1", "layer", stats, model.norm),
        saved("qkv_input", "input of the QKV projection", "attention", "s b h",
           tp=False, sp=True, src=f"{s41}: QKV input 2sbh"),
    ]
    terms += _eager_core(model) if attention == "eager" else _flash_core(model)
    if model.dropout:
        terms.append(saved("attn_dropout_mask", "dropout mask after attention", "attention", "s b h", "mask",
                        tp=False, sp=True, src=f"{s41}: attention dropout sbh"))
    terms += [
        saved("ln2_input", f"input of {norm} 2", "layer norms", "s b h",
           tp=False, sp=True, src=f"{s41}: layer norms 4sbh"),
        *_norm_stats("ln2_stats", f"{norm} 2", "layer", stats, model.norm),
        saved("fc1_input", "input of the first MLP linear", "MLP", "s b h",
           tp=False, sp=True, src=f"{s41}: MLP 2sbh"),
    ]
    if model.mlp == "gelu":
        terms += [
            saved("gelu_input", "GeLU input", "MLP", "s b f",
               tp=True, sp=False, src=f"{s41}: GeLU 8sbh (f = 4h)"),
            saved("fc2_input", "input of the second MLP linear (GeLU output)", "MLP", "s b f",
               tp=True, sp=False, src=f"{s41}: second linear 8sbh (f = 4h)"),
        ]
    else:
        swiglu = "Megatron-LM: bias_swiglu_impl saves its input; linear_fc2 its input"
        terms += [
            saved("swiglu_input", "gate and up projections (the SwiGLU input, 2f wide)", "MLP", "2 s b f",
               tp=True, sp=False, src=swiglu),
            saved("fc2_input", "input of the down projection (SiLU(gate) * up)", "MLP", "s b f",
               tp=True, sp=False, src=swiglu),
        ]
    if model.dropout:
        terms.append(saved("mlp_dropout_mask", "dropout mask after the MLP", "MLP", "s b h", "mask",
                        tp=False, sp=True, src=f"{s41}: MLP dropout sbh"))
    return terms


def _eager_core(model: ModelSpec) -> list[Term]:
    """QK^T -> softmax -> dropout -> attention over V with the s x s tensors stored (K22 4.1)."""
    s41 = "K22 section 4.1"
    terms = [
        # Q (s b q) and K (s b q g/a) are saved together by QK^T.
        saved("qk", "Q and K (saved by QK^T)", "attention", "s b q + s b q g /a",
           tp=True, sp=False, src=f"{s41}: QK^T 4sbh", storages=2),
    ]
    if model.dropout:
        terms += [
            saved("softmax_out", "softmax output", "attention", "a s^2 b",
               tp=True, sp=False, sel=True, src=f"{s41}: softmax 2as^2b"),
            saved("softmax_mask", "softmax dropout mask", "attention", "a s^2 b", "mask",
               tp=True, sp=False, sel=True, src=f"{s41}: softmax dropout as^2b"),
            saved("attn_dropout_out", "softmax dropout output (saved by attention over V)", "attention",
               "a s^2 b", tp=True, sp=False, sel=True, src=f"{s41}: attention over V 2as^2b"),
        ]
    else:
        # Without dropout, attention over V saves the softmax output, which softmax's own
        # backward also needs: one tensor, stored once.
        terms.append(saved("softmax_out", "softmax output (saved by softmax and by attention over V)", "attention",
                        "a s^2 b", tp=True, sp=False, sel=True, src=f"{s41} without the dropout terms"))
    terms += [
        saved("v", "V (saved by attention over V)", "attention", "s b q g /a",
           tp=True, sp=False, src=f"{s41}: attention over V 2sbh"),
        saved("proj_input", "input of the output projection", "attention", "s b q",
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
        saved("qk", "Q and K (saved by flash attention)", "attention", "s b q + s b q g /a",
           tp=True, sp=False, src=fa, storages=2),
        saved("v", "V (saved by flash attention)", "attention", "s b q g /a", tp=True, sp=False, src=fa),
        saved("proj_input", "attention output = input of the output projection", "attention", "s b q",
           tp=True, sp=False, src=fa),
        saved("softmax_lse", "log-sum-exp per row and head (fp32)", "attention", "a s b", "fp32",
           tp=True, sp=False, sel=True, k22=False, src=fa),
    ]


def _norm_stats(id: str, which: str, scope: Scope, stats: Dtype, kind: str = "layernorm") -> list[Term]:
    """A norm's saved statistics: LayerNorm keeps mean and rstd (2 values per token), RMSNorm only
    rstd; fp32 from CUDA kernels (apex, Transformer Engine, torch), the activation dtype from
    torch's CPU kernel. K22 section 4.1 ignores them."""
    if kind == "layernorm":
        return [saved(id, f"{which} mean and rstd", "layer norms", "2 s b", stats, tp=False, sp=True, scope=scope,
                   k22=False, src="measured: native_layer_norm saves mean and rstd (validation/)", storages=2)]
    return [saved(id, f"{which} rstd", "layer norms", "s b", stats, tp=False, sp=True, scope=scope,
               k22=False, src="Transformer Engine / apex: RMSNorm saves rstd (fp32)")]


def k22_outside_layers(model: ModelSpec, stats: Dtype = "fp32") -> list[Term]:
    """Embedding on the first stage; final norm, output layer and loss on the last (K22 4.3),
    and the index tensors the real code keeps (Megatron-LM embedding and vocab-parallel loss)."""
    terms = [
        saved("token_ids", "token ids (int64 embedding input)", "embedding", "s b", "int64",
           tp=False, sp=False, scope="first", k22=False,
           src="Megatron-LM theoretical_memory_usage.py: 8sbp"),
        saved("embedding_input_mask", "out-of-shard token mask of the vocab-parallel embedding", "embedding", "s b",
           "mask", tp=False, sp=False, scope="first", k22=False, needs_tp=True,
           src="measured: VocabParallelEmbedding zeroes rows of other shards (index_put)"),
    ]
    if model.position_embedding == "learned":
        terms.append(saved("position_ids", "position ids (int64, one row broadcast over b)", "embedding", "s", "int64",
                        tp=False, sp=False, scope="first", k22=False,
                        src="measured: position embedding lookup saves its indices"))
    if model.dropout:
        terms.append(saved("embedding_dropout_mask", "embedding dropout mask", "embedding", "s b h", "mask",
                        tp=False, sp=True, scope="first", src="K22 section 4.3: sbhp/t"))
    terms += [
        saved("final_ln_input", "input of the final layer norm", "output layer", "s b h",
           tp=False, sp=True, scope="last", src="K22 section 4.3: 2sbh/t"),
        *_norm_stats("final_ln_stats", "final norm", "last", stats, model.norm),
        saved("head_input", "input of the output projection (LM head)", "output layer", "s b h",
           tp=False, sp=True, scope="last", src="K22 section 4.3: 2sbh/t"),
        saved("logits_fp32", "fp32 logits for the cross-entropy", "output layer", "s b v", "fp32",
           tp=True, sp=False, scope="last", src="K22 section 4.3: 4sbv/t"),
        saved("target_ids", "target ids (int64) kept by the vocab-parallel cross-entropy", "output layer", "s b",
           "int64", tp=False, sp=False, scope="last", k22=False,
           src="measured: Megatron-style VocabParallelCrossEntropy saves the masked targets"),
        saved("target_mask", "out-of-shard target mask of the vocab-parallel cross-entropy", "output layer", "s b",
           "mask", tp=False, sp=False, scope="last", k22=False,
           src="measured: Megatron-style VocabParallelCrossEntropy saves the target mask"),
    ]
    return terms


def causal_mask_term() -> Term:
    """Eager attention with an explicit [s, s] bool mask: built once per forward of a model chunk
    and saved by every layer's masked_fill (one storage). Megatron-LM's fused upper-triangular
    softmax builds no mask."""
    return saved("causal_mask", "causal mask (bool, shared by the chunk's layers)", "attention", "s^2", "mask",
              tp=False, sp=False, scope="chunk", k22=False, src="measured: masked_fill saves the mask (validation/)")


# The gradient arriving at the embedding's output (the first layer's input gradient), alive while
# the embedding's backward makes its weight gradient.
EMBEDDING_OUTPUT_GRAD = transient("grad_embedding_output", "gradient of the embedding's output", "s b h", sp=True,
                           scope="first", src="measured: embedding backward (validation/step.py)")


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
    dy = transient("grad_residual", "gradient of the layer output (residual stream)", "s b h", sp=True, src=src)
    d_out = ([transient("grad_mlp_output", "gradient of the MLP output (after dropout backward / all-gather)", "s b h",
                 src=src)] if model.dropout else [])
    d_fc2_in = transient("grad_fc2_input", "gradient of the second MLP linear's input", "s b f", tp=True, src=src)
    mlp_masks = ("mlp_dropout_mask",) if model.dropout else ()
    # A recomputed layer's forward runs again up to its last saved tensor; what that leaves alive
    # (only_full: counted for recomputed layers) stays until the layer's backward ends.
    rerun = [saved("recompute_outputs", recompute_outputs[1], "transient", recompute_outputs[0], sp=True,
                k22=False, only_full=True, src=recompute_outputs[2])] if recompute_outputs else []
    moments = [Moment("mlp_backward", "MLP backward: input gradient of the second linear", "backward", "layer",
                      (dy, *d_out, d_fc2_in, *rerun), mlp_masks, (FC2_W,), recomputed=False, fresh=True,
                      source=src)]
    act_in = "2 s b f" if model.mlp == "swiglu" else "s b f"
    moments.append(Moment(
        "mlp_activation_backward", "MLP backward: gradient of the activation's input", "backward", "layer",
        (dy, d_fc2_in, transient("grad_activation_input", "gradient of the activation's input", act_in, tp=True, src=src),
         *rerun),
        mlp_masks + ("fc2_input",), (FC2_W,), recomputed=False, source=src))
    mlp_terms = ("ln2_input", "ln2_stats", "fc1_input", "gelu_input", "swiglu_input", "fc2_input",
                 "mlp_dropout_mask", "attn_dropout_mask")
    d_ctx = transient("grad_attention_output", "gradient of the attention output (output projection input)", "s b q",
               tp=True, src=src)
    if attention == "eager":
        extra = (transient("grad_v", "gradient of V", "s b q g /a", tp=True, src=src),
                 transient("grad_probs", "gradient of the attention probabilities", "a s^2 b", tp=True, src=src))
        freed = mlp_terms + ("proj_input",)
    else:
        extra = (transient("grad_qkv", "dQ, dK, dV of flash attention", "s b q + 2 s b q g /a", tp=True, src=src),)
        if device == "cuda":
            fa2 = "FlashAttention-2 backward (Dao 2023): fp32 dq_accum and softmax_d, freed when the kernel returns"
            extra += (transient("flash_dq_accum", "fp32 dQ accumulator inside the flash backward", "s b q", "fp32", tp=True,
                         src=fa2),
                      transient("flash_softmax_d", "fp32 row sums inside the flash backward", "a s b", "fp32", tp=True, src=fa2))
        freed = mlp_terms
    moments.append(Moment("attention_backward", "attention backward: gradients inside the attention core",
                          "backward", "layer", (dy, d_ctx, *extra, *rerun), freed, (FC2_W, FC1_W, PROJ_W),
                          source=src))
    return moments


def vocab_parallel_loss_moments(src: str, forward_extra: tuple[Term, ...] = (),
                                softmax_in_copy: bool = False) -> list[Moment]:
    """Megatron-LM's output layer and vocab-parallel cross-entropy (cross_entropy.py): the bf16
    logits and their fp32 copy are alive while the cross-entropy computes the softmax (the saved
    term) in a third buffer; the backward turns the saved softmax into the gradient in place and
    casts it to bf16 for the output layer's backward. `softmax_in_copy`: megatron-core 0.16.1's
    VocabParallelCrossEntropy computes exp and the division in place in the fp32 copy
    (``torch.exp(logits, out=logits)``, ``exp_logits.div_``): the copy IS the saved softmax, no third
    buffer (measured: validation/mcore_step.py). The saved fp32 term is made after the bf16 logits it is computed
    from (`made_after`; recorded: megatron-core 0.16.1's ``calculate_logits_max`` casts after the output layer's
    matmul, tests/test_alloc_fixtures.py). There the backward is two moments, as recorded: the bf16 gradient of
    the logits cast while the fp32 softmax still lives, then the output layer's backward (the fp32 softmax freed)
    with its weight gradient a tensor of its own until the hook adds it to the main gradient (`fresh`)."""
    logits = transient("logits", "logits (output layer, activation dtype)", "s b v", tp=True, scope="last", src=src)
    logits32 = transient("logits_fp32_copy", "fp32 copy of the logits (input of the cross-entropy)", "s b v", "fp32",
                  tp=True, scope="last", src=src)
    d_logits = transient("grad_logits", "gradient of the logits (activation dtype)", "s b v", tp=True, scope="last", src=src)
    d_head_in = transient("grad_head_input", "gradient of the output layer's input", "s b h", scope="last", src=src)
    return [
        Moment("loss_forward", "cross-entropy forward: logits and the fp32 copy that becomes the softmax"
               if softmax_in_copy else "cross-entropy forward: logits, fp32 copy and softmax", "loss", "last",
               (logits, *(() if softmax_in_copy else (logits32,)), *forward_extra), source=src,
               made_after=("logits_fp32",)),
        *([Moment("loss_backward", "cross-entropy backward: the logits' gradient cast from the fp32 softmax",
                  "backward", "last", (d_logits,), source=src, handed_on=("grad_logits",))] if softmax_in_copy else []),
        Moment("head_backward" if softmax_in_copy else "loss_backward",
               "output-layer backward: the logits' gradient and the input gradient", "backward", "last",
               (d_logits, d_head_in), ("head_input",) + ("logits_fp32",) * softmax_in_copy, (OUTPUT_LAYER_W,),
               fresh=softmax_in_copy, source=src),
    ]


def labels_term() -> Term:
    """The batch's target ids, held by the training loop from the forward to the loss."""
    return transient("labels", "target ids of the batch (int64, held by the training loop)", "s b", "int64", scope="last",
              src="measured: the step's labels tensor (validation/step.py)")
