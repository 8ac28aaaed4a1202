"""The config.json readers of the recurrent and other odd decoders (issue 22), from transformers' own modelling code
(transformers 5.23), each layer's blocks as ModelSpec.layer_pattern (core/hybrid.py), each checked by the registry walk
(memplan/check/registry.py) against transformers' parameter count of the model on the meta device:

- RecurrentGemma (RecurrentGemmaRecurrentBlock beside RecurrentGemmaAttention): R the recurrent block + MLP, A local
  attention + MLP; the RG-LRU's widths in the ssm_* fields (ssm_heads: its gates' heads, num_attention_heads;
  ssm_head_dim: lru_width over them; ssm_conv_kernel: conv1d_width), its parameters core/hybrid.py rglru_counts;
- RWKV-4 (RwkvBlock): W (rwkv_counts; the time mixing A = ssm_head_dim wide);
- xLSTM (xLSTMBlock's mLSTM layer): X (mlstm_counts); its activations are refused (traced_file.NOT_TRACED);
- JetMoE (JetMoeAttention's mixture of attention experts): O (moa_counts); its routing is data-dependent, the trace
  refuses it;
- Doge (a Llama layer with dynamic-mask attention and residual scales): no layer_pattern, ModelSpec.dynamic_mask;
- HRM (two stacks of layers run in a loop): no layer_pattern, ModelSpec.looped_stacks, which every --impl refuses.

``RECURRENT`` gives each family's whole spec but name, sequence and vocabulary (as hf_hybrids.HYBRIDS, which takes
it in). Activations are traced (--impl hf-*): the RG-LRU's and RWKV's torch paths loop over the tokens in Python
(``_rnn_scan``, ``rwkv_linear_attention_cpu``), so their saves are traced at concrete s and b (RecurrentGemma's past
its attention window) and fitted (validation/trace_fit.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from memplan.core.errors import MemplanError
from memplan.core.spec_base import echo
from memplan.presets.hf_families import YAML_HINT, flag, nat, nat_or_default

_BLOCKS = {"recurrent": "R", "attention": "A"}


def _recurrent_gemma(data: dict, path: Path) -> dict[str, Any]:
    """RecurrentGemmaForCausalLM: layer i's temporal block is block_types[i % len(block_types)] (default recurrent,
    recurrent, attention), after an RMSNorm; then a gated MLP intermediate_size / 2 wide (gate_proj, up_proj,
    down_proj, each with a bias; gelu) after another. The recurrent block: linear_x, linear_y h -> lru_width (default
    h), a depthwise conv1d conv1d_width wide, the RG-LRU (num_attention_heads block-diagonal gate heads), linear_out,
    all with biases. The attention: num_attention_heads heads h / a wide (RecurrentGemmaConfig sets head_dim so,
    whatever the file says), num_key_value_heads K / V heads, attention_bias on q, k, v, o_proj always biased; a
    sliding window (attention_window_size, no parameters); embeddings tied by default."""
    L, h = nat(data, "num_hidden_layers", 26, path), nat(data, "hidden_size", 2560, path)
    a = nat(data, "num_attention_heads", 10, path)
    kinds = data.get("block_types", ["recurrent", "recurrent", "attention"])
    if not isinstance(kinds, list) or not kinds or not all(isinstance(k, str) and k in _BLOCKS for k in kinds):
        raise MemplanError(f"{path}: block_types: expected a list of the block types recurrent and attention (got "
                           f"{echo(kinds)})")
    width = nat_or_default(data, "lru_width", h, path)
    if width % a:
        raise MemplanError(f"{path}: lru_width = {width} is not divisible by num_attention_heads = {a} (the RG-LRU's "
                           f"gate heads)")
    act = data.get("hidden_activation", "gelu_pytorch_tanh")
    if not (isinstance(act, str) and act.startswith("gelu")):
        raise MemplanError(f"{path}: hidden_activation: memplan models RecurrentGemma's gated MLP with gelu (got "
                           f"{echo(act)})")
    return dict(num_layers=L, hidden_size=h, num_attention_heads=a, num_kv_heads=data.get("num_key_value_heads"),
                head_dim=h // a, layer_pattern="".join(_BLOCKS[kinds[i % len(kinds)]] for i in range(L)),
                norm="rmsnorm", position_embedding="rope", bias=False, mlp="swiglu", gate_activation="gelu",
                ffn_hidden_size=nat(data, "intermediate_size", 3 * h, path) // 2, mlp_bias=True, out_bias=True,
                attention_bias=flag(data, "attention_bias", False, path), norm_eps=data.get("rms_norm_eps"),
                tied_embeddings=flag(data, "tie_word_embeddings", True, path), ssm_heads=a, ssm_head_dim=width // a,
                ssm_conv_kernel=nat(data, "conv1d_width", 4, path), ssm_conv_bias=True, ssm_norm=False)


def _rwkv(data: dict, path: Path) -> dict[str, Any]:
    """RwkvForCausalLM (RWKV-4): every layer an RWKV block (layer_pattern W): a LayerNorm, the time mixing
    (attention_hidden_size A wide, default h: key, value, receptance, output, time_decay, time_first, three time_mix
    vectors), a LayerNorm, the channel mixing (its key h -> intermediate_size (default 4 h) and value back, squared
    relu: the layer's plain MLP; its receptance h x h and two time_mix vectors); the first block's pre_ln on the
    embeddings (memplan's embedding norm); no biases, no position embedding; embeddings untied by default."""
    h = nat(data, "hidden_size", 4096, path)
    L = nat(data, "num_hidden_layers", 32, path)
    return dict(num_layers=L, hidden_size=h, num_attention_heads=1, layer_pattern="W" * L, norm="layernorm",
                position_embedding="rope", bias=False, mlp="gelu", embedding_norm=True,
                ffn_hidden_size=nat_or_default(data, "intermediate_size", 4 * h, path),
                norm_eps=data.get("layer_norm_epsilon"), tied_embeddings=flag(data, "tie_word_embeddings", False, path),
                ssm_heads=1, ssm_head_dim=nat_or_default(data, "attention_hidden_size", h, path), ssm_norm=False)


def _factor(data: dict, key: str, default: float, path: Path) -> float:
    """A positive width factor (xLSTM's qk_dim_factor, v_dim_factor, ffn_proj_factor)."""
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise MemplanError(f"{path}: {key}: expected a positive number (got {echo(value)})")
    return value


def _xlstm(data: dict, path: Path) -> dict[str, Any]:
    """xLSTMForCausalLM (xLSTM-7B: mLSTM blocks, transformers' own torch code; with the xlstm package installed
    transformers runs that package's blocks instead): every layer (num_blocks, which the model builds, else
    num_hidden_layers) an RMSNorm, the
    mLSTM layer (layer_pattern X: num_heads heads; q, k int(qk_dim_factor h) wide, v and the output gate
    int(v_dim_factor h), as xLSTMLayer computes them) and an RMSNorm and a SwiGLU MLP h x ffn_proj_factor h rounded up
    to ffn_round_up_to_multiple_of; no biases (use_bias refused); embeddings untied whatever tie_word_embeddings says
    (xLSTMForCausalLM declares no tied weights: transformers' meta-device count keeps both)."""
    h = nat(data, "hidden_size", 4096, path)
    L = nat(data, "num_blocks" if data.get("num_blocks") is not None else "num_hidden_layers", 32, path)
    if flag(data, "use_bias", False, path):
        raise MemplanError(f"{path}: use_bias (biases on the mLSTM's and MLP's linears and norms): not counted; "
                           f"{YAML_HINT}")
    if data.get("embedding_dim") not in (None, h):
        raise MemplanError(f"{path}: embedding_dim = {echo(data['embedding_dim'])}, not hidden_size = {h}: "
                           f"transformers' blocks take h wide inputs; not modelled")
    H = nat(data, "num_heads", 8, path)
    qk, v = int(h * _factor(data, "qk_dim_factor", 0.5, path)), int(h * _factor(data, "v_dim_factor", 1.0, path))
    if qk % H or v % H or not qk or not v:
        raise MemplanError(f"{path}: the mLSTM's q / k width {qk} and v width {v} must be positive multiples of "
                           f"num_heads = {H}")
    m = nat(data, "ffn_round_up_to_multiple_of", 64, path)
    up = int((h * _factor(data, "ffn_proj_factor", 2.667, path) + m - 1) // m * m)
    return dict(num_layers=L, hidden_size=h, num_attention_heads=1, layer_pattern="X" * L, norm="rmsnorm",
                position_embedding="rope", bias=False, mlp="swiglu", ffn_hidden_size=up,
                norm_eps=data.get("norm_eps"), tied_embeddings=False, ssm_heads=H, ssm_head_dim=v // H, ssm_state_size=qk // H, ssm_norm=False)


def _jetmoe(data: dict, path: Path) -> dict[str, Any]:
    """JetMoeForCausalLM: every layer (layer_pattern O) an RMSNorm, the mixture of attention experts (num_local_experts
    query / output projection pairs, top num_experts_per_tok, a router; a shared kv_proj for num_key_value_heads heads
    kv_channels wide; num_key_value_heads x top-k query heads, as JetMoeConfig sets them) and an RMSNorm and
    num_local_experts gated experts intermediate_size wide (a router without bias); each block an h-wide output bias;
    embeddings tied by default. Its routing turns the experts' token counts into Python ints (expert_size.tolist()):
    the trace refuses it (the registry's exclusion, kind trace)."""
    L, h = nat(data, "num_hidden_layers", 12, path), nat(data, "hidden_size", 2048, path)
    g, k = nat(data, "num_key_value_heads", 16, path), nat(data, "num_experts_per_tok", 2, path)
    if data.get("activation_function", "silu") != "silu":
        raise MemplanError(f"{path}: activation_function {echo(data['activation_function'])}: memplan models JetMoE's "
                           f"gated experts with silu; {YAML_HINT}")
    f = nat(data, "intermediate_size", 5632, path)
    return dict(num_layers=L, hidden_size=h, num_attention_heads=g * k, num_kv_heads=g,
                head_dim=nat(data, "kv_channels", 128, path), layer_pattern="O" * L, norm="rmsnorm",
                position_embedding="rope", bias=False, mlp="swiglu", ffn_hidden_size=f,
                num_experts=nat(data, "num_local_experts", 8, path), moe_top_k=k, moe_ffn_hidden_size=f,
                norm_eps=data.get("rms_norm_eps"), tied_embeddings=flag(data, "tie_word_embeddings", True, path))


def _doge(data: dict, path: Path) -> dict[str, Any]:
    """DogeForCausalLM: Llama's layer with head-wide q / k RMSNorms, the dynamic mask (A per K / V head, dt_proj from
    the values to one logit per K / V head; ModelSpec.dynamic_mask) and two learned h-wide residual scales per layer;
    attention_bias on q, k, v, o and dt_proj; a SwiGLU MLP intermediate_size wide (mlp_bias refused without
    attention_bias: memplan puts biases on the attention or on every linear); is_moe (its CDMoE's retrieval experts)
    refused; embeddings untied by default."""
    if flag(data, "is_moe", False, path):
        raise MemplanError(f"{path}: is_moe (Doge's CDMoE: product-key routing over num_experts embedded experts): not "
                           f"counted; {YAML_HINT}")
    bias, mlp_bias = flag(data, "attention_bias", False, path), flag(data, "mlp_bias", False, path)
    if mlp_bias and not bias:
        raise MemplanError(f"{path}: mlp_bias without attention_bias: not counted; {YAML_HINT}")
    if data.get("hidden_act", "silu") != "silu":
        raise MemplanError(f"{path}: hidden_act {echo(data['hidden_act'])}: memplan models Doge's MLP with silu; "
                           f"{YAML_HINT}")
    h, a = nat(data, "hidden_size", 1024, path), nat(data, "num_attention_heads", 8, path)
    return dict(num_layers=nat(data, "num_hidden_layers", 32, path), hidden_size=h, num_attention_heads=a,
                num_kv_heads=data.get("num_key_value_heads"), head_dim=data.get("head_dim"), norm="rmsnorm",
                position_embedding="rope", bias=bias and mlp_bias, attention_bias=bias and not mlp_bias, mlp="swiglu",
                ffn_hidden_size=nat(data, "intermediate_size", 2048, path), qk_norm=True, dynamic_mask=True,
                norm_eps=data.get("rms_norm_eps"), tied_embeddings=flag(data, "tie_word_embeddings", False, path))


def _hrm_text(data: dict, path: Path) -> dict[str, Any]:
    """HrmTextForCausalLM (HRM): two stacks (L_module, H_module) of num_layers_per_stack layers each (a file without it
    has the per-stack count in num_hidden_layers, which HrmTextConfig then inflates to the cycles' cache slots), each
    layer Llama's attention with a sigmoid gate per channel (gate_proj h x q: attention_output_gate full) and a SwiGLU
    MLP; its RMSNorms hold no weights (the stacks' final norms too); z_L_init, the low-level state's h-wide start (not
    trained, a parameter all the same); attention_bias and mlp_bias refused; untied. The stacks run in a loop
    (H_cycles x L_cycles): ModelSpec.looped_stacks, which no inventory models."""
    for key in ("mlp_bias", "attention_bias"):  # the MLP's biases; the attention's, its gate's among them
        if flag(data, key, False, path):
            raise MemplanError(f"{path}: {key} (HRM's biases on the MLP's or the attention's and its gate's "
                               f"linears): not counted; {YAML_HINT}")
    per_stack = data.get("num_layers_per_stack")
    n = nat(data, "num_layers_per_stack" if per_stack is not None else "num_hidden_layers", 16, path)
    h = nat(data, "hidden_size", 1536, path)
    return dict(num_layers=2 * n, hidden_size=h, num_attention_heads=nat(data, "num_attention_heads", 12, path),
                head_dim=nat(data, "head_dim", 128, path), norm="rmsnorm", norm_params=False, final_norm=False,
                position_embedding="rope", bias=False, attention_output_gate="full", mlp="swiglu", ffn_hidden_size=nat(data, "intermediate_size", 4096, path),
                looped_stacks=True,
                norm_eps=data.get("rms_norm_eps"), tied_embeddings=flag(data, "tie_word_embeddings", False, path))


RECURRENT: dict[str, Callable[[dict, Path], dict[str, Any]]] = {"RecurrentGemmaForCausalLM": _recurrent_gemma,
                                                                "RwkvForCausalLM": _rwkv, "xLSTMForCausalLM": _xlstm,
                                                                "JetMoeForCausalLM": _jetmoe, "DogeForCausalLM": _doge,
                                                                "HrmTextForCausalLM": _hrm_text}
# their sequence-length keys (hf_config's POSITIONS): RWKV's context_length (its CUDA kernel's limit)
POSITIONS = {"RwkvForCausalLM": ("context_length", 1024)}
