"""The config.json readers of the state-space hybrids with Mamba-2 mixers (issue 22): Mamba-2, Bamba, Nemotron-H,
Granite 4 hybrids (granitemoehybrid), Falcon-H1 and Zamba 2 (its shared attention blocks: ModelSpec.shared_*), and
of the short-convolution hybrids LFM2, LFM2-MoE and LFM3, from transformers' own modelling code (transformers
5.23): each layer's blocks as ModelSpec.layer_pattern (from the config's own pattern fields) and the mixer's
widths; each checked by the registry walk (memplan/check/registry.py) against transformers' parameter count of the
model on the meta device.

``HYBRIDS`` gives each family's whole spec but name, sequence and vocabulary (as hf_own_keys.OWN_KEYS); their
activations are traced (--impl hf-*: memplan/inventory/traced.py hybrid_note says what that leaves out)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from memplan.core.errors import MemplanError
from memplan.core.spec_base import echo
from memplan.presets.hf_families import YAML_HINT, flag, layer_types, nat
from memplan.presets.hf_linear_attention import LINEAR_ATTENTION, LINEAR_ATTENTION_MOE
from memplan.presets.hf_mamba1 import MAMBA1
from memplan.presets.hf_recurrent import RECURRENT

# transformers' layer-type names (and their legacy spellings, configuration_utils._LEGACY_LAYER_TYPE_REMAP) as the
# blocks of a layer with an MLP (Bamba, Granite 4) and of Nemotron-H's one-block layers (its hybrid_override_pattern)
_TWO_BLOCKS = {"linear_attention": "S", "mamba": "S", "full_attention": "A", "attention": "A"}
_NEMOTRON_LEGACY = {"n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv", "use_conv_bias": "mamba_conv_bias"}
_ONE_BLOCK = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-", "moe": "E"}


def _mixer(data: dict, path: Path, heads: str, head_dim: str, state: str, groups: str, conv: str,
           defaults: tuple[int, int, int, int, int]) -> dict[str, Any]:
    """The Mamba-2 mixer's widths under a family's key names (its config class's defaults for missing keys)."""
    keys = (heads, head_dim, state, groups, conv)
    H, P, N, G, K = (nat(data, k, d, path) for k, d in zip(keys, defaults))
    if H % G:
        raise MemplanError(f"{path}: {heads} = {H} is not divisible by {groups} = {G}")
    return dict(ssm_heads=H, ssm_head_dim=P, ssm_state_size=N, ssm_groups=G, ssm_conv_kernel=K)


def _attention(data: dict, path: Path) -> dict[str, Any]:
    """The attention and norm fields the hybrids name as Llama does."""
    return dict(num_attention_heads=nat(data, "num_attention_heads", 32, path),
                num_kv_heads=data.get("num_key_value_heads"), norm="rmsnorm", position_embedding="rope", bias=False,
                tied_embeddings=flag(data, "tie_word_embeddings", False, path))


def _mamba2(data: dict, path: Path) -> dict[str, Any]:
    """Mamba2ForCausalLM: every layer a norm and a mixer (no attention, no MLP); use_bias on in_proj and out_proj."""
    L, h = nat(data, "num_hidden_layers", 64, path), nat(data, "hidden_size", 4096, path)
    bias = flag(data, "use_bias", False, path)
    return dict(num_layers=L, hidden_size=h, num_attention_heads=1, norm="rmsnorm", position_embedding="rope", bias=False,
                tied_embeddings=flag(data, "tie_word_embeddings", False, path), layer_pattern="M" * L,
                ssm_conv_bias=flag(data, "use_conv_bias", True, path), ssm_proj_bias=bias, ssm_out_bias=bias,
                norm_eps=data.get("layer_norm_epsilon"),
                **_mixer(data, path, "num_heads", "head_dim", "state_size", "n_groups", "conv_kernel",
                         (128, 64, 128, 8, 4)))


def _bamba_like(data: dict, path: Path, pattern: str) -> dict[str, Any]:
    """Bamba and Granite 4's shared fields: attention and MLP with attention_bias / mlp_bias, a mixer with
    mamba_proj_bias on in_proj and out_proj."""
    bias = flag(data, "mamba_proj_bias", False, path)
    return dict(num_layers=len(pattern), hidden_size=nat(data, "hidden_size", 4096, path), layer_pattern=pattern,
                attention_bias=flag(data, "attention_bias", False, path), mlp_bias=flag(data, "mlp_bias", False, path),
                ssm_conv_bias=flag(data, "mamba_conv_bias", True, path), ssm_proj_bias=bias, ssm_out_bias=bias,
                norm_eps=data.get("rms_norm_eps"), **_attention(data, path),
                **_mixer(data, path, "mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv",
                         (128, 64, 256, 1, 4)))


def _bamba(data: dict, path: Path) -> dict[str, Any]:
    """BambaForCausalLM: each layer a mixer or attention (attn_layer_indices), then a gated MLP intermediate_size
    wide; two norms per layer."""
    L = nat(data, "num_hidden_layers", 32, path)
    attention = data.get("attn_layer_indices") or []
    if not isinstance(attention, list) or not all(isinstance(i, int) and 0 <= i < L for i in attention):
        raise MemplanError(f"{path}: attn_layer_indices: expected layer indices below {L} (got {echo(attention)})")
    pattern = "".join("A" if i in attention else "S" for i in range(L))
    return dict(_bamba_like(data, path, pattern), ffn_hidden_size=nat(data, "intermediate_size", 14336, path),
                mlp="swiglu")


def _granite_hybrid(data: dict, path: Path) -> dict[str, Any]:
    """GraniteMoeHybridForCausalLM: each layer a mixer or attention (layer_types), then the experts
    (num_local_experts of intermediate_size, gated, a router without bias) beside a gated shared MLP
    shared_intermediate_size wide; with no experts the shared MLP alone (the model's MLP)."""
    spec = _bamba_like(data, path, layer_types(data, "layer_types", _TWO_BLOCKS, path))
    E, shared = data.get("num_local_experts", 8), nat(data, "shared_intermediate_size", 1024, path)
    if E:
        return dict(spec, mlp="swiglu", num_experts=nat(data, "num_local_experts", 8, path),
                    moe_top_k=nat(data, "num_experts_per_tok", 2, path),
                    ffn_hidden_size=nat(data, "intermediate_size", 11008, path), moe_shared_ffn_hidden_size=shared)
    return dict(spec, mlp="swiglu", ffn_hidden_size=shared)


def _nemotron_h(data: dict, path: Path) -> dict[str, Any]:
    """NemotronHForCausalLM: one block per layer (layers_block_type, or the Hub files' hybrid_override_pattern: M
    mixer, * attention, - MLP, E experts), each after one norm; plain (relu2) MLPs: the dense one intermediate_size
    wide, the experts moe_intermediate_size with a shared one moe_shared_expert_intermediate_size; attention and
    mixer without biases but use_bias on in_proj / out_proj."""
    if isinstance(data.get("hybrid_override_pattern"), str) and not data.get("layers_block_type"):
        pattern = data["hybrid_override_pattern"]
        if not pattern or set(pattern) - set("M*-E"):
            raise MemplanError(f"{path}: hybrid_override_pattern: expected the characters M, *, - and E "
                               f"(got {echo(pattern)})")
    else:
        pattern = layer_types(data, "layers_block_type", _ONE_BLOCK, path)
    if data.get("moe_latent_size") is not None:
        raise MemplanError(f"{path}: Nemotron-H with moe_latent_size (the experts in a latent space): not modelled; "
                           f"{YAML_HINT}")
    if "E" in pattern and flag(data, "mlp_bias", False, path):
        raise MemplanError(f"{path}: Nemotron-H with experts and mlp_bias (biases on the shared expert's linears): not "
                           f"counted; {YAML_HINT}")
    # NemotronHConfig takes the Hub files' older names over the new ones (mamba_n_groups over n_groups, ...)
    data = {**data, **{new: data[old] for new, old in _NEMOTRON_LEGACY.items() if old in data}}
    bias = flag(data, "use_bias", False, path)
    moe = dict(num_experts=nat(data, "n_routed_experts", 8, path), moe_top_k=nat(data, "num_experts_per_tok", 2, path),
               moe_ffn_hidden_size=nat(data, "moe_intermediate_size", 7688, path),
               moe_shared_ffn_hidden_size=nat(data, "moe_shared_expert_intermediate_size", 7688, path)
               ) if "E" in pattern else {}
    return dict(num_layers=len(pattern), hidden_size=nat(data, "hidden_size", 4096, path), layer_pattern=pattern,
                head_dim=nat(data, "head_dim", 128, path), mlp="gelu",
                ffn_hidden_size=nat(data, "intermediate_size", 21504, path), mlp_bias=flag(data, "mlp_bias", False, path),
                ssm_conv_bias=flag(data, "use_conv_bias", True, path), ssm_proj_bias=bias,
                ssm_out_bias=bias, norm_eps=data.get("layer_norm_epsilon"), **_attention(data, path), **moe,
                **_mixer(data, path, "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel",
                         (128, 64, 128, 8, 4)))


def _falcon_h1(data: dict, path: Path) -> dict[str, Any]:
    """FalconH1ForCausalLM: every layer attention and a mixer in parallel after one norm, then a gated MLP after
    another; the mixer mamba_d_ssm wide (else mamba_expand h), mamba_proj_bias on in_proj, projectors_bias on
    out_proj, its gated norm only with mamba_rms_norm."""
    h = nat(data, "hidden_size", 4096, path)
    mixer = _mixer(data, path, "mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv",
                   (128, 64, 256, 1, 4))
    width = data.get("mamba_d_ssm") or data.get("mamba_expand", 2) * h
    if width != mixer["ssm_heads"] * mixer["ssm_head_dim"]:
        raise MemplanError(f"{path}: mamba_d_ssm (or mamba_expand x hidden_size) = {echo(width)} is not mamba_n_heads "
                           f"x mamba_d_head = {mixer['ssm_heads'] * mixer['ssm_head_dim']}: not modelled; {YAML_HINT}")
    L = nat(data, "num_hidden_layers", 32, path)
    return dict(num_layers=L, hidden_size=h, layer_pattern="P" * L, mlp="swiglu",
                ffn_hidden_size=nat(data, "intermediate_size", 14336, path), head_dim=data.get("head_dim"),
                attention_bias=flag(data, "attention_bias", False, path), mlp_bias=flag(data, "mlp_bias", False, path),
                ssm_conv_bias=flag(data, "mamba_conv_bias", True, path),
                ssm_proj_bias=flag(data, "mamba_proj_bias", False, path),
                ssm_out_bias=flag(data, "projectors_bias", False, path),
                ssm_norm=flag(data, "mamba_rms_norm", False, path), norm_eps=data.get("rms_norm_eps"),
                **_attention(data, path), **mixer)


def _lfm2_width(data: dict, path: Path) -> int:
    """Lfm2MLP's width: intermediate_size (the Hub files' block_ff_dim), with block_auto_adjust_ff_dim two thirds of
    it, times block_ffn_dim_multiplier (a number: Lfm2Config refuses None), rounded up to block_multiple_of."""
    f = nat(data, "block_ff_dim", 0, path) if "block_ff_dim" in data else nat(data, "intermediate_size", 12288, path)
    if not flag(data, "block_auto_adjust_ff_dim", True, path):
        return f
    f, multiplier = int(2 * f / 3), data.get("block_ffn_dim_multiplier", 1.0)
    if isinstance(multiplier, bool) or not isinstance(multiplier, (int, float)) or multiplier <= 0:
        raise MemplanError(f"{path}: block_ffn_dim_multiplier: expected a positive number (got {echo(multiplier)})")
    m = nat(data, "block_multiple_of", 256, path)
    return m * ((int(multiplier * f) + m - 1) // m)


def _lfm2(data: dict, path: Path) -> dict[str, Any]:
    """Lfm2ForCausalLM: each layer attention (with head-wide q / k norms) or a gated short convolution (layer_types,
    else full_attn_idxs: the others are "conv"), then a SwiGLU MLP (w1, w3, w2) after its own norm; conv_bias on the
    convolution's in_proj, conv1d and out_proj; the final norm is its embedding_norm; embeddings tied (the Hub files'
    tie_embedding)."""
    L = nat(data, "num_hidden_layers", 32, path)
    if data.get("layer_types") is None:
        attention = data.get("full_attn_idxs")
        attention = list(range(L)) if attention is None else attention
        if not isinstance(attention, list) or not all(isinstance(i, int) and 0 <= i < L for i in attention):
            raise MemplanError(f"{path}: full_attn_idxs: expected layer indices below {L} (got {echo(attention)})")
        pattern = "".join("A" if i in attention else "C" for i in range(L))
    else:
        pattern = layer_types(data, "layer_types", {"full_attention": "A", "conv": "C"}, path)
    bias = flag(data, "conv_bias", False, path)
    tied = flag(data, "tie_embedding", True, path) if "tie_embedding" in data else flag(data, "tie_word_embeddings",
                                                                                        True, path)
    return dict(_attention(data, path), num_layers=len(pattern), hidden_size=nat(data, "hidden_size", 2560, path),
                layer_pattern=pattern, qk_norm=True, mlp="swiglu", ffn_hidden_size=_lfm2_width(data, path),
                ssm_conv_kernel=nat(data, "conv_L_cache", 3, path), ssm_conv_bias=bias, ssm_proj_bias=bias,
                ssm_out_bias=bias, norm_eps=data.get("norm_eps"), tied_embeddings=tied)


def _lfm2_moe(data: dict, path: Path) -> dict[str, Any]:
    """Lfm2MoeForCausalLM: LFM2's layers (layer_types, which Lfm2MoeConfig needs: it fills none), the first
    num_dense_layers with a SwiGLU MLP intermediate_size wide (layer_pattern a / c), the others num_experts experts
    moe_intermediate_size wide, top num_experts_per_tok, a router E x h without bias (its expert_bias is a buffer)."""
    pattern = layer_types(data, "layer_types", {"full_attention": "A", "conv": "C"}, path)
    dense = data.get("num_dense_layers", 2)
    if isinstance(dense, bool) or not isinstance(dense, int) or not 0 <= dense <= len(pattern):
        raise MemplanError(f"{path}: num_dense_layers: expected a layer count from 0 to {len(pattern)} "
                           f"(got {echo(dense)})")
    bias = flag(data, "conv_bias", False, path)
    return dict(_attention(data, path), num_layers=len(pattern), hidden_size=nat(data, "hidden_size", 2048, path),
                layer_pattern=pattern[:dense].lower() + pattern[dense:], qk_norm=True, mlp="swiglu",
                ffn_hidden_size=nat(data, "intermediate_size", 7168, path),
                num_experts=nat(data, "num_experts", 32, path), moe_top_k=nat(data, "num_experts_per_tok", 4, path),
                moe_ffn_hidden_size=nat(data, "moe_intermediate_size", 1792, path),
                ssm_conv_kernel=nat(data, "conv_L_cache", 3, path), ssm_conv_bias=bias, ssm_proj_bias=bias,
                ssm_out_bias=bias, norm_eps=data.get("norm_eps"),
                tied_embeddings=flag(data, "tie_embedding", True, path) if "tie_embedding" in data else
                flag(data, "tie_word_embeddings", True, path))


def _lfm3(data: dict, path: Path) -> dict[str, Any]:
    """Lfm3ForCausalLM: LFM2's layers (layer_types; the defaults' every fourth from the third full attention, every
    fourth from the fifth sliding-window attention, the others short convolutions conv_L_cache wide) with Qwen3's
    attention (head_dim, attention_bias, head-wide q / k norms) and a sigmoid gate per head (use_attention_gate: g_proj
    h x a), sandwich norms (use_sandwich_norm: a norm after each block too) and a SwiGLU MLP intermediate_size wide.
    The sliding window changes no parameter; its activations are the trace's."""
    L = nat(data, "num_hidden_layers", 24, path)
    if data.get("layer_types") is None:
        pattern = "".join("A" if i % 4 == 2 or (i % 4 == 0 and i) else "C" for i in range(L))
    else:
        pattern = layer_types(data, "layer_types", {"full_attention": "A", "sliding_attention": "A", "conv": "C"}, path)
    bias = flag(data, "conv_bias", False, path)
    return dict(_attention(data, path), num_layers=len(pattern), hidden_size=nat(data, "hidden_size", 2048, path),
                layer_pattern=pattern, qk_norm=True, head_dim=nat(data, "head_dim", 128, path), mlp="swiglu",
                ffn_hidden_size=nat(data, "intermediate_size", 7680, path),
                attention_bias=flag(data, "attention_bias", False, path),
                attention_output_gate="head" if flag(data, "use_attention_gate", True, path) else None,
                sandwich_norms=flag(data, "use_sandwich_norm", True, path),
                ssm_conv_kernel=nat(data, "conv_L_cache", 7, path), ssm_conv_bias=bias, ssm_proj_bias=bias,
                ssm_out_bias=bias, norm_eps=data.get("norm_eps"),
                tied_embeddings=flag(data, "tie_word_embeddings", True, path))


# Zamba2Config's own layout when the file has no layers_block_type (54 layers, whatever num_hidden_layers says)
_ZAMBA2_LAYOUT = "M" + "MMMMMY" * 7 + "MMMM" + "Y" + "MMM" + "Y" + "MM"


def _zamba2(data: dict, path: Path) -> dict[str, Any]:
    """Zamba2ForCausalLM: every layer a norm and a Mamba-2 mixer of n_mamba_heads heads (I = mamba_expand x h, its
    convolution's bias always on), the "hybrid" ones (layers_block_type) after a use of one of num_mem_blocks shared
    attention + gated MLP blocks in turn (over [x, embedding], 2 h wide, heads 2 h / a wide: Zamba2Config sets
    attention_hidden_size and attention_head_dim so, whatever the file says), its own h x h linear and its LoRA
    adapters (adapter_rank: on gate_up always, on q / k / v with use_shared_attention_adapter); use_mem_rope's rotary
    embedding has no parameters (the trace follows it); no biases; embeddings tied by default."""
    h, a = nat(data, "hidden_size", 2560, path), nat(data, "num_attention_heads", 32, path)
    if flag(data, "add_bias_linear", False, path):
        raise MemplanError(f"{path}: add_bias_linear (biases on the mixers' and MLPs' linears): not modelled; "
                           f"{YAML_HINT}")
    pattern = _ZAMBA2_LAYOUT if data.get("layers_block_type") is None else layer_types(
        data, "layers_block_type", {"linear_attention": "M", "mamba": "M", "hybrid": "Y"}, path)
    ids, uses = data.get("hybrid_layer_ids"), [i for i, c in enumerate(pattern) if c == "Y"]
    if ids is not None and uses and ids != uses:  # the block's adapters are indexed by them: a KeyError in forward
        raise MemplanError(f"{path}: hybrid_layer_ids: expected the hybrid layers of layers_block_type, {uses} "
                           f"(got {echo(ids)})")
    if uses and not flag(data, "tie_word_embeddings", True, path):  # modeling_utils: no tie_word_embeddings, no ties
        raise MemplanError(f"{path}: tie_word_embeddings false: transformers then unties the shared blocks too (each "
                           f"hybrid layer its own copy): not modelled; {YAML_HINT}")
    expand = data.get("mamba_expand", 2)
    if isinstance(expand, bool) or not isinstance(expand, (int, float)) or int(expand * h) <= 0:
        raise MemplanError(f"{path}: mamba_expand: expected a positive number (got {echo(expand)})")
    heads, width = nat(data, "n_mamba_heads", 8, path), int(expand * h)
    if width % heads:
        raise MemplanError(f"{path}: mamba_expand x hidden_size = {width} is not divisible by n_mamba_heads = "
                           f"{heads}")
    mixer = _mixer({**data, "n_mamba_heads": heads, "head_dim": width // heads}, path, "n_mamba_heads", "head_dim",
                   "mamba_d_state", "mamba_ngroups", "mamba_d_conv", (8, 64, 64, 1, 4))
    act = data.get("hidden_act", "gelu")
    return dict(num_layers=len(pattern), hidden_size=h, layer_pattern=pattern, num_attention_heads=a,
                num_kv_heads=data.get("num_key_value_heads"), head_dim=2 * h // a, norm="rmsnorm",
                position_embedding="rope", bias=False, mlp="swiglu",
                gate_activation="gelu" if isinstance(act, str) and act.startswith("gelu") else "silu",
                ffn_hidden_size=data.get("intermediate_size") or 4 * h, norm_eps=data.get("rms_norm_eps"),
                tied_embeddings=flag(data, "tie_word_embeddings", True, path), ssm_conv_bias=True,
                shared_blocks=nat(data, "num_mem_blocks", 1, path),
                shared_adapter_rank=nat(data, "adapter_rank", 128, path),
                shared_attention_adapter=flag(data, "use_shared_attention_adapter", False, path), **mixer)


HYBRIDS: dict[str, Callable[[dict, Path], dict[str, Any]]] = {
    "Mamba2ForCausalLM": _mamba2, "BambaForCausalLM": _bamba, "NemotronHForCausalLM": _nemotron_h,
    "GraniteMoeHybridForCausalLM": _granite_hybrid, "FalconH1ForCausalLM": _falcon_h1, "Lfm2ForCausalLM": _lfm2,
    "Lfm2MoeForCausalLM": _lfm2_moe, "Lfm3ForCausalLM": _lfm3, "Zamba2ForCausalLM": _zamba2,
    **MAMBA1,  # Mamba-1 mixers: hf_mamba1.py
    **LINEAR_ATTENTION,  # the gated-DeltaNet hybrids: hf_linear_attention.py
    **RECURRENT,  # RecurrentGemma's RG-LRU blocks: hf_recurrent.py
}

# the hybrids whose experts HYBRIDS reads (hf_config refuses experts it does not read; Doge's num_experts is unused
# without is_moe, which its reader refuses)
HYBRID_MOE = ("NemotronHForCausalLM", "GraniteMoeHybridForCausalLM", "Lfm2MoeForCausalLM", "JambaForCausalLM",
              "JetMoeForCausalLM", "DogeForCausalLM", *LINEAR_ATTENTION_MOE)
