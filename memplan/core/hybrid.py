"""A hybrid model's layer layout (ModelSpec.layer_pattern, issue 22): the blocks each pattern character stands for
(``LAYER_BLOCKS``), their count over a model (``layer_blocks``), a gated DeltaNet's parameter counts
(``delta_counts``) and the checks that involve the pattern and the mixers' fields alone (``check_hybrid``, called by
ModelSpec's validator)."""

from __future__ import annotations

from typing import Any

# A hybrid layer's blocks by its character in ModelSpec.layer_pattern: "ffn" is the model's MLP (its experts in a
# mixture-of-experts model), "dense" an f-wide MLP, "moe" the experts, "ssm" a Mamba-2 mixer, "conv" LFM2's gated short
# convolution, "delta" a gated DeltaNet (Qwen3-Next, Qwen3.5, OLMo-hybrid: memplan/presets/hf_linear_attention.py)
# (lower case: with an f-wide dense MLP in a mixture-of-experts model, LFM2-MoE's first layers, Qwen3-Next's
# mlp_only_layers); "delta" in K / k Kimi Delta Attention (Kimi Linear: ``kda_counts``), in B / b Bailing-hybrid's (its
# gates full rank); each "norm" one norm before a block; "mamba1" a Mamba-1 mixer (Mamba, Falcon-Mamba, Jamba:
# ModelSpec.ssm_dt_rank, ssm_heads 1 and ssm_head_dim its width I; Zamba's ssm_heads heads); "shared" a use of Zamba's
# shared attention + MLP block (Z: its own h x h linear each use; the block's weights are held once, memory/states.py;
# Y: Zamba 2's, a use of one of its ModelSpec.shared_blocks blocks in turn, with its per-use adapters, then a Mamba-2
# mixer); "rglru" RecurrentGemma's recurrent block (Griffin's RG-LRU with its convolution and projections:
# ``rglru_counts``); "rwkv" an RWKV block's time mixing and channel mixing, its key / value pair the "ffn" (RWKV:
# ``rwkv_counts``); "lightning" MiniMax's lightning attention (``lightning_counts``); "mlstm" xLSTM's mLSTM
# layer (``mlstm_counts``); "moa" JetMoE's mixture of attention experts (``moa_counts``).
LAYER_BLOCKS = {"A": ("attention", "ffn", "norm", "norm"), "S": ("ssm", "ffn", "norm", "norm"),
                "P": ("attention", "ssm", "ffn", "norm", "norm"), "M": ("ssm", "norm"), "*": ("attention", "norm"),
                "-": ("dense", "norm"), "E": ("moe", "norm"), "C": ("conv", "ffn", "norm", "norm"),
                "a": ("attention", "dense", "norm", "norm"), "c": ("conv", "dense", "norm", "norm"),
                "1": ("mamba1", "norm"), "J": ("mamba1", "ffn", "norm", "norm"),
                "j": ("mamba1", "dense", "norm", "norm"), "Z": ("shared", "mamba1", "norm"),
                "Y": ("shared", "ssm", "norm"),
                "D": ("delta", "ffn", "norm", "norm"), "d": ("delta", "dense", "norm", "norm"),
                "K": ("delta", "ffn", "norm", "norm"), "k": ("delta", "dense", "norm", "norm"),
                "B": ("delta", "ffn", "norm", "norm"), "b": ("delta", "dense", "norm", "norm"),
                "R": ("rglru", "ffn", "norm", "norm"), "W": ("rwkv", "ffn", "norm", "norm"),
                "L": ("lightning", "ffn", "norm", "norm"), "X": ("mlstm", "ffn", "norm", "norm"),
                "O": ("moa", "ffn", "norm", "norm")}
BLOCKS = ("attention", "ssm", "conv", "mamba1", "shared", "delta", "rglru", "rwkv", "lightning", "mlstm", "moa", "dense",
          "moe", "norm")


def layer_blocks(pattern: str | None, is_moe: bool) -> dict[str, int]:
    """A hybrid's blocks over the whole model (``pattern``, LAYER_BLOCKS): how many of each of BLOCKS."""
    out = dict.fromkeys(BLOCKS, 0)
    for c in pattern or "":
        for block in LAYER_BLOCKS[c]:
            out[block if block != "ffn" else "moe" if is_moe else "dense"] += 1
    return out


