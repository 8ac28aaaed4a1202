"""The config.json readers of the gated-DeltaNet hybrids (issue 22): Qwen3-Next, Qwen3.5 (dense and MoE, their text
configs) and OLMo-hybrid, from transformers' own modelling code (transformers 5.23): each layer a gated DeltaNet
(layer_pattern D, "linear_attention") or full attention (A, "full_attention"), then an MLP; the DeltaNet's widths in
ModelSpec's ssm_* fields (ssm_heads: linear_num_value_heads, ssm_head_dim: linear_value_head_dim, ssm_groups:
linear_num_key_heads, ssm_state_size: linear_key_head_dim, ssm_conv_kernel: linear_conv_kernel_dim; no biases), its
parameters memory/states.py delta_groups. Each is checked by the registry walk (memplan/check/registry.py) against
transformers' parameter count of the model built on the meta device.

``LINEAR_ATTENTION`` gives each family's spec but name, sequence and vocabulary (as hf_hybrids.HYBRIDS, which takes
them in); ``LINEAR_ATTENTION_MOE`` the ones whose experts are read; ``LINEAR_TEXT_MODELS`` the text configs of the
multimodal Qwen3.5 files (hf_config.TEXT_MODELS). Their activations are traced (--impl hf-*; the chunked delta rule's
loop over chunks: validation/trace_fit.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from memplan.core.errors import MemplanError
from memplan.core.spec_base import echo
from memplan.presets.hf_families import YAML_HINT, flag, nat

_KINDS = {"linear_attention": "D", "full_attention": "A"}


def _pattern(data: dict, path: Path, default: Callable[[int], str]) -> str:
    """The layers' kinds as layer_pattern characters: layer_types when the config has it, else the family's default
    (``default``: the layer count -> the pattern)."""
    types = data.get("layer_types")
    if types is None:
        return default(nat(data, "num_hidden_layers", 48, path))
    if not isinstance(types, list) or not types or not all(isinstance(t, str) and t in _KINDS for t in types):
        raise MemplanError(f"{path}: layer_types: expected a list of the layer types {', '.join(sorted(_KINDS))} "
                           f"(got {echo(types)})")
    return "".join(_KINDS[t] for t in types)


def _interval(data: dict, path: Path) -> Callable[[int], str]:
    """Qwen3-Next's and Qwen3.5's default layout: every full_attention_interval-th layer full attention (default 4)."""
    n = nat(data, "full_attention_interval", 4, path)
    return lambda L: "".join("A" if (i + 1) % n == 0 else "D" for i in range(L))


def _width(data: dict, key: str, default: int, path: Path) -> int:
    """A positive-integer field whose null means the config class's default (OLMo-hybrid's derived widths)."""
    return nat(data if data.get(key) is not None else {}, key, default, path)


def _delta(data: dict, path: Path, defaults: tuple[int, int, int, int]) -> dict[str, Any]:
    """The gated DeltaNet's widths (the config class's defaults for missing keys): value heads, their width, key
    heads, their width, and the convolution's width."""
    Hv, dv, Hk, dk = (_width(data, k, d, path) for k, d in zip(
        ("linear_num_value_heads", "linear_value_head_dim", "linear_num_key_heads", "linear_key_head_dim"), defaults))
    if Hv % Hk:
        raise MemplanError(f"{path}: linear_num_value_heads = {Hv} is not divisible by linear_num_key_heads = {Hk}")
    return dict(ssm_heads=Hv, ssm_head_dim=dv, ssm_groups=Hk, ssm_state_size=dk,
                ssm_conv_kernel=nat(data, "linear_conv_kernel_dim", 4, path), ssm_conv_bias=False, ssm_norm=False)


def _qwen_attention(data: dict, path: Path, h: int) -> dict[str, Any]:
    """Qwen3-Next's gated attention (Qwen3.5's too): q_proj twice as wide (the output gate, one value per channel:
    attention_output_gate full), q / k norms per head, head_dim 256; no attention_bias (its gate's bias is not
    counted)."""
    if flag(data, "attention_bias", False, path):
        raise MemplanError(f"{path}: attention_bias with Qwen3-Next's gated q_proj (a bias on the gate too): not "
                           f"counted; {YAML_HINT}")
    return dict(hidden_size=h, num_attention_heads=nat(data, "num_attention_heads", 16, path),
                num_kv_heads=nat(data, "num_key_value_heads", 2, path), head_dim=nat(data, "head_dim", 256, path),
                qk_norm=True, attention_output_gate="full", norm="rmsnorm", position_embedding="rope", bias=False,
                mlp="swiglu", tied_embeddings=flag(data, "tie_word_embeddings", False, path),
                norm_eps=data.get("rms_norm_eps"))


def _experts(data: dict, path: Path, E: int, k: int) -> dict[str, Any]:
    """Qwen3-Next's sparse MoE block: E experts moe_intermediate_size wide (gated), top num_experts_per_tok, a router
    E x h, a shared expert shared_expert_intermediate_size wide behind a sigmoid gate (shared_expert_gate h -> 1)."""
    return dict(num_experts=nat(data, "num_experts", E, path), moe_top_k=nat(data, "num_experts_per_tok", k, path),
                moe_ffn_hidden_size=nat(data, "moe_intermediate_size", 512, path),
                moe_shared_ffn_hidden_size=nat(data, "shared_expert_intermediate_size", 512, path),
                moe_shared_gate=True)


