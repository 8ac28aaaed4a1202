"""Issue 22: Gemma 4 from its config.json (memplan/presets/hf_families.py ``_gemma4``, the ModelSpec fields it sets,
memplan/memory/states.py ``gemma4_groups``), its parameters against transformers' count of the model on the meta
device and each new field's count against a hand derivation; its trace (validation/trace.py, composed per layer kind
by validation/compose.py) against a real CPU run's saved bytes."""

from __future__ import annotations

import json

import pytest

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.memory.shapes import weight_shapes
from memplan.memory.states import layer_kinds, total_params

# ---------------------------------------------------------------------------------------------
# each new field's parameters by hand (no transformers needed)

# h 64, a 4 heads, g 2 K / V heads 16 wide, f 128, v 512, L 4; layers 1 and 3 attend to all tokens (every 2nd),
# 0 and 2 slide; q / k norms per head and four norms per layer, as Gemma 4's layer
BASE = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_kv_heads=2, head_dim=16, ffn_hidden_size=128,
            vocab_size=512, seq_length=32, norm="rmsnorm", mlp="swiglu", bias=False, position_embedding="rope",
            qk_norm=True, sandwich_norms=True, sliding_window=16, sliding_window_pattern=2)
MOE = dict(num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32, moe_shared_ffn_hidden_size=128)


@pytest.mark.parametrize("before, after, added", [
    # full-attention heads 32 wide: per full layer q_proj h a 32 - h a 16 = 64 x 4 x 16 = 4096, o_proj 4096, k_proj +
    # v_proj 2 h g (32 - 16) = 4096, q_norm and k_norm 16 more each: 12,320; two full layers
    ({}, dict(full_attention_head_dim=32), 2 * 12_320),
    # one K / V head in the full layers: k_proj + v_proj 2 h (1 - 2) 16 = -2048 per full layer
    ({}, dict(full_attention_kv_heads=1), 2 * -2048),
    # keys as values in the full layers: no v_proj, h g 16 = 2048 per full layer
    ({}, dict(full_attention_k_eq_v=True), 2 * -2048),
    # the last two layers (2 sliding, 3 full) reuse K / V: no k_proj, v_proj (2 h g 16 = 4096) nor k_norm (16)
    ({}, dict(kv_shared_layers=2), 2 * -4112),
    # and their MLP 2f wide: gate, up, down 3 h f = 24,576 more each
    (dict(kv_shared_layers=2), dict(kv_shared_layers=2, kv_shared_double_mlp=True), 2 * 24_576),
    # per-layer inputs p = 8: the table v L p = 512 x 32 = 16,384, the projection h L p = 2048 and its norm p = 8, and
    # per layer the gate h p (512), the projection p h (512) and a norm h (64)
    ({}, dict(per_layer_input_size=8), 16_384 + 2048 + 8 + 4 * (512 + 512 + 64)),
    # a table of 256 rows: 256 L p = 8192, half of the v-row one
    (dict(per_layer_input_size=8), dict(per_layer_input_size=8, per_layer_input_vocab=256), -8192),
    # the router's input scale h and per-expert scale E in each of the four MoE layers
    (MOE, dict(MOE, moe_router_scales=True), 4 * (64 + 4)),
    # the MoE block's three norms, h each, in each MoE layer
    (MOE, dict(MOE, moe_block_norms=3), 4 * 3 * 64),
])
def test_each_gemma4_field_counts_its_parameters_by_hand(before, after, added):
    assert total_params(ModelSpec(**BASE, **after)) - total_params(ModelSpec(**BASE, **before)) == added


def test_a_stage_holds_its_share_of_the_full_layers_and_the_last_the_kv_sharing_ones():
    """For a pipeline stage (derived): the full-attention layers are its share of them, the K / V-sharing layers (the
    model's last) are on the last stage; one stage holding the model has all of each."""
    model = ModelSpec(**BASE, kv_shared_layers=2)
    assert model.full_layers == 2 and model.kv_shared_full_layers == 1  # layer 3 of the shared 2, 3
    first, last, whole = (layer_kinds(model, 2, 1, 0), layer_kinds(model, 2, 0, 1), layer_kinds(model, 4, 1, 1))
    assert (first["full"], first["kv_shared"], first["kv_shared_full"]) == (1, 0, 0)
    assert (last["full"], last["kv_shared"], last["kv_shared_full"]) == (1, 1, 1)
    assert (whole["full"], whole["kv_shared"], whole["kv_shared_full"]) == (2, 1, 1)


def test_the_gemma4_fields_that_cannot_hold_are_refused():
    with pytest.raises(ValueError, match="kv_shared_layers"):
        ModelSpec(**{**BASE, "kv_shared_layers": 4})
    with pytest.raises(ValueError, match="needs kv_shared_layers"):
        ModelSpec(**BASE, kv_shared_double_mlp=True)
    with pytest.raises(ValueError, match="need num_experts"):
        ModelSpec(**BASE, moe_router_scales=True)
    with pytest.raises(ValueError, match="per_layer_input_size"):
        ModelSpec(**BASE, per_layer_input_vocab=256)


# ---------------------------------------------------------------------------------------------
# against transformers (the model on the meta device)

pytest.importorskip("transformers")

from memplan.check import registry  # noqa: E402
from memplan.presets.hf_config import read_hf_config  # noqa: E402
from validation.registry import meta_params, tiny_config  # noqa: E402
from validation.trace import trace_hf_config  # noqa: E402

# four layers, every other one full with heads twice as wide and one K / V head (per_layer_config, as
# Gemma4TextConfig writes it)
FOUR = dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
            per_layer_config={str(i): {"head_dim": 32, "num_key_value_heads": 1} for i in (1, 3)})
