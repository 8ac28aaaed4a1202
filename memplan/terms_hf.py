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

from memplan.errors import MemplanError
from memplan.specs import Config, ModelSpec, Recompute
from memplan.terms import Dtype, Term, _t

SRC = "transformers 5.23.0, measured (validation/hf.py)"


def check_hf_plan(config: Config, impl: str) -> None:
    """transformers runs a model on one device per replica: refuse what it cannot launch."""
    par, tr = config.parallel, config.training
    if par.tp > 1 or par.pp > 1:
        raise MemplanError(f"--impl {impl}: transformers models have no tensor or pipeline parallelism "
                           "(use t = p = 1 with data parallelism / ZeRO, or --impl megatron)")
    if tr.recompute == Recompute.SELECTIVE:
        raise MemplanError(f"--impl {impl}: transformers has no selective recompute (gradient checkpointing "
                           "recomputes whole layers: --recompute full)")


def hf_inventory(model: ModelSpec, impl: str, device: str) -> list[Term]:
    layout = "gpt2" if (model.norm == "layernorm" and model.mlp == "gelu") else "llama"
    if layout == "llama" and not (model.norm == "rmsnorm" and model.mlp == "swiglu"):
        raise MemplanError("--impl hf-*: memplan knows the GPT-2 layout (LayerNorm, GeLU) and the Llama "
                           "layout (RMSNorm, SwiGLU)")
    mask: Dtype = "mask" if device == "cuda" else "act"  # F.dropout: native_dropout on CUDA only
    sdpa = impl == "hf-sdpa"
    if sdpa and model.dropout and device == "cpu":
        raise MemplanError("hf-sdpa with dropout on CPU runs torch's fp32 math kernel, which memplan does not "
                           "model; use dropout 0 or --impl hf-eager")
    if layout == "gpt2":
        return _gpt2_layer(model, sdpa, mask, device) + _gpt2_outside(model, mask, device)
    return _llama_layer(model, sdpa, mask) + _llama_outside()


