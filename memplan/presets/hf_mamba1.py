"""The config.json readers of the models with Mamba-1 mixers (issue 22): Mamba, Falcon-Mamba, Jamba and Zamba, from
transformers' own modelling code (transformers 5.23: MambaMixer, FalconMambaMixer, JambaMambaMixer, ZambaMambaMixer):
each layer's blocks as ModelSpec.layer_pattern (1: a mixer alone, J / j: a mixer beside Jamba's experts / dense MLP,
A / a: attention beside them, Z: a mixer after a use of Zamba's shared block; core/hybrid.py) and the mixer's widths
(ssm_heads 1, Zamba's n_mamba_heads; ssm_head_dim its width I = expand h over the heads; ssm_dt_rank R); each
checked by the registry walk (memplan/check/registry.py) against transformers' parameter count of the model on the
meta device.

``MAMBA1`` gives each family's whole spec but name, sequence and vocabulary (as hf_hybrids.HYBRIDS, which includes
it); their activations are traced with CUDA's mamba-ssm kernels stood in (validation/trace_mamba1.py: derived from
mamba-ssm's source; transformers' torch path loops over s, which a symbolic trace cannot follow)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

from memplan.core.errors import MemplanError
from memplan.core.spec_base import echo
from memplan.presets.hf_families import YAML_HINT, flag, nat


def _rank(data: dict, key: str, h: int, path: Path) -> int:
    """The dt rank: an integer, or "auto" (the default) for ceil(h / 16) as the config classes compute it."""
    value = data.get(key, "auto")
    return math.ceil(h / 16) if value in ("auto", None) else nat(data, key, None, path)


def _mixer(data: dict, path: Path, h: int, keys: tuple[str, str, str, str, str, str], norms: bool,
           inner: str = "") -> dict[str, Any]:
    """The mixer's fields under a family's key names (expand, state, conv kernel, dt rank, conv bias, proj bias: the
    config classes' defaults 2, 16, 4, auto, true, false); its width the ``inner`` key when the file has it (Mamba's
    intermediate_size, which MambaConfig keeps over expand x h), else expand x h; ``norms``: dt / B / C RMSNorms with
    weights (Jamba)."""
    expand, state, kernel, rank, conv_bias, proj_bias = keys
    width = data.get(expand, 2)
    if isinstance(width, bool) or not isinstance(width, (int, float)) or width <= 0 or int(width * h) != width * h:
        raise MemplanError(f"{path}: {expand}: expected a positive number that makes {expand} x hidden_size an "
                           f"integer (got {echo(width)})")
    bias = flag(data, proj_bias, False, path)
    width = nat(data, inner, None, path) if data.get(inner) is not None else int(width * h)
    return dict(ssm_heads=1, ssm_head_dim=width, ssm_state_size=nat(data, state, 16, path),
                ssm_conv_kernel=nat(data, kernel, 4, path), ssm_dt_rank=_rank(data, rank, h, path),
                ssm_conv_bias=flag(data, conv_bias, True, path), ssm_proj_bias=bias, ssm_out_bias=bias, ssm_norm=norms)


def _mamba(data: dict, path: Path, norms: bool = False) -> dict[str, Any]:
    """MambaForCausalLM (and FalconMambaForCausalLM, whose dt / B / C RMSNorms are weightless buffers): every layer a
    norm and a mixer intermediate_size wide (else expand x hidden_size); use_bias on in_proj and out_proj; embeddings
    tied by default."""
    L, h = nat(data, "num_hidden_layers", 32, path), nat(data, "hidden_size", 768, path)
    return dict(num_layers=L, hidden_size=h, num_attention_heads=1, norm="rmsnorm", position_embedding="rope",
                bias=False, tied_embeddings=flag(data, "tie_word_embeddings", True, path), layer_pattern="1" * L,
                norm_eps=data.get("layer_norm_epsilon"),
                **_mixer(data, path, h, ("expand", "state_size", "conv_kernel", "time_step_rank", "use_conv_bias",
                                         "use_bias"), norms, "intermediate_size"))


def _period(data: dict, path: Path, period: str, offset: str, defaults: tuple[int, int]) -> tuple[int, int]:
    """A (period, offset) pair of Jamba's layout, the offset below the period (as JambaConfig checks)."""
    p, o = nat(data, period, defaults[0], path), data.get(offset, defaults[1])
    if isinstance(o, bool) or not isinstance(o, int) or not 0 <= o < p:
        raise MemplanError(f"{path}: {offset}: expected an integer from 0 to {period} - 1 = {p - 1} (got {echo(o)})")
    return p, o


