"""A hybrid model's layer layout (ModelSpec.layer_pattern, issue 22): the blocks each pattern character stands for
(``LAYER_BLOCKS``), their count over a model (``layer_blocks``) and the checks that involve the pattern and the
mixers' fields alone (``check_hybrid``, called by ModelSpec's validator)."""

from __future__ import annotations

from typing import Any

# A hybrid layer's blocks by its character in ModelSpec.layer_pattern: "ffn" is the model's MLP (its experts in a
# mixture-of-experts model), "dense" an f-wide MLP, "moe" the experts, "ssm" a Mamba-2 mixer, "conv" LFM2's gated
# short convolution, "delta" a gated DeltaNet (Qwen3-Next, Qwen3.5, OLMo-hybrid: memplan/presets/hf_linear_attention.py)
# (lower case: with an f-wide dense MLP in a mixture-of-experts model, LFM2-MoE's first layers, Qwen3-Next's
# mlp_only_layers); each "norm" one norm before a block.
LAYER_BLOCKS = {"A": ("attention", "ffn", "norm", "norm"), "S": ("ssm", "ffn", "norm", "norm"),
                "P": ("attention", "ssm", "ffn", "norm", "norm"), "M": ("ssm", "norm"), "*": ("attention", "norm"),
                "-": ("dense", "norm"), "E": ("moe", "norm"), "C": ("conv", "ffn", "norm", "norm"),
                "a": ("attention", "dense", "norm", "norm"), "c": ("conv", "dense", "norm", "norm"),
                "D": ("delta", "ffn", "norm", "norm"), "d": ("delta", "dense", "norm", "norm")}
BLOCKS = ("attention", "ssm", "conv", "delta", "dense", "moe", "norm")


def layer_blocks(pattern: str | None, is_moe: bool) -> dict[str, int]:
    """A hybrid's blocks over the whole model (``pattern``, LAYER_BLOCKS): how many of each of BLOCKS."""
    out = dict.fromkeys(BLOCKS, 0)
    for c in pattern or "":
        for block in LAYER_BLOCKS[c]:
            out[block if block != "ffn" else "moe" if is_moe else "dense"] += 1
    return out


def check_hybrid(model: Any) -> None:
    """A layer_pattern has a character per layer, a mixer's widths where it has a mixer, experts where it has E;
    no bias on every linear, no dense-first layers (the pattern says where the dense MLPs are). Raises ValueError."""
    pattern = model.layer_pattern
    if pattern is None:
        if model.ssm_heads is not None:
            raise ValueError("ssm_heads is a state-space field: it needs layer_pattern (which layers have a mixer)")
        return
    if len(pattern) != model.num_layers:
        raise ValueError(f"layer_pattern has {len(pattern):,} characters for num_layers={model.num_layers:,}")
    if any(c in pattern for c in "SPMDd") and model.ssm_heads is None:
        raise ValueError("layer_pattern has Mamba-2 mixers (S, P, M) or gated DeltaNets (D, d): they need ssm_heads")
    if any(c in pattern for c in "SPM") and any(c in pattern for c in "Dd"):
        raise ValueError("layer_pattern: Mamba-2 mixers (S, P, M) and gated DeltaNets (D, d) share the ssm_* widths: "
                         "one kind per model")
    if model.ssm_heads is not None and model.ssm_heads % model.ssm_groups:
        raise ValueError(f"ssm_heads={model.ssm_heads} is not divisible by ssm_groups={model.ssm_groups}")
    if "E" in pattern and not model.is_moe:
        raise ValueError("layer_pattern has expert blocks (E): they need num_experts")
    if any(c in pattern for c in "acd") and not model.is_moe:
        raise ValueError("layer_pattern's a / c / d put a dense MLP beside a mixture-of-experts model's experts: they need "
                         "num_experts (else write A / C / D)")
    if model.bias or model.moe_first_dense_layers or model.is_mla:
        raise ValueError("layer_pattern: memplan models hybrids without a bias on every linear, dense-first layers "
                         "or latent attention (the pattern places the MLPs: - dense, E experts)")
