"""Inventories of HuggingFace transformers' own code (attn_implementation "eager" / "sdpa").

Derived from reading transformers 5.23.0 (GPT2Model, LlamaModel and the Llama-layout families)
and measured with the saved-tensor ledger in validation/hf.py, which labels every tensor these
models save with the ids used here; tests/test_validate_hf.py compares the two per layer.

What the real code keeps differs from K22 and from Megatron-LM: GPT-2's tanh-approximated GeLU
is written in Python ops and keeps four f-wide tensors; Llama's RMSNorm keeps an fp32 copy of its
input; eager attention copies Q and K for the matmul, keeps the scores in fp32 (Llama) and repeats
K / V to all a heads; dropout through F.dropout keeps a bf16 mask on CPU (bernoulli_) and a 1-byte
mask on CUDA (native_dropout). transformers has no tensor, sequence or pipeline parallelism and no
selective recompute (gradient checkpointing is per layer), so those plans are refused.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.core.specs import Config
from memplan.core.training import Recompute
from memplan.inventory.tune_loss import tune_chunked_backward, tune_loss_forward, tune_loss_terms
from memplan.inventory.types import (
    FC1_W,
    FC2_W,
    OUTPUT_LAYER_W,
    PROJ_W,
    Dtype,
    Inventory,
    Moment,
    Term,
    saved,
    transient,
)

SRC = "transformers 5.23.0, measured (validation/hf.py)"


def check_hf_plan(config: Config, impl: str) -> None:
    """transformers runs a model on one device per replica: refuse what it cannot launch."""
    par, tr = config.parallel, config.training
    who = "torchtune" if impl == "torchtune" else "transformers"
    if (par.tp > 1 or par.pp > 1) and impl == "torchtune":
        raise MemplanError("--impl torchtune: memplan models its recipes without tensor or pipeline parallelism "
                           "(use t = p = 1 with data parallelism / ZeRO)")
    if par.tp > 1 or par.pp > 1:
        raise MemplanError(f"--impl {impl}: transformers runs a model with no tensor or pipeline parallelism "
                           "(use t = p = 1 with data parallelism / ZeRO, or --impl megatron)")
    if par.cp > 1 or par.ep > 1:
        raise MemplanError(f"--impl {impl}: context and expert parallelism are modelled for Megatron-LM "
                           f"(--impl megatron), not for {who}")
    if tr.recompute == Recompute.SELECTIVE:
        raise MemplanError(f"--impl {impl}: {who} has no selective recompute (gradient checkpointing "
                           "recomputes whole layers: --recompute full)")
    if tr.recompute == Recompute.FULL and tr.recompute_num_layers not in (None, config.layers_per_chunk):
        raise MemplanError(f"--impl {impl}: transformers' gradient checkpointing covers every layer or none "
                           f"(gradient_checkpointing_enable): --recompute full without --recompute-num-layers, not "
                           f"{tr.recompute_num_layers} of {config.layers_per_chunk}")


def hf_inventory(model: ModelSpec, impl: str, device: str, loss_chunks: int = 1) -> Inventory:
    """transformers' saved tensors, its step's moments, torch .grad tensors (allocated on their
    first write in the backward, freed by zero_grad) and the Trainer's fused AdamW; torchtune's with
    its own loss (memplan/inventory/tune_loss.py: its model's fp32 logits or CEWithChunkedOutputLoss)."""
    terms = hf_terms(model, impl, device, loss_chunks)
    if impl == "torchtune":
        moments = [dataclasses.replace(m, source=f"derived: {m.source}, with torchtune's tensors (not measured)")
                   for m in hf_layer_moments(model, True, kv_expanded=True) + final_norm_moments(model)]
        loss = [m for m in hf_loss_moments(model, final_norm=False) if m.id != "loss_forward"] if loss_chunks == 1 \
            else tune_chunked_backward(loss_chunks)
        moments += [tune_loss_forward(loss_chunks)] + loss
    else:
        loss = (hf_loss_moments(model) if loss_chunks == 1
                else final_norm_moments(model) + _chunked_loss_moments(model, loss_chunks))
        moments = hf_layer_moments(model, impl != "hf-eager") + loss
    ops = llama_checkpointed_forward(terms) if impl != "torchtune" and model.mlp == "swiglu" else ()
    return Inventory(f"{impl}/{device}", tuple(terms), tuple(moments), "backward", False, "fused", "torch",
                     checkpointed_forward=ops)


CKPT = "recorded: transformers 5.23.0 Llama under torch.utils.checkpoint (validation/alloc_trace.py, tests/data/alloc)"


def llama_checkpointed_forward(terms: list[Term]) -> tuple[tuple[str, Term], ...]:
    """A gradient-checkpointed Llama layer's forward (`Inventory.checkpointed_forward`): each LlamaRMSNorm makes its
    fp32 copy, the square (pow), frees it, the fp32 product with the rstd, frees the copy, the bf16 cast and the
    weighted output, frees the cast and the product; LlamaMLP makes the gate projection, SiLU of it, frees the gate,
    the up projection, the product, frees SiLU and up, down_proj's output, frees the product and its input, then the
    output (the residual add's). The attention's tensors (at most s b h each) are left out. Recorded order: events
    99-175 of tests/data/alloc/llama-s512_foreach_full.json.gz (layer 1 of step 1)."""
    t = {x.id: x for x in terms}
    ops: list[tuple[str, Term]] = []
    for p, which, out in (("ln1", "input_layernorm", "qkv_input"), ("ln2", "post_attention_layernorm", "mlp_input")):
        sq = transient(f"{p}_pow", f"{which}: fp32 square of its input", "s b h", "fp32", src=CKPT)
        prod = transient(f"{p}_product", f"{which}: fp32 input times rstd", "s b h", "fp32", src=CKPT)
        a, normed = t[f"{p}_fp32_input"], t[f"{p}_normed"]
        ops += [("+", a), ("+", sq), ("-", sq), ("+", prod), ("-", a), ("+", normed), ("+", t[out]), ("-", normed),
                ("-", prod)] + [("-", t[out])] * (p == "ln1")  # q / k / v_proj made from it (left out)
    down = transient("mlp_output", "MLP output (down_proj, before the residual add)", "s b h", src=CKPT)
    gate, act, up, prod = (t[x] for x in ("silu_input", "silu_out", "up_out", "fc2_input"))
    return tuple(ops + [("+", gate), ("+", act), ("-", gate), ("+", up), ("+", prod), ("-", act), ("-", up),
                        ("+", down), ("-", prod), ("-", t["mlp_input"]), ("-", down)])


STEP = "measured: transformers 5.23.0 training step (validation/step.py)"


def hf_layer_moments(model: ModelSpec, sdpa: bool,
                   traced: Optional[tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = None,
                   kv_expanded: bool = False) -> list[Moment]:
    """Where a transformers layer's backward peaks (op-level live bytes of validation/step.py):
    the MLP once the gated / tanh-GeLU product's backward has made two f-wide gradients beside the
    down projection's input gradient, and attention inside the sdpa kernel's backward (dQ, dK, dV)
    or, eager, at the softmax backward (s x s gradients; fp32 for Llama, which upcasts the scores).
    `traced` overrides the saved tensors each of the three moments no longer holds (a traced inventory's
    ids, memplan/inventory/traced.py); `kv_expanded`: sdpa's dK and dV have all a heads (torchtune expands
    K and V before attention)."""
    dy = transient("grad_residual", "gradient of the layer output (residual stream)", "s b h", src=STEP)
    d_fc2_in = transient("grad_fc2_input", "gradient of the down projection's input", "s b f", src=STEP)
    two_f = transient("grad_activation_products", "gradients of the two factors of the activation product", "2 s b f",
               src=STEP, storages=2)  # mul's backward: two tensors (recorded: validation/alloc_trace.py)
    gpt2 = model.mlp == "gelu"
    mlp = ("ln2_input", "ln2_stats", "mlp_input", "gelu_input", "gelu_tanh_out", "gelu_one_plus_tanh",
           "gelu_half_x", "fc2_input", "mlp_dropout_mask", "attn_dropout_mask") if gpt2 else (
        "ln2_fp32_input", "ln2_rstd", "ln2_normed", "mlp_input", "silu_input", "up_out", "silu_out", "fc2_input")
    moments = [
        Moment("fc2_backward", "MLP backward: the down projection's weight and input gradients", "backward",
               "layer", (dy, d_fc2_in), ("mlp_dropout_mask",), (FC2_W,), fresh=True, source=STEP),
        Moment("mlp_backward", "MLP backward: gradients of the activation product", "backward", "layer",
               (dy, d_fc2_in, two_f), ("fc2_input", "mlp_dropout_mask"), (FC2_W,), source=STEP)]
    if sdpa:
        # sdpa's backward holds the gradient of its output beside dQ, dK, dV
        extra = (transient("grad_attention_output", "gradient of the attention output", "s b q", src=STEP),
                 transient("grad_qkv", "dQ, dK, dV of sdpa's backward",
                           "3 s b q" if kv_expanded else "s b q + 2 s b q g /a", src=STEP))
        freed = mlp + ("attn_out",)
    else:
        # at the softmax backward, attention over V's backward has consumed the output's gradient
        score: Dtype = "act" if gpt2 else "fp32"
        extra = (transient("grad_v", "gradient of V", "s b q", src=STEP),
                 transient("grad_probs", "gradient of the attention probabilities", "a s^2 b", score, src=STEP),
                 transient("grad_scores", "gradient of the attention scores (softmax backward)", "a s^2 b", score,
                    src=STEP))
        # Llama's V (repeated to a heads) is its own tensor, freed with attention over V's backward.
        # GPT-2's Q, K, V are views of one c_attn output: with b = 1 QK^T keeps Q and K as views, so
        # the whole output (V too) lives until QK^T's backward; with b > 1 torch.matmul copies Q and K
        # and V's storage is freed here, so this moment is sbh high for b > 1 (on the safe side).
        freed = mlp + ("attn_out", "attn_probs", "softmax_dropout_mask") + (() if gpt2 else ("v",))
    moments.append(Moment("attention_backward", "attention backward: gradients inside attention", "backward",
                          "layer", (dy, *extra), freed, (FC2_W, FC1_W, PROJ_W), source=STEP))
    if traced is not None:
        moments = [dataclasses.replace(m, freed=f, source=f"{m.source}; derived for a traced inventory")
                   for m, f in zip(moments, traced)]
    return moments


def _chunked_loss_moments(model: ModelSpec, chunks: int) -> list[Moment]:
    """The LM head + cross-entropy in `chunks` checkpointed sequence chunks (validation/losses.py;
    the pattern of Liger-Kernel's fused linear cross-entropy and the chunked losses of torchtitan /
    Megatron-LM), c = sb/N tokens a chunk. Forward, per chunk: the fp32 copy of the chunk's logits and
    its log-softmax (the bf16 logits die at the copy); nothing survives the chunk. Backward, per
    chunk: the recomputed log-softmax with nll_loss's and log_softmax's fp32 gradients, beside the
    running sum of the earlier chunks' LM-head weight gradients and their input gradients; then the
    chunk's weight gradient and the new sum (out of place)."""
    src = f"{STEP} with validation/losses.py chunked_cross_entropy"
    c = f"s b v /{chunks}"

    def fp32(id: str, name: str) -> Term:
        return transient(id, name, c, "fp32", scope="last", src=src)

    earlier = transient("grad_head_input_chunks", "input gradients of the earlier chunks", f"{chunks - 1} s b h /{chunks}",
                 scope="last", src=src)
    # autograd sums the chunks' LM-head weight gradients in the node's input buffer and hands the sum
    # to .grad once, after the last chunk (stolen when there is no .grad yet, added to it otherwise)
    running = transient("grad_head_weight_sum", "running sum of the chunks' LM head weight gradients (autograd buffer)",
                 "v h", scope="last", src=src)
    weight = transient("grad_head_weight_chunk", "the chunk's LM head weight gradient", "v h", scope="last", src=src)
    return [
        Moment("loss_forward", "loss forward of one chunk: fp32 logits and log-softmax", "loss", "last",
               (fp32("logits_fp32_copy", "fp32 logits of one chunk"),
                fp32("log_softmax", "log-softmax of one chunk (fp32)")), source=src),
        Moment("loss_backward", "loss backward of the last chunk: recomputed log-softmax and its fp32 gradients",
               "backward", "last",
               (fp32("log_softmax", "recomputed log-softmax of the chunk (fp32)"),
                fp32("grad_nll", "nll_loss gradient of the chunk (fp32)"),
                fp32("grad_log_softmax", "log_softmax gradient of the chunk (fp32)"), running, earlier),
               source=src),
        # the new running sum (out of place) is the LM head's gradient from here on: .grad (stolen with one
        # micro-batch; with more, added to the .grad of the earlier ones: `fresh`)
        Moment("head_backward", "LM head backward of the last chunk: its weight gradient added to the running sum",
               "backward", "last", (running, weight, earlier), grads=(_head(model),), fresh=True, source=src),
    ]


def _head(model: ModelSpec) -> str:
    """The parameter group of the LM head's weight (the embedding's when tied)."""
    return OUTPUT_LAYER_W if not model.tied_embeddings else "word embedding"


def final_norm_moments(model: ModelSpec) -> list[Moment]:
    """The final norm's backward after the head's (with the whole loss or the chunked one)."""
    if model.norm != "rmsnorm":
        return []
    # LlamaRMSNorm's backward runs in fp32: beside its saved fp32 input, the gradients of pow, mean,
    # rsqrt and the product (five s x b x h fp32 tensors at once, after the mul of PowBackward0), with
    # the head's and the norm's weight gradients made; the rest of the head is freed
    src = ("traced: the live storages of a fake Llama step (validation/transients.py), checked by memplan "
           "validate --peak (llama sdpa s128 v64)")
    return [Moment("final_norm_backward", "final norm backward (RMSNorm in fp32)", "backward", "last",
                   (transient("grad_final_norm_fp32", "fp32 gradients inside RMSNorm's backward", "5 s b h", "fp32",
                              scope="last", src=src, storages=5),),
                   ("head_input", "logits_fp32", "target_ids", "nll_total_weight", "loss_total_elements", "final_norm_rstd",
                    "final_norm_normed", "logits_bf16", "loss_row_stats"), (_head(model), "final norm"), source=src)]


def hf_loss_moments(model: ModelSpec, final_norm: bool = True) -> list[Moment]:
    """ForCausalLMLoss: the bf16 logits and their fp32 copy while log_softmax makes the saved fp32
    log-probabilities; in the backward nll_loss's and log_softmax's fp32 gradients (the model's
    output, and with it the bf16 logits, is gone by then, as in the Trainer's training_step); then
    the bf16 gradient of the logits while lm_head's backward runs."""
    norm = final_norm_moments(model) if final_norm else []
    head = _head(model)
    return norm + [
        Moment("loss_forward", "loss forward: bf16 logits, fp32 copy, log-softmax", "loss", "last",
               (transient("logits", "logits (lm_head output, bf16)", "s b v", scope="last", src=STEP),
                transient("logits_fp32_copy", "logits.float()", "s b v", "fp32", scope="last", src=STEP)), source=STEP,
               made_after=("logits_fp32", "target_ids", "nll_total_weight")),
        Moment("loss_backward", "loss backward: fp32 gradients of nll_loss and log_softmax", "backward", "last",
               (transient("grad_nll", "nll_loss gradient (fp32)", "s b v", "fp32", scope="last", src=STEP),
                transient("grad_log_softmax", "log_softmax gradient (fp32)", "s b v", "fp32", scope="last", src=STEP)),
               source=STEP, handed_on=("grad_log_softmax",)),
        Moment("head_backward", "lm_head backward: bf16 gradient of the logits", "backward", "last",
               (transient("grad_logits", "gradient of the logits (bf16)", "s b v", scope="last", src=STEP),
                transient("grad_head_input", "gradient of lm_head's input", "s b h", scope="last", src=STEP)),
               ("logits_fp32",), (head,), source=STEP),
    ]


def hf_terms(model: ModelSpec, impl: str, device: str, loss_chunks: int = 1) -> list[Term]:
    layout = "gpt2" if (model.norm == "layernorm" and model.mlp == "gelu") else "llama"
    if layout == "llama" and not (model.norm == "rmsnorm" and model.mlp == "swiglu"):
        raise MemplanError("--impl hf-*: memplan knows the GPT-2 layout (LayerNorm, GeLU) and the Llama "
                           "layout (RMSNorm, SwiGLU)")
    if impl == "torchtune":
        if layout != "llama" or model.dropout or model.bias:
            raise MemplanError("--impl torchtune: memplan models torchtune's Llama (RMSNorm, SwiGLU, no dropout, "
                               "no biases)")
        return torchtune_terms(model, loss_chunks)
    mask: Dtype = "mask" if device == "cuda" else "act"  # F.dropout: native_dropout on CUDA only
    sdpa = impl == "hf-sdpa"
    if sdpa and model.dropout and device == "cpu":
        raise MemplanError("hf-sdpa with dropout on CPU runs torch's fp32 math kernel, which memplan does not "
                           "model; use dropout 0 or --impl hf-eager")
    extra = [] if sdpa else [checkpoint_mask()]
    if layout == "gpt2":
        return _gpt2_layer(model, sdpa, mask, device) + _gpt2_outside(model, mask, device, loss_chunks) + extra
    # the decoder layers are also given the int64 position ids (one [1, s] row), which gradient checkpointing
    # keeps as it keeps the mask (traced: validation/transients.py, the `checkpoint` of a traced inventory)
    extra.append(saved("checkpoint_position_ids", "position ids (int64), an input of every checkpointed layer",
                    "attention", "s", "int64", scope="chunk", k22=False, only_full=True,
                    src="traced: transformers 5.23.0 LlamaModel passes position_ids to each decoder layer; "
                    "torch.utils.checkpoint keeps it"))
    return _llama_layer(model, sdpa, mask) + _llama_outside(loss_chunks) + extra


def checkpoint_mask() -> Term:
    """Eager attention gets an explicit causal mask: create_causal_mask builds a bool s x s and
    turns it into an additive [b, 1, s, s] mask in the activation dtype (torch.where). Without
    recompute it dies with the forward; gradient checkpointing keeps it as an input of every
    checkpointed layer (one storage), so it lives through the backward."""
    return saved("checkpoint_mask", "additive causal mask, an input of every checkpointed layer", "attention",
              "b s^2", "act", scope="chunk", k22=False, only_full=True,
              src=f"{STEP}: create_causal_mask, kept by torch.utils.checkpoint")


def _gpt2_layer(model: ModelSpec, sdpa: bool, mask: Dtype, device: str) -> list[Term]:
    stats: Dtype = "fp32" if device == "cuda" else "act"
    ln = "GPT2Block.ln_1/ln_2 (native_layer_norm)"
    terms = [
        saved("ln1_input", "input of ln_1 (the layer input)", "layer norms", "s b h", full=True, src=f"{SRC}: {ln}"),
        saved("ln1_stats", "ln_1 mean and rstd", "layer norms", "2 s b", stats, k22=False, src=f"{SRC}: {ln}"),
        saved("qkv_input", "input of c_attn (the QKV projection)", "attention", "s b h", src=f"{SRC}: Conv1D addmm"),
    ]
    if sdpa:
        terms += [
            saved("qkv", "Q, K, V (views of one c_attn output, saved by sdpa)", "attention", "3 s b h",
               src=f"{SRC}: scaled_dot_product_attention"),
            saved("sdpa_logsumexp", "sdpa log-sum-exp per row and head (fp32)", "attention", "a s b", "fp32",
               k22=False, src=f"{SRC}: scaled_dot_product_attention"),
        ]
    else:
        terms += [
            saved("k", "K (copied for the QK^T matmul)", "attention", "s b h", src=f"{SRC}: eager_attention_forward"),
            saved("q", "Q (copied for the QK^T matmul)", "attention", "s b h", src=f"{SRC}: eager_attention_forward"),
            saved("softmax_out", "softmax output", "attention", "a s^2 b", src=f"{SRC}: eager_attention_forward"),
        ]
        if model.dropout:
            terms += [
                saved("softmax_dropout_mask", "attention dropout mask", "attention", "a s^2 b", mask,
                   src=f"{SRC}: attn_dropout"),
                saved("attn_probs", "attention dropout output (saved by attention over V)", "attention", "a s^2 b",
                   src=f"{SRC}: eager_attention_forward"),
            ]
        terms.append(saved("v", "V (saved by attention over V)", "attention", "s b h",
                        src=f"{SRC}: eager_attention_forward"))
    terms.append(saved("attn_out", "attention output = input of c_proj", "attention", "s b h", src=f"{SRC}: c_proj"))
    if model.dropout:
        terms.append(saved("attn_dropout_mask", "resid_dropout mask after attention", "attention", "s b h", mask,
                        src=f"{SRC}: resid_dropout"))
    terms += [
        saved("ln2_input", "input of ln_2", "layer norms", "s b h", src=f"{SRC}: {ln}"),
        saved("ln2_stats", "ln_2 mean and rstd", "layer norms", "2 s b", stats, k22=False, src=f"{SRC}: {ln}"),
        saved("mlp_input", "input of c_fc", "MLP", "s b h", src=f"{SRC}: Conv1D addmm"),
        saved("gelu_input", "GeLU input x (kept by x**3)", "MLP", "s b f", src=f"{SRC}: NewGELUActivation"),
        saved("gelu_tanh_out", "tanh(...) inside GeLU", "MLP", "s b f", k22=False, src=f"{SRC}: NewGELUActivation"),
        saved("gelu_one_plus_tanh", "1 + tanh(...) inside GeLU", "MLP", "s b f", k22=False,
           src=f"{SRC}: NewGELUActivation"),
        saved("gelu_half_x", "0.5 * x inside GeLU", "MLP", "s b f", k22=False, src=f"{SRC}: NewGELUActivation"),
        saved("fc2_input", "input of the MLP c_proj (GeLU output)", "MLP", "s b f", src=f"{SRC}: Conv1D addmm"),
    ]
    if model.dropout:
        terms.append(saved("mlp_dropout_mask", "dropout mask after the MLP", "MLP", "s b h", mask,
                        src=f"{SRC}: GPT2MLP.dropout"))
    return terms


def _gpt2_outside(model: ModelSpec, mask: Dtype, device: str, loss_chunks: int) -> list[Term]:
    stats: Dtype = "fp32" if device == "cuda" else "act"
    terms = [
        saved("token_ids", "token ids (int64, wte)", "embedding", "s b", "int64", scope="first", k22=False, src=SRC),
        saved("position_ids", "position ids (int64, wpe, one row)", "embedding", "s", "int64", scope="first",
           k22=False, src=SRC),
    ]
    if model.dropout:
        terms.append(saved("embedding_dropout_mask", "embedding dropout mask", "embedding", "s b h", mask,
                        scope="first", src=SRC))
    return terms + [
        saved("final_ln_input", "input of ln_f", "output layer", "s b h", scope="last", src=SRC),
        saved("final_ln_stats", "ln_f mean and rstd", "output layer", "2 s b", stats, scope="last", k22=False, src=SRC),
        *_loss_terms(loss_chunks),
    ]


def _rmsnorm(prefix: str, which: str, scope: str, tune: bool = False) -> list[Term]:
    if tune:  # F.rms_norm(x.float(), weight=bf16 scale): the dtypes differ, so torch runs the composite ops
        src = f"{TUNE}: RMSNorm, F.rms_norm on the fp32 input with the bf16 scale (no fused kernel)"
        return [
            saved(f"{prefix}_fp32_input", f"{which}: fp32 copy of its input", "layer norms", "s b h", "fp32",
                  scope=scope, k22=False, src=src),
            saved(f"{prefix}_rstd", f"{which}: rstd (fp32)", "layer norms", "s b", "fp32", scope=scope, k22=False,
                  src=src),
            saved(f"{prefix}_normed", f"{which}: normalised input before the scale (fp32)", "layer norms", "s b h",
                  "fp32", scope=scope, src=src),
        ]
    src = f"{SRC}: LlamaRMSNorm computes in fp32"
    return [
        saved(f"{prefix}_fp32_input", f"{which}: fp32 copy of its input", "layer norms", "s b h", "fp32",
           scope=scope, k22=False, src=src),
        saved(f"{prefix}_rstd", f"{which}: rstd (fp32)", "layer norms", "s b", "fp32", scope=scope, k22=False, src=src),
        saved(f"{prefix}_normed", f"{which}: normalised input before the weight (bf16)", "layer norms", "s b h",
           scope=scope, src=src),
    ]


def _llama_layer(model: ModelSpec, sdpa: bool, mask: Dtype) -> list[Term]:
    attn = f"{SRC}: eager_attention_forward"
    terms = [
        saved("layer_input", "layer input, kept by gradient checkpointing", "layer norms", "s b h", only_full=True,
           src=f"{SRC}: checkpoint saves the decoder layer's input"),
        *_rmsnorm("ln1", "input_layernorm", "layer"),
        saved("qkv_input", "input of q_proj, k_proj, v_proj (one tensor)", "attention", "s b h", src=f"{SRC}: q_proj"),
        saved("rope_cos", "rotary cos table (shared by the layers)", "attention", "s q /a", scope="chunk", k22=False,
           src=f"{SRC}: apply_rotary_pos_emb"),
        saved("rope_sin", "rotary sin table (shared by the layers)", "attention", "s q /a", scope="chunk", k22=False,
           src=f"{SRC}: apply_rotary_pos_emb"),
    ]
    if sdpa:
        sd = f"{SRC}: scaled_dot_product_attention (enable_gqa: K and V keep g heads)"
        terms += [
            saved("q", "Q after rotary (saved by sdpa)", "attention", "s b q", src=sd),
            saved("k", "K after rotary, g heads (saved by sdpa)", "attention", "s b q g /a", src=sd),
            saved("v", "V, g heads (saved by sdpa)", "attention", "s b q g /a", src=sd),
            saved("sdpa_logsumexp", "sdpa log-sum-exp per row and head (fp32)", "attention", "a s b", "fp32",
               k22=False, src=sd),
        ]
    else:
        terms += [
            saved("k", "K after rotary, repeated to a heads (QK^T)", "attention", "s b q", src=attn),
            saved("q", "Q after rotary (QK^T)", "attention", "s b q", src=attn),
            saved("softmax_out", "softmax output (fp32)", "attention", "a s^2 b", "fp32", src=attn),
        ]
        if model.dropout:
            terms.append(saved("softmax_dropout_mask", "attention dropout mask", "attention", "a s^2 b", mask,
                            src=attn))
        terms += [
            saved("attn_probs", "attention weights in bf16 (saved by attention over V)", "attention", "a s^2 b",
               src=attn),
            saved("v", "V repeated to a heads (attention over V)", "attention", "s b q", src=attn),
        ]
    terms += [
        saved("attn_out", "attention output = input of o_proj", "attention", "s b q", src=f"{SRC}: o_proj"),
        *_rmsnorm("ln2", "post_attention_layernorm", "layer"),
        saved("mlp_input", "input of gate_proj and up_proj (one tensor)", "MLP", "s b h", src=f"{SRC}: LlamaMLP"),
        saved("silu_input", "gate projection (SiLU input)", "MLP", "s b f", src=f"{SRC}: LlamaMLP"),
        saved("up_out", "up projection (kept by SiLU(gate) * up)", "MLP", "s b f", src=f"{SRC}: LlamaMLP"),
        saved("silu_out", "SiLU(gate) (kept by SiLU(gate) * up)", "MLP", "s b f", src=f"{SRC}: LlamaMLP"),
        saved("fc2_input", "input of down_proj (SiLU(gate) * up)", "MLP", "s b f", src=f"{SRC}: LlamaMLP"),
    ]
    return terms


TUNE = "torchtune 0.6.1, traced (tests/test_torchtune.py)"


def torchtune_terms(model: ModelSpec, loss_chunks: int = 1) -> list[Term]:
    """torchtune 0.6.1's Llama (TransformerDecoder of the llama3 / 3.1 / 3.2 builders, bf16, sdpa): its
    MultiHeadAttention expands K and V to all a heads before sdpa (saved at full width); its RoPE multiplies
    by a cache buffer (nothing saved); its RMSNorm keeps the normalised input in fp32; its loss keeps the fp32
    log-softmax of all the logits, whole or in `loss_chunks` chunks (memplan/inventory/tune_loss.py).
    Activation checkpointing gives each layer only its input (no mask, no positions)."""
    sd = f"{TUNE}: MultiHeadAttention expands K and V to all heads before scaled_dot_product_attention"
    ff = f"{TUNE}: FeedForward"
    layer = [
        saved("layer_input", "layer input, kept by activation checkpointing", "layer norms", "s b h", only_full=True,
              src=f"{TUNE}: checkpoint saves the layer's input"),
        *_rmsnorm("ln1", "sa_norm", "layer", tune=True),
        saved("qkv_input", "input of q_proj, k_proj, v_proj (one tensor)", "attention", "s b h", src=TUNE),
        saved("q", "Q after RoPE (saved by sdpa)", "attention", "s b q", src=sd),
        saved("k", "K after RoPE, expanded to a heads (saved by sdpa)", "attention", "s b q", src=sd),
        saved("v", "V expanded to a heads (saved by sdpa)", "attention", "s b q", src=sd),
        saved("sdpa_logsumexp", "sdpa log-sum-exp per row and head (fp32)", "attention", "a s b", "fp32", k22=False,
              src=sd),
        saved("attn_out", "attention output = input of output_proj", "attention", "s b q", src=TUNE),
        *_rmsnorm("ln2", "mlp_norm", "layer", tune=True),
        saved("mlp_input", "input of w1 and w3 (one tensor)", "MLP", "s b h", src=ff),
        saved("silu_input", "w1 output (SiLU input)", "MLP", "s b f", src=ff),
        saved("up_out", "w3 output (kept by SiLU(w1 x) * w3 x)", "MLP", "s b f", src=ff),
        saved("silu_out", "SiLU(w1 x) (kept by the product)", "MLP", "s b f", src=ff),
        saved("fc2_input", "input of w2", "MLP", "s b f", src=ff),
    ]
    outside = [
        saved("token_ids", "token ids (int64, tok_embeddings)", "embedding", "s b", "int64", scope="first",
              k22=False, src=TUNE),
        *_rmsnorm("final_norm", "final norm", "last", tune=True),
        saved("head_input", "input of the output projection", "output layer", "s b h", scope="last", src=TUNE),
        *tune_loss_terms(loss_chunks),
    ]
    return layer + outside


def _llama_outside(loss_chunks: int) -> list[Term]:
    return [
        saved("token_ids", "token ids (int64, embed_tokens)", "embedding", "s b", "int64", scope="first", k22=False,
           src=SRC),
        *_rmsnorm("final_norm", "final norm", "last"),
        *_loss_terms(loss_chunks),
    ]


def _loss_terms(chunks: int = 1) -> list[Term]:
    """What the loss keeps for the backward: lm_head's input and the targets; ForCausalLMLoss also
    the fp32 log-softmax of all the logits, a chunked loss (validation/losses.py) nothing more: its
    checkpoint keeps the chunks' inputs, views of the same two tensors."""
    loss = f"{SRC}: ForCausalLMLoss (F.cross_entropy on fp32 logits)"
    head = saved("head_input", "input of lm_head", "output layer", "s b h", scope="last", src=SRC)
    if chunks > 1:
        chunked = f"{STEP} with validation/losses.py chunked_cross_entropy"
        return [head, saved("target_ids", "target ids (int64)", "output layer", "s b", "int64", scope="last",
                         k22=False, src=chunked)]
    return [
        head,
        saved("logits_fp32", "fp32 log-softmax of the logits", "output layer", "s b v", "fp32", scope="last", src=loss),
        saved("target_ids", "shifted target ids (int64)", "output layer", "s b", "int64", scope="last", k22=False,
           src=loss),
        saved("nll_total_weight", "nll_loss total weight (fp32 scalar)", "output layer", "1", "fp32", scope="last",
           k22=False, src=loss),
    ]