def _jamba(data: dict, path: Path) -> dict[str, Any]:
    """JambaForCausalLM: layer i attention when i % attn_layer_period == attn_layer_offset, else a Mamba-1 mixer (its
    dt / B / C RMSNorms with weights); then num_experts experts (intermediate_size wide, gated, top
    num_experts_per_tok, a router without bias) when i % expert_layer_period == expert_layer_offset, else a gated MLP
    as wide; two norms per layer; no biases, no position embedding."""
    L, h = nat(data, "num_hidden_layers", 32, path), nat(data, "hidden_size", 4096, path)
    attn, experts = (_period(data, path, "attn_layer_period", "attn_layer_offset", (8, 4)),
                     _period(data, path, "expert_layer_period", "expert_layer_offset", (2, 1)))
    E = nat(data, "num_experts", nat(data, "num_local_experts", 16, path), path)
    moe = [E > 1 and i % experts[0] == experts[1] for i in range(L)]
    pattern = "".join(("A" if i % attn[0] == attn[1] else "J").lower() if any(moe) and not moe[i] else
                      "A" if i % attn[0] == attn[1] else "J" for i in range(L))
    f = nat(data, "intermediate_size", 14336, path)
    experts_spec = dict(num_experts=E, moe_top_k=nat(data, "num_experts_per_tok", 2, path),
                        moe_ffn_hidden_size=f) if any(moe) else {}
    return dict(num_layers=L, hidden_size=h, layer_pattern=pattern, mlp="swiglu", ffn_hidden_size=f,
                num_attention_heads=nat(data, "num_attention_heads", 32, path),
                num_kv_heads=data.get("num_key_value_heads"), norm="rmsnorm", position_embedding="rope", bias=False,
                tied_embeddings=flag(data, "tie_word_embeddings", False, path), norm_eps=data.get("rms_norm_eps"),
                **experts_spec,
                **_mixer(data, path, h, ("mamba_expand", "mamba_d_state", "mamba_d_conv", "mamba_dt_rank",
                                         "mamba_conv_bias", "mamba_proj_bias"), True))


def _zamba(data: dict, path: Path) -> dict[str, Any]:
    """ZambaForCausalLM: every layer a norm and a Mamba-1 mixer of n_mamba_heads heads (x_proj and dt_proj per head:
    as many parameters as one mixer I wide), the "hybrid" ones (layers_block_type, else ZambaConfig's own layout) after
    a use of the shared attention + gated MLP block (over [x, embedding], attention_hidden_size = 2 h wide, heads
    attention_head_dim wide) and its own h x h linear; no biases; embeddings tied by default."""
    L, h = nat(data, "num_hidden_layers", 76, path), nat(data, "hidden_size", 3712, path)
    a = nat(data, "num_attention_heads", 16, path)
    if data.get("attention_hidden_size") not in (None, 2 * h):
        raise MemplanError(f"{path}: attention_hidden_size = {echo(data['attention_hidden_size'])}, not 2 x "
                           f"hidden_size = {2 * h}: not modelled; {YAML_HINT}")
    if data.get("layers_block_type") is None:
        period, offset = _period(data, path, "attn_layer_period", "attn_layer_offset", (6, 4))
        pattern = "11Z" + "".join("Z" if i % period == offset else "1" for i in range(L - 3))
    else:
        types, table = data["layers_block_type"], {"linear_attention": "1", "mamba": "1", "hybrid": "Z"}
        if not isinstance(types, list) or not types or not all(isinstance(t, str) and t in table for t in types):
            raise MemplanError(f"{path}: layers_block_type: expected a list of the layer types hybrid, "
                               f"linear_attention and mamba (got {echo(types)})")
        pattern = "".join(table[t] for t in types)
    mixer = _mixer(data, path, h, ("mamba_expand", "mamba_d_state", "mamba_d_conv", "mamba_dt_rank",
                                   "mamba_conv_bias", "mamba_proj_bias"), False)
    heads = nat(data, "n_mamba_heads", 2, path)
    if mixer["ssm_head_dim"] % heads:
        raise MemplanError(f"{path}: mamba_expand x hidden_size = {mixer['ssm_head_dim']} is not divisible by "
                           f"n_mamba_heads = {heads}")
    mixer.update(ssm_heads=heads, ssm_head_dim=mixer["ssm_head_dim"] // heads)
    return dict(num_layers=len(pattern), hidden_size=h, layer_pattern=pattern, mlp="swiglu",
                ffn_hidden_size=nat(data, "intermediate_size", 14848, path), num_attention_heads=a,
                num_kv_heads=data.get("num_key_value_heads"),
                head_dim=nat(data, "attention_head_dim", 2 * h // a, path),
                norm="rmsnorm", position_embedding="rope", bias=False,
                tied_embeddings=flag(data, "tie_word_embeddings", True, path), norm_eps=data.get("rms_norm_eps"),
                **mixer)


MAMBA1: dict[str, Callable[[dict, Path], dict[str, Any]]] = {
    "MambaForCausalLM": _mamba, "FalconMambaForCausalLM": _mamba, "JambaForCausalLM": _jamba,
    "ZambaForCausalLM": _zamba,
}