def _gpt2_layer(model: ModelSpec, sdpa: bool, mask: Dtype, device: str) -> list[Term]:
    stats: Dtype = "fp32" if device == "cuda" else "act"
    ln = "GPT2Block.ln_1/ln_2 (native_layer_norm)"
    terms = [
        _t("ln1_input", "input of ln_1 (the layer input)", "layer norms", "s b h", full=True, src=f"{SRC}: {ln}"),
        _t("ln1_stats", "ln_1 mean and rstd", "layer norms", "2 s b", stats, k22=False, src=f"{SRC}: {ln}"),
        _t("qkv_input", "input of c_attn (the QKV projection)", "attention", "s b h", src=f"{SRC}: Conv1D addmm"),
    ]
    if sdpa:
        terms += [
            _t("qkv", "Q, K, V (views of one c_attn output, saved by sdpa)", "attention", "3 s b h",
               src=f"{SRC}: scaled_dot_product_attention"),
            _t("sdpa_logsumexp", "sdpa log-sum-exp per row and head (fp32)", "attention", "a s b", "fp32",
               k22=False, src=f"{SRC}: scaled_dot_product_attention"),
        ]
    else:
        terms += [
            _t("k", "K (copied for the QK^T matmul)", "attention", "s b h", src=f"{SRC}: eager_attention_forward"),
            _t("q", "Q (copied for the QK^T matmul)", "attention", "s b h", src=f"{SRC}: eager_attention_forward"),
            _t("softmax_out", "softmax output", "attention", "a s^2 b", src=f"{SRC}: eager_attention_forward"),
        ]
        if model.dropout:
            terms += [
                _t("softmax_dropout_mask", "attention dropout mask", "attention", "a s^2 b", mask,
                   src=f"{SRC}: attn_dropout"),
                _t("attn_probs", "attention dropout output (saved by attention over V)", "attention", "a s^2 b",
                   src=f"{SRC}: eager_attention_forward"),
            ]
        terms.append(_t("v", "V (saved by attention over V)", "attention", "s b h",
                        src=f"{SRC}: eager_attention_forward"))
    terms.append(_t("attn_out", "attention output = input of c_proj", "attention", "s b h", src=f"{SRC}: c_proj"))
    if model.dropout:
        terms.append(_t("attn_dropout_mask", "resid_dropout mask after attention", "attention", "s b h", mask,
                        src=f"{SRC}: resid_dropout"))
    terms += [
        _t("ln2_input", "input of ln_2", "layer norms", "s b h", src=f"{SRC}: {ln}"),
        _t("ln2_stats", "ln_2 mean and rstd", "layer norms", "2 s b", stats, k22=False, src=f"{SRC}: {ln}"),
        _t("mlp_input", "input of c_fc", "MLP", "s b h", src=f"{SRC}: Conv1D addmm"),
        _t("gelu_input", "GeLU input x (kept by x**3)", "MLP", "s b f", src=f"{SRC}: NewGELUActivation"),
        _t("gelu_tanh_out", "tanh(...) inside GeLU", "MLP", "s b f", k22=False, src=f"{SRC}: NewGELUActivation"),
        _t("gelu_one_plus_tanh", "1 + tanh(...) inside GeLU", "MLP", "s b f", k22=False,
           src=f"{SRC}: NewGELUActivation"),
        _t("gelu_half_x", "0.5 * x inside GeLU", "MLP", "s b f", k22=False, src=f"{SRC}: NewGELUActivation"),
        _t("fc2_input", "input of the MLP c_proj (GeLU output)", "MLP", "s b f", src=f"{SRC}: Conv1D addmm"),
    ]
    if model.dropout:
        terms.append(_t("mlp_dropout_mask", "dropout mask after the MLP", "MLP", "s b h", mask,
                        src=f"{SRC}: GPT2MLP.dropout"))
    return terms


def _gpt2_outside(model: ModelSpec, mask: Dtype, device: str) -> list[Term]:
    stats: Dtype = "fp32" if device == "cuda" else "act"
    terms = [
        _t("token_ids", "token ids (int64, wte)", "embedding", "s b", "int64", scope="first", k22=False, src=SRC),
        _t("position_ids", "position ids (int64, wpe, one row)", "embedding", "s", "int64", scope="first",
           k22=False, src=SRC),
    ]
    if model.dropout:
        terms.append(_t("embedding_dropout_mask", "embedding dropout mask", "embedding", "s b h", mask,
                        scope="first", src=SRC))
    return terms + [
        _t("final_ln_input", "input of ln_f", "output layer", "s b h", scope="last", src=SRC),
        _t("final_ln_stats", "ln_f mean and rstd", "output layer", "2 s b", stats, scope="last", k22=False, src=SRC),
        *_loss_terms(),
    ]


def _rmsnorm(prefix: str, which: str, scope: str) -> list[Term]:
    src = f"{SRC}: LlamaRMSNorm computes in fp32"
    return [
        _t(f"{prefix}_fp32_input", f"{which}: fp32 copy of its input", "layer norms", "s b h", "fp32",
           scope=scope, k22=False, src=src),
        _t(f"{prefix}_rstd", f"{which}: rstd (fp32)", "layer norms", "s b", "fp32", scope=scope, k22=False, src=src),
        _t(f"{prefix}_normed", f"{which}: normalised input before the weight (bf16)", "layer norms", "s b h",
           scope=scope, src=src),
    ]