def _qwen3_next(data: dict, path: Path) -> dict[str, Any]:
    """Qwen3NextForCausalLM: gated DeltaNet and gated attention layers (layer_types, else every
    full_attention_interval-th full attention), each with the sparse MoE block where num_experts > 0, the layer is not
    in mlp_only_layers and its number is a multiple of decoder_sparse_step (else a SwiGLU MLP intermediate_size wide:
    layer_pattern d / a)."""
    pattern = _pattern(data, path, _interval(data, path))
    E, step = data.get("num_experts", 512), nat(data, "decoder_sparse_step", 1, path)
    dense_only = data.get("mlp_only_layers") or []
    if not isinstance(dense_only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense_only):
        raise MemplanError(f"{path}: mlp_only_layers: expected a list of layer indices (got {echo(dense_only)})")
    if isinstance(E, bool) or not isinstance(E, int) or E < 0:
        raise MemplanError(f"{path}: num_experts: expected a count of experts, 0 for none (got {echo(E)})")
    spec = dict(_qwen_attention(data, path, nat(data, "hidden_size", 2048, path)), num_layers=len(pattern),
                ffn_hidden_size=nat(data, "intermediate_size", 5632, path),
                **_delta(data, path, (32, 128, 16, 128)))
    moe = [E > 0 and i not in dense_only and (i + 1) % step == 0 for i in range(len(pattern))]
    if not any(moe):
        return dict(spec, layer_pattern=pattern)
    return dict(spec, layer_pattern="".join(c if m else c.lower() for c, m in zip(pattern, moe)),
                **_experts(data, path, 512, 10))


def _qwen3_5(data: dict, path: Path) -> dict[str, Any]:
    """Qwen3_5ForCausalLM (the text model, Qwen3_5TextConfig): Qwen3-Next's layers with a SwiGLU MLP
    intermediate_size wide in every layer (the DeltaNet's projections as in_proj_qkv, in_proj_z, in_proj_b, in_proj_a:
    the same widths)."""
    pattern = _pattern(data, path, _interval(data, path))
    return dict(_qwen_attention(data, path, nat(data, "hidden_size", 4096, path)), num_layers=len(pattern),
                layer_pattern=pattern, ffn_hidden_size=nat(data, "intermediate_size", 12288, path),
                **_delta(data, path, (32, 128, 16, 128)))


def _qwen3_5_moe(data: dict, path: Path) -> dict[str, Any]:
    """Qwen3_5MoeForCausalLM (the text model, Qwen3_5MoeTextConfig): Qwen3.5's layers, each with Qwen3-Next's sparse
    MoE block (no dense layers)."""
    pattern = _pattern(data, path, _interval(data, path))
    return dict(_qwen_attention(data, path, nat(data, "hidden_size", 2048, path)), num_layers=len(pattern),
                layer_pattern=pattern, **_delta(data, path, (32, 128, 16, 128)), **_experts(data, path, 256, 8))


def _olmo_hybrid(data: dict, path: Path) -> dict[str, Any]:
    """OlmoHybridForCausalLM: gated DeltaNet layers (pre-norm; q, k, v, a, b, g projections apart) and OLMo-3's
    attention layers (post-norms; q / k norms over the whole Q and K, attention_bias on q, k, v, o), each with a SwiGLU
    MLP intermediate_size wide; the defaults: every fourth layer attention (the last one when there is none), the
    DeltaNet's heads num_attention_heads, keys 0.75 h / heads wide, values twice that."""
    h, a = nat(data, "hidden_size", 3840, path), nat(data, "num_attention_heads", 30, path)

    def default(L: int) -> str:
        pattern = "".join("A" if i % 4 == 3 else "D" for i in range(L))
        return pattern if "A" in pattern else pattern[:-1] + "A"

    pattern = _pattern(data, path, default)
    Hk = _width(data, "linear_num_key_heads", a, path)
    dk = _width(data, "linear_key_head_dim", int(0.75 * h / Hk), path)
    return dict(num_layers=len(pattern), hidden_size=h, num_attention_heads=a, layer_pattern=pattern,
                num_kv_heads=data.get("num_key_value_heads"), head_dim=data.get("head_dim"), qk_norm=True,
                qk_norm_width="full", attention_bias=flag(data, "attention_bias", False, path), norm="rmsnorm",
                position_embedding="rope", bias=False, mlp="swiglu",
                ffn_hidden_size=nat(data, "intermediate_size", 11008, path),
                tied_embeddings=flag(data, "tie_word_embeddings", False, path), norm_eps=data.get("rms_norm_eps"),
                **_delta(data, path, (a, 2 * dk, Hk, dk)))


LINEAR_ATTENTION: dict[str, Callable[[dict, Path], dict[str, Any]]] = {
    "Qwen3NextForCausalLM": _qwen3_next, "Qwen3_5ForCausalLM": _qwen3_5, "Qwen3_5MoeForCausalLM": _qwen3_5_moe,
    "OlmoHybridForCausalLM": _olmo_hybrid,
}
LINEAR_ATTENTION_MOE = ("Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM")
# the multimodal Qwen3.5 files' text_config (Qwen3_5ForConditionalGeneration): its model_type -> the causal LM read
LINEAR_TEXT_MODELS = {"qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}