EXPERTS = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)


@pytest.mark.parametrize("changes", [
    dict(FOUR, attention_k_eq_v=True),
    dict(FOUR, num_kv_shared_layers=2, use_double_wide_mlp=True),
    EXPERTS,
    dict(hidden_size_per_layer_input=0),
    dict(vocab_size_per_layer_input=256),
    dict(FOUR, attention_k_eq_v=True, num_kv_shared_layers=2, use_double_wide_mlp=True, attention_bias=True,
         **EXPERTS),
], ids=["k_eq_v", "kv_shared", "moe", "no_ple", "ple_rows", "all"])
def test_gemma4_variants_count_exactly(changes):
    config = {**tiny_config("gemma4_text"), **changes}
    assert registry.memplan_params(config) == meta_params(config) != meta_params(tiny_config("gemma4_text"))


def test_a_hub_style_config_gives_the_full_layers_by_global_head_dim(tmp_path):
    """The Hub's files name the full-attention layers' widths (global_head_dim, num_global_key_value_heads, the latter
    read with attention_k_eq_v only) where transformers writes per_layer_config; the multimodal config's text model
    is read and the vision and audio towers are said to be left out."""
    text = {k: v for k, v in tiny_config("gemma4_text").items() if k != "per_layer_config"}
    text.update(global_head_dim=24, num_global_key_value_heads=1, attention_k_eq_v=True)
    assert registry.memplan_params(text) == meta_params(text)
    config = {**tiny_config("gemma4"), "text_config": {**text, "model_type": "gemma4_text"}}
    assert registry.memplan_params(config) == meta_params(config) == meta_params(text)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert any("vision and audio tower" in note for note in read_hf_config(str(path)).notes)


@pytest.mark.parametrize("changes, says", [
    (dict(FOUR, per_layer_config={"1": {"head_dim": 32}, "3": {"head_dim": 64}}), "per_layer_config"),
    (dict(FOUR, per_layer_config={"1": {"head_dim": 32, "sliding_window": 8}}), "per_layer_config"),
    (dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention", "full_attention",
                                            "full_attention"]), "every N-th"),
    (dict(num_kv_shared_layers=2), "num_kv_shared_layers"),  # every one of the two layers: none with K / V
])
def test_gemma4_layouts_memplan_does_not_count_are_refused(changes, says):
    with pytest.raises(MemplanError, match=says) as err:
        registry.memplan_params({**tiny_config("gemma4_text"), **changes})
    assert "\n" not in str(err.value)


def test_a_drafter_is_refused_in_one_line():
    config = {**tiny_config("gemma4_unified_assistant")}
    with pytest.raises(MemplanError, match="speculative-decoding drafter") as err:
        registry.memplan_params(config)
    assert "\n" not in str(err.value)


# ten layers: sliding / full alternating, the last two reusing K / V (their MLP 2f wide), the full layers' keys as
# values with one K / V head 32 wide, per-layer inputs: six kinds of layer (sliding, full, the two that keep the K / V
# the last two reuse, the two that reuse them), 8 of the 10 traced (not 4 and 5) and composed
TEN = dict(num_hidden_layers=10, layer_types=["sliding_attention", "full_attention"] * 5,
           per_layer_config={str(i): {"head_dim": 32, "num_key_value_heads": 1} for i in range(1, 10, 2)},
           num_kv_shared_layers=2, use_double_wide_mlp=True, attention_k_eq_v=True)


@pytest.mark.parametrize("changes", [TEN, EXPERTS], ids=["ten_layers", "moe"])
def test_the_gemma4_trace_equals_a_real_cpu_run(changes):
    """The trace, composed from one layer of each kind (the per-layer input table stays L p wide: compose._PACKED),
    read by memplan, bucket by bucket equal to what the real model saves on CPU at s = 32, b = 2."""
    config = {**tiny_config("gemma4_text"), **changes}
    row = registry.Row("gemma4_text", "Gemma4ForCausalLM")
    registry.trace_row(row, config)
    assert row.traced and row.measured, row.trace_error


def test_the_checkpointed_layer_input_of_a_gemma4_trace():
    """With per-layer inputs the embeddings, layer 0's input, are saved outside the layers (by
    per_layer_model_projection), so gradient checkpointing keeps no input of layer 0 of its own: the layer input the
    trace records is layer 1's, h = 64 elements per token in bf16 (what `memplan estimate --impl hf-sdpa` reads;
    without it the file's moments name a layer input it does not give)."""
    traced = trace_hf_config(tiny_config("gemma4_text"), "hf-sdpa", kernels="cpu")
    assert traced["checkpoint"]["layer_input"] == {"dtype": "bfloat16", "elements": "64 s b", "bytes": "128 s b"}
    assert any("layer_input" in m["alive"] for m in traced["moments"] if m["scope"] == "layer")


@pytest.mark.parametrize("layout", ["fused", "separate"])
def test_the_per_layer_input_tensors_hold_their_counted_parameters(layout):
    """weight_shapes (the tensors the optimizers' shape-dependent states and the allocator's replay see) hold what
    param_groups count for the per-layer inputs (a model whose layers are all alike: no full-attention widths of their
    own, no K / V sharing)."""
    model = ModelSpec(**BASE, per_layer_input_size=8, per_layer_input_vocab=256)
    values, shapes = model.symbols(t=1), weight_shapes(model, layout)
    held = sum(times * w.count * int(w.numel.evaluate(values)) for scope, times in (
        ("first", 1), ("layer", model.num_layers), ("last", 1)) for w in shapes[scope])
    assert held == total_params(model)