def _llama_layer(model: ModelSpec, sdpa: bool, mask: Dtype) -> list[Term]:
    attn = f"{SRC}: eager_attention_forward"
    terms = [
        _t("layer_input", "layer input, kept by gradient checkpointing", "layer norms", "s b h", only_full=True,
           src=f"{SRC}: checkpoint saves the decoder layer's input"),
        *_rmsnorm("ln1", "input_layernorm", "layer"),
        _t("qkv_input", "input of q_proj, k_proj, v_proj (one tensor)", "attention", "s b h", src=f"{SRC}: q_proj"),
        _t("rope_cos", "rotary cos table (shared by the layers)", "attention", "s h /a", scope="chunk", k22=False,
           src=f"{SRC}: apply_rotary_pos_emb"),
        _t("rope_sin", "rotary sin table (shared by the layers)", "attention", "s h /a", scope="chunk", k22=False,
           src=f"{SRC}: apply_rotary_pos_emb"),
    ]
    if sdpa:
        sd = f"{SRC}: scaled_dot_product_attention (enable_gqa: K and V keep g heads)"
        terms += [
            _t("q", "Q after rotary (saved by sdpa)", "attention", "s b h", src=sd),
            _t("k", "K after rotary, g heads (saved by sdpa)", "attention", "s b h g /a", src=sd),
            _t("v", "V, g heads (saved by sdpa)", "attention", "s b h g /a", src=sd),
            _t("sdpa_logsumexp", "sdpa log-sum-exp per row and head (fp32)", "attention", "a s b", "fp32",
               k22=False, src=sd),
        ]
    else:
        terms += [
            _t("k", "K after rotary, repeated to a heads (QK^T)", "attention", "s b h", src=attn),
            _t("q", "Q after rotary (QK^T)", "attention", "s b h", src=attn),
            _t("softmax_out", "softmax output (fp32)", "attention", "a s^2 b", "fp32", src=attn),
        ]
        if model.dropout:
            terms.append(_t("softmax_dropout_mask", "attention dropout mask", "attention", "a s^2 b", mask,
                            src=attn))
        terms += [
            _t("attn_probs", "attention weights in bf16 (saved by attention over V)", "attention", "a s^2 b",
               src=attn),
            _t("v", "V repeated to a heads (attention over V)", "attention", "s b h", src=attn),
        ]
    terms += [
        _t("attn_out", "attention output = input of o_proj", "attention", "s b h", src=f"{SRC}: o_proj"),
        *_rmsnorm("ln2", "post_attention_layernorm", "layer"),
        _t("mlp_input", "input of gate_proj and up_proj (one tensor)", "MLP", "s b h", src=f"{SRC}: LlamaMLP"),
        _t("silu_input", "gate projection (SiLU input)", "MLP", "s b f", src=f"{SRC}: LlamaMLP"),
        _t("up_out", "up projection (kept by SiLU(gate) * up)", "MLP", "s b f", src=f"{SRC}: LlamaMLP"),
        _t("silu_out", "SiLU(gate) (kept by SiLU(gate) * up)", "MLP", "s b f", src=f"{SRC}: LlamaMLP"),
        _t("fc2_input", "input of down_proj (SiLU(gate) * up)", "MLP", "s b f", src=f"{SRC}: LlamaMLP"),
    ]
    return terms


def _llama_outside() -> list[Term]:
    return [
        _t("token_ids", "token ids (int64, embed_tokens)", "embedding", "s b", "int64", scope="first", k22=False,
           src=SRC),
        *_rmsnorm("final_norm", "final norm", "last"),
        *_loss_terms(),
    ]


def _loss_terms() -> list[Term]:
    loss = f"{SRC}: ForCausalLMLoss (F.cross_entropy on fp32 logits)"
    return [
        _t("head_input", "input of lm_head", "output layer", "s b h", scope="last", src=SRC),
        _t("logits_fp32", "fp32 log-softmax of the logits", "output layer", "s b v", "fp32", scope="last", src=loss),
        _t("target_ids", "shifted target ids (int64)", "output layer", "s b", "int64", scope="last", k22=False,
           src=loss),
        _t("nll_total_weight", "nll_loss total weight (fp32 scalar)", "output layer", "1", "fp32", scope="last",
           k22=False, src=loss),
    ]
