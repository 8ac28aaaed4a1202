"""torchtitan 0.3.0's dense Qwen3 block (memplan/inventory/titan.py llama3_layer_terms with qk_norm) against the real
block run on CPU (validation/titan.py build_block with Shape(qwen3=True): torchtitan's own _build_qwen3_layers), and
the real Qwen3 model's parameter count against memplan's. Needs torchtitan (the test extra)."""

from collections import Counter

import pytest

pytest.importorskip("torchtitan")

import torch  # noqa: E402

from memplan.inventory.titan import AC_MODES, is_qwen3_dense, layer_bytes, llama3_layer_terms  # noqa: E402
from memplan.memory.states import total_params  # noqa: E402
from memplan.presets.catalog import load_model  # noqa: E402
from validation.titan import Shape, measure_block  # noqa: E402

SHAPE = Shape(h=64, a=4, g=2, f=160, qwen3=True)  # head dim 16
TERMS = llama3_layer_terms(SHAPE.h, SHAPE.a, SHAPE.g, SHAPE.f, qk_norm=True)


def test_qwen3_block_measured_equals_memplan_term_by_term():
    # AC none, term by term: the Llama 3 terms plus q_norm's and k_norm's fp32 input, rstd and fp32 x * rstd;
    # full and selective-op keep what Llama 3's keep (the q / k norms are recomputed): their totals
    s, b = 24, 2
    for ac in AC_MODES:
        measured = measure_block(SHAPE, ac, s, b)
        if ac == "none":
            assert Counter(n // (s * b) for _, _, n in measured["rows"]) == Counter(
                t.bytes_per_token for t in TERMS if ac in t.modes and t.id != "input" and not t.tp_only)
        input_bytes = 2 * SHAPE.h * s * b if measured["input_kept"] else 0
        assert measured["total"] + input_bytes == layer_bytes(TERMS, ac, s, b)


def test_qwen3_qk_norm_terms_by_hand():
    # per token, a = 4, g = 2, d = 16: q_norm 4ad + 4a + 4ad = 256 + 16 + 256 = 528, k_norm 128 + 8 + 128 = 264:
    # 792 over Llama 3's 2968 (tests/test_titan.py test_layer_bytes_by_hand) under AC none, nothing more otherwise
    assert [layer_bytes(TERMS, ac, 1, 1) for ac in AC_MODES] == [2968 + 792, 128, 976]


def test_qwen3_parameters_equal_torchtitan_model():
    # torchtitan's Qwen3Model (meta device) built from its own config code at a small shape: its parameter count is
    # memplan's for the same ModelSpec (the q / k norm weights d each per layer included)
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_layers, _qwen3_norm

    h, a, g, d, f, v, layers = 64, 4, 2, 32, 160, 256, 2  # head dim 32 != h / a, as Qwen3's presets may set
    cfg = Qwen3Model.Config(
        vocab_size=v, dim=h, norm=_qwen3_norm(h), tok_embeddings=Embedding.Config(num_embeddings=v, embedding_dim=h),
        lm_head=Linear.Config(in_features=h, out_features=v),
        layers=_build_qwen3_layers(n_layers=layers, dim=h, n_heads=a, n_kv_heads=g, head_dim=d, hidden_dim=f,
                                   attn_backend="flex", rope=CosSinRoPE.Config(dim=d, max_seq_len=64, theta=1e6)))
    with torch.device("meta"):
        real = sum(p.numel() for p in cfg.build().parameters())
    spec = load_model("qwen3-8b").model.model_copy(update=dict(
        num_layers=layers, hidden_size=h, num_attention_heads=a, num_kv_heads=g, head_dim=d, ffn_hidden_size=f,
        vocab_size=v))  # the preset's layout fields at a small shape
    assert is_qwen3_dense(spec)
    assert total_params(spec) == real