def delta_counts(model: Any) -> list[tuple[str, int, bool]]:
    """A gated DeltaNet's parameters (layer_pattern D / d; transformers Qwen3NextGatedDeltaNet, Qwen3_5GatedDeltaNet,
    OlmoHybridGatedDeltaNet) as (group, count, split by tensor parallelism), with H = ssm_heads value heads of d_v =
    ssm_head_dim (V = H d_v) and ssm_groups key heads of ssm_state_size (K): the input projections h x (2 K + 2 V + 2 H)
    (q, k, v, the output gate z, beta and the decay a: in_proj_qkvz + in_proj_ba, or one linear each), the depthwise
    conv1d over 2 K + V channels, dt_bias and A_log (H each), the gated RMSNorm d_v wide (one weight for every head) and
    out_proj V x h; no biases (memory/states.py makes them the "delta" scope's groups)."""
    if any(c in model.layer_pattern or "" for c in "KkBb"):
        return kda_counts(model)
    if not any(c in model.layer_pattern or "" for c in "Dd"):
        return []
    H, dv, k, h = model.ssm_heads, model.ssm_head_dim, model.ssm_groups * model.ssm_state_size, model.hidden_size
    v = H * dv
    return [("DeltaNet input projections", h * (2 * k + 2 * v + 2 * H), True),
            ("DeltaNet convolution", (2 * k + v) * (model.ssm_conv_kernel + model.ssm_conv_bias), True),
            ("DeltaNet heads' dt_bias, A_log", 2 * H, True), ("DeltaNet gated norm", dv, False),
            ("DeltaNet output projection", v * h, True)]


def kda_counts(model: Any) -> list[tuple[str, int, bool]]:
    """Kimi Delta Attention's parameters (layer_pattern K / k: transformers KimiLinearDeltaAttention; B / b:
    BailingHybridDeltaAttention) with H = ssm_heads heads of d = ssm_head_dim (V = H d): q_proj, k_proj, v_proj h x V
    each and b_proj h x H (beta); the forget gate's and the output gate's projections, low rank in Kimi's (f_a_proj,
    g_a_proj h x d; f_b_proj, g_b_proj d x V), full rank in Bailing's (f_proj, g_proj h x V); the depthwise conv1d over
    3 V channels (no bias); dt_bias V and A_log H; the gated RMSNorm d wide (o_norm) and o_proj V x h; no biases."""
    H, d, h = model.ssm_heads, model.ssm_head_dim, model.hidden_size
    v = H * d
    gates = [("KDA forget and output gates' projections", 2 * h * v, True)] if any(
        c in model.layer_pattern for c in "Bb") else [("KDA gates' low-rank down projections", 2 * h * d, False),
                                                      ("KDA gates' low-rank up projections", 2 * d * v, True)]
    return [("KDA q, k, v and beta projections", h * (3 * v + H), True), *gates,
            ("KDA convolution", 3 * v * (model.ssm_conv_kernel + model.ssm_conv_bias), True),
            ("KDA dt_bias, A_log", v + H, True), ("KDA gated norm", d, False), ("KDA output projection", v * h, True)]


def rglru_counts(model: Any) -> list[tuple[str, int, bool]]:
    """RecurrentGemma's recurrent block's parameters (layer_pattern R: transformers RecurrentGemmaRecurrentBlock), the
    RG-LRU W = ssm_heads x ssm_head_dim wide (lru_width; its gates block-diagonal over H = ssm_heads heads of
    P = ssm_head_dim): linear_x and linear_y h x W with biases, the depthwise conv_1d W x ssm_conv_kernel with its bias,
    the RG-LRU's input and recurrent gates H x P x P with biases H x P each and its recurrent_param W, linear_out
    W x h with its bias h; [] without R layers."""
    if "R" not in (model.layer_pattern or ""):
        return []
    H, P, h = model.ssm_heads, model.ssm_head_dim, model.hidden_size
    w = H * P
    return [("RG-LRU input projections (linear_x, linear_y)", 2 * w * (h + 1), True),
            ("RG-LRU convolution", w * (model.ssm_conv_kernel + model.ssm_conv_bias), True),
            ("RG-LRU gates and recurrent_param", 2 * H * P * P + 3 * w, True),
            ("RG-LRU output projection weight", w * h, True), ("RG-LRU output projection bias", h, False)]


def rwkv_counts(model: Any) -> list[tuple[str, int, bool]]:
    """An RWKV block's parameters but its channel mixing's key / value pair (layer_pattern W: transformers
    RwkvSelfAttention and RwkvFeedForward; the pair h -> f -> h is the layer's MLP), with A = ssm_head_dim
    (attention_hidden_size): the time mixing's key, value and receptance h x A and output A x h, time_decay and
    time_first A each, time_mix_key / value / receptance h each; the channel mixing's receptance h x h and
    time_mix_key / receptance h each; no biases; [] without W layers."""
    if "W" not in (model.layer_pattern or ""):
        return []
    A, h = model.ssm_head_dim, model.hidden_size
    return [("RWKV time mixing's key, value, receptance and output", 4 * h * A, True),
            ("RWKV time_decay, time_first", 2 * A, True), ("RWKV channel mixing's receptance", h * h, True),
            ("RWKV time_mix vectors", 5 * h, False)]


def lightning_counts(model: Any) -> list[tuple[str, int, bool]]:
    """MiniMax's lightning attention's parameters (layer_pattern L: transformers MiniMaxLightningAttention), its heads
    the attention's (q = a x head_dim wide): qkv_proj h x 3 q, output_gate h x q, out_proj q x h, the RMSNorm q wide
    over the heads' output; no biases; [] without L layers."""
    if "L" not in (model.layer_pattern or ""):
        return []
    q, h = model.q, model.hidden_size
    return [("lightning attention's qkv_proj, output_gate and out_proj", 5 * h * q, True),
            ("lightning attention's norm", q, False)]


def mlstm_counts(model: Any) -> list[tuple[str, int, bool]]:
    """xLSTM's mLSTM layer's parameters (layer_pattern X: transformers xLSTMLayer, weight_mode single or fused: the
    same count), H = ssm_heads heads, queries and keys ssm_state_size wide per head (QK = H x it), values and the
    output gate ssm_head_dim (V = H x it): q, k h x QK, v, ogate_preact h x V, igate_preact and fgate_preact h x H with
    biases, the multi-head norm's weight V, out_proj V x h; no other biases (use_bias false); [] without X layers."""
    if "X" not in (model.layer_pattern or ""):
        return []
    H, h = model.ssm_heads, model.hidden_size
    qk, v = H * model.ssm_state_size, H * model.ssm_head_dim
    return [("mLSTM q, k, v, output gate and out_proj", h * (2 * qk + 3 * v), True),
            ("mLSTM input and forget gates", 2 * H * (h + 1), True), ("mLSTM multi-head norm", v, True)]


def moa_counts(model: Any) -> list[tuple[str, int, bool]]:
    """JetMoE's mixture of attention experts' parameters (layer_pattern O: transformers JetMoeAttention and JetMoeMoA)
    with E = num_experts experts, K / V g = num_kv_heads heads of d = head_dim (kv_channels): each expert's query
    projection h x g d and output projection g d x h, the router E x h, the shared kv_proj h x 2 g d, and two
    h-wide output biases per layer (JetMoeMoA's and the MLP experts' JetMoeMoE.bias; the MLP's experts and router are
    the model's "moe" groups); [] without O layers."""
    if "O" not in (model.layer_pattern or ""):
        return []
    E, h, width = model.num_experts, model.hidden_size, model.q * model.g // model.num_attention_heads  # g d
    return [("attention experts' query and output projections", 2 * E * h * width, True),
            ("attention experts' router", E * h, False), ("attention's kv_proj", 2 * h * width, True),
            ("JetMoE's output biases (attention experts, MLP experts)", 2 * h, False)]


def check_hybrid(model: Any) -> None:
    """A layer_pattern has a character per layer, a mixer's widths where it has a mixer, experts where it has E;
    no bias on every linear, no dense-first layers (the pattern says where the dense MLPs are). Raises ValueError."""
    pattern = model.layer_pattern
    if pattern is None:
        if model.ssm_heads is not None or model.ssm_dt_rank is not None:
            raise ValueError("a state-space field (ssm_heads, ssm_dt_rank) needs layer_pattern (which layers have a "
                             "mixer)")
        return
    if len(pattern) != model.num_layers:
        raise ValueError(f"layer_pattern has {len(pattern):,} characters for num_layers={model.num_layers:,}")
    if any(c in pattern for c in "SPMYDdKkBbRWX") and model.ssm_heads is None:
        raise ValueError("layer_pattern has Mamba-2 mixers (S, P, M, Y), gated DeltaNets (D, d), Kimi Delta "
                         "Attention (K, k, B, b), RG-LRU (R), RWKV (W) or mLSTM blocks (X): they need ssm_heads")
    if sum(any(c in pattern for c in kind) for kind in ("SPMY", "Dd", "Kk", "Bb", "R", "W", "X")) > 1:
        raise ValueError("layer_pattern: Mamba-2 mixers (S, P, M, Y), gated DeltaNets (D, d), Kimi Delta Attention "
                         "(Kimi's K, k; Bailing's B, b), RG-LRU (R), RWKV (W) and mLSTM blocks (X) share the ssm_* "
                         "widths: one kind per model")
    if any(c in pattern for c in "1JjZ") != (model.ssm_dt_rank is not None) or (
            model.ssm_dt_rank is not None and (model.ssm_heads is None or any(c in pattern for c in "SPMYDdKkBbRWX"))):
        raise ValueError("layer_pattern's Mamba-1 mixers (1, J, j, Z) need ssm_dt_rank and ssm_heads, and ssm_dt_rank "
                         "needs them (Mamba-2 mixers S, P, M, Y or DeltaNets D, d beside them are not modelled)")
    if model.ssm_heads is not None and model.ssm_heads % model.ssm_groups:
        raise ValueError(f"ssm_heads={model.ssm_heads} is not divisible by ssm_groups={model.ssm_groups}")
    if "E" in pattern and not model.is_moe:
        raise ValueError("layer_pattern has expert blocks (E): they need num_experts")
    if any(c in pattern for c in "acjdkb") and not model.is_moe:
        raise ValueError("layer_pattern's a / c / j / d / k / b put a dense MLP beside a mixture-of-experts model's "
                         "experts: they need num_experts (else write A / C / J / D / K / B)")
    if model.bias or model.moe_first_dense_layers or (model.is_mla and not any(c in pattern for c in "KkBb")):
        raise ValueError("layer_pattern: memplan models hybrids without a bias on every linear, dense-first layers "
                         "or latent attention beside other mixers than Kimi Delta Attention (K, k, B, b) (the pattern "
                         "places the MLPs: - dense, E experts)")
