"""torchtitan 0.3.0's Llama 3 layer (memplan/inventory/titan.py) against torchtitan's real block run on CPU.

validation/titan.py builds the block from torchtitan's own config code and wraps it with torchtitan's own
FullAC / SelectiveAC; what the block keeps after its forward is measured with real tensors and traced under
FakeTensorMode with symbolic s and b. memplan's terms (written from torchtitan's code) must equal both, term by
term (each term's bytes per token as a multiset), so removing any term fails. FSDP2's per-rank states are measured
from torchtitan's apply_fsdp_to_decoder on 2 ranks over gloo. Needs torchtitan (the test extra)."""

import math
import os
from collections import Counter

import pytest
import sympy

pytest.importorskip("torchtitan")

from memplan.core.errors import MemplanError  # noqa: E402
from memplan.inventory.titan import (  # noqa: E402
    AC_MODES,
    checkpointed_layers,
    fsdp2_states,
    layer_bytes,
    llama3_layer_terms,
    local_numel,
    sharded_numel,
)
import torch  # noqa: E402

from memplan.core.symbolic import Poly  # noqa: E402
from memplan.inventory.titan import is_qwen3_dense, titan_inventory  # noqa: E402
from memplan.memory.states import total_params  # noqa: E402
from memplan.presets.catalog import load_model  # noqa: E402
from validation.titan import Shape, measure_block, measure_fsdp, measure_layer_ac, trace_block  # noqa: E402

SHAPE = Shape(h=64, a=4, g=2, f=160)  # head dim 16
TERMS = llama3_layer_terms(SHAPE.h, SHAPE.a, SHAPE.g, SHAPE.f)
S, B = sympy.Symbol("s", integer=True, positive=True), sympy.Symbol("b", integer=True, positive=True)


def _inventory(ac):
    """memplan's terms kept under ac without TP, the block input apart (the harness reports it as input_kept)."""
    return Counter(t.bytes_per_token for t in TERMS if ac in t.modes and t.id != "input" and not t.tp_only)


# Opt-in (MEMPLAN_TITAN_SLOW=1; ~20 s for the traces, ~45 s for the gloo run, over the suite's time budget): the
# fake mode's first run in a process takes 10-15 s; test_measured_bytes_equal_memplan makes the same term-by-term
# comparison with real tensors for all three modes in the suite.
SLOW = pytest.mark.skipif(not os.environ.get("MEMPLAN_TITAN_SLOW"), reason="set MEMPLAN_TITAN_SLOW=1 to run")


@pytest.mark.slow
@SLOW
@pytest.mark.parametrize("ac", AC_MODES)
def test_traced_terms_equal_memplan_terms(ac):
    traced = trace_block(SHAPE, ac)
    per_token = Counter()
    for _, _, expr in traced["rows"]:
        coeff = sympy.Poly(expr, S, B).as_dict()
        assert set(coeff) == {(1, 1)}, expr  # every kept storage is c s b: linear in s and in b
        per_token[int(coeff[(1, 1)])] += 1
    assert per_token == _inventory(ac)
    assert traced["input_kept"] == (ac != "none")


@pytest.mark.parametrize("ac,s,b", [("none", 48, 2), ("full", 40, 3), ("selective-op", 24, 3)])
def test_measured_bytes_equal_memplan(ac, s, b):
    measured = measure_block(SHAPE, ac, s, b)
    assert Counter(n // (s * b) for _, _, n in measured["rows"]) == _inventory(ac)
    input_bytes = 2 * SHAPE.h * s * b if measured["input_kept"] else 0
    assert measured["total"] + input_bytes == layer_bytes(TERMS, ac, s, b)


def test_selective_layer_ac_measured_equals_memplan():
    # torchtitan's selective per-layer AC (selective_ac_option 2) on 3 real blocks: its rule checkpoints the 2nd
    # block only; the stack keeps full's bytes for it, none's for the others (each measured above term by term)
    layers, every, s, b = 3, 2, 16, 2
    measured = measure_layer_ac(SHAPE, layers, every, s, b)
    assert measured["checkpointed"] == checkpointed_layers(layers, every) == [1]
    assert measured["total"] == sum(layer_bytes(TERMS, "full" if i == 1 else "none", s, b) for i in range(layers))
    # by hand: 2 x 3032 + 128 bytes per token (test_layer_bytes_by_hand) x s b = 6192 x 32
    assert measured["total"] == 6192 * s * b


def test_layer_bytes_by_hand():
    # per token, h = 64, a = 4, g = 2, f = 160, d = 16:
    # none: 2 norms x (4h + 4 + 4h + 2h) = 1288; the RoPE cache rows gathered at the positions d/2 complex64 = 4d
    #       = 64; q 2ad = 128, k 2gd = 64, v 64; out 2ad = 128, lse 4a = 16; SwiGLU 4 x 2f = 1280: 3032
    # full: input 2h = 128
    # selective-op: input 128 + wqkv 2(a + 2g)d = 256 + out 128 + lse 16 + w1 2f = 320 + w2 2h = 128: 976
    assert [layer_bytes(TERMS, ac, 1, 1) for ac in AC_MODES] == [3032, 128, 976]
    with pytest.raises(MemplanError):
        layer_bytes(TERMS, "budget:0.5", 1, 1)


def test_fsdp2_states_by_hand():
    # two ranks; a [5, 4] weight shards as ceil(5 / 2) = 3 rows of 4 per rank (dim 0 padded), a [4] norm as 2
    assert sharded_numel((5, 4), 2) == 12 and sharded_numel((4,), 2) == 2
    assert local_numel((5, 4), 2, 0) == 12 and local_numel((5, 4), 2, 1) == 8  # rows 3 and 2, unpadded
    st = fsdp2_states([(5, 4), (4,)], layer_shapes=[(5, 4)], head_shapes=[(4,)], n=2)
    # 14 elements per rank: fp32 params 56, grads 56, AdamW 2 x 56; the layer unsharded is 2 x 12 = 24 elements
    # (6 padded rows of 4), 2 in flight (GPU prefetch) x 24 x 2 bytes = 96; the head's 4 in bf16: 8
    assert (st.params, st.grads, st.adam, st.layers_unsharded, st.head_unsharded, st.total) == (56, 56, 112, 96, 8, 328)
    with pytest.raises(MemplanError):
        fsdp2_states([(4,)], [(4,)], [(4,)], n=0)


@pytest.mark.slow
@SLOW
def test_fsdp2_states_measured_over_gloo():
    # torchtitan's apply_fsdp_to_decoder on a 3-layer model, 2 ranks over gloo, one step with AdamW (~40 s)
    # vocab 251: the embedding and LM head ([251, 64]) shard as ceil(251 / 2) = 126 rows on each rank (padded)
    ranks = measure_fsdp(Shape(h=64, a=4, g=2, f=168), layers=3, vocab=251, world=2)
    for rank, r in enumerate(ranks):
        st = fsdp2_states(r["shapes"], r["layer_shapes"], [(64,), (251, 64)], n=2, prefetch=0, rank=rank)  # CPU

        assert (r["params"], r["grads"], r["adam"]) == (st.params, st.grads, st.adam)
        assert r["unsharded_forward_peak"] == r["unsharded_backward_peak"] == st.layers_unsharded
        # final norm [h] + LM head [v, h] gathered with padding: 2 x (64 + 2 x 126 x 64) = 32384 bytes
        assert r["unsharded_after_forward"] == st.head_unsharded == 32384
    # padding: more than half the model's fp32 parameters per rank (2 x 64 padded elements over the two [251, 64]);
    # rank 1's AdamW moments are 125 rows of each, not 126: 2 moments x 2 x 64 x 4 bytes = 1024 fewer
    assert ranks[0]["params"] == ranks[1]["params"] == 4 * (ranks[0]["total_params"] + 2 * 64) // 2
    assert ranks[0]["adam"] - ranks[1]["adam"] == 1024


@pytest.mark.slow
@SLOW
def test_hsdp_states_measured_over_gloo():
    # --dp-replicate 2 on 4 ranks: torchtitan's 2-D mesh (dp_replicate 2, fsdp 2) given to fully_shard; each rank
    # holds the shard of a 2-way FSDP (its rank in the shard group), not of a 4-way one (~90 s)
    ranks = measure_fsdp(Shape(h=64, a=4, g=2, f=168), layers=2, vocab=251, world=4, replicate=2)
    for rank, r in enumerate(ranks):
        st = fsdp2_states(r["shapes"], r["layer_shapes"], [(64,), (251, 64)], n=2, prefetch=0, rank=rank % 2)
        assert (r["params"], r["grads"], r["adam"]) == (st.params, st.grads, st.adam)
        assert r["unsharded_after_forward"] == st.head_unsharded


# --float8 (memplan/inventory/titan_float8.py): the same block with torchao's Float8Linear, converted by torchtitan's
# own Float8LinearConverter.convert (validation/titan.py build_block); memplan's kept terms of the same layer
# (tests/test_titan_float8.py float8_rows) must equal the measured storages


def _float8_measured(recipe, ac, s, b):
    from test_titan_float8 import TINY, float8_rows

    from memplan.inventory.titan_float8 import converted_linears

    pytest.importorskip("torchao")
    measured = measure_block(SHAPE, ac, s, b, float8=recipe)
    assert measured["float8_linears"] == len(converted_linears(TINY)) == 5  # wqkv, wo, w1, w2, w3
    rows, input_kept = float8_rows(recipe, ac, s, b)
    assert Counter(n for _, _, n in measured["rows"]) == rows
    assert measured["input_kept"] == input_kept
    return measured


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_measured_float8_selective_op_equals_memplan(recipe):
    # selective-op is where the recipes differ: torchtitan's save list holds aten.max, which tensorwise's amax is
    # (10 bf16 scalars: input and weight of 5 linears), rowwise's torch.amax is not. By hand, per token the bf16
    # layer's 976 - 128 (the input, apart) = 848 B x s b = 40,704 B at s 24, b 2; tensorwise + 10 x 2 B = 40,724 B
    measured = _float8_measured(recipe, "selective-op", 24, 2)
    assert measured["total"] == 40704 + (20 if recipe == "tensorwise" else 0)


@pytest.mark.slow
@SLOW
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("ac", ["none", "full"])
def test_measured_float8_equals_memplan_every_mode(recipe, ac):
    # none and full keep exactly the bf16 layer's tensors: torchao saves the bf16 input (float8_linear.py:40);
    # by hand none: 3032 B per token x 48 (test_layer_bytes_by_hand), full: nothing but the input
    measured = _float8_measured(recipe, ac, 24, 2)
    assert measured["total"] == (3032 * 48 if ac == "none" else 0)


@pytest.mark.slow
@SLOW
def test_fsdp2_float8_all_gather_measured_over_gloo():
    # --float8 tensorwise: torchao's conversion with enable_fsdp_float8_all_gather (torchtitan <= 0.2's), FSDP2 over 2
    # ranks (~75 s with the bf16 run): a layer's unsharded weights all-gathered in float8. By hand, the layer's linears
    # 64 x 128 + 64 x 64 + 3 x 64 x 160 = 43,008 elements at 1 B, its norms 2 x 64 at 2 B: 43,264 B against bf16's
    # 86,272 B; the LM head (filtered) and the fp32 states unchanged
    from test_titan_float8 import TINY

    from memplan.inventory.titan_float8 import gathered_layer

    pytest.importorskip("torchao")
    shape = Shape(h=64, a=4, g=2, f=160)
    bf16, fp8 = (measure_fsdp(shape, layers=2, vocab=256, world=2, float8=f)[0] for f in (None, "tensorwise"))
    layer = sum(math.prod(x) for x in fp8["layer_shapes"])
    assert bf16["unsharded_forward_peak"] == 2 * layer == 86272
    assert fp8["unsharded_forward_peak"] == fp8["unsharded_backward_peak"] == 2 * gathered_layer(TINY, layer) == 43264
    assert fp8["unsharded_after_forward"] == bf16["unsharded_after_forward"]
    assert (fp8["params"], fp8["grads"], fp8["adam"]) == (bf16["params"], bf16["grads"], bf16["adam"])


# torchtitan's dense Qwen3 block (validation/titan.py build_block, Shape(qwen3=True): its own _build_qwen3_layers);
# in this file so it shares the process's torchtitan warm-up (--dist loadfile)
Q_SHAPE = Shape(h=64, a=4, g=2, f=160, qwen3=True)  # head dim 16
Q_TERMS = llama3_layer_terms(Q_SHAPE.h, Q_SHAPE.a, Q_SHAPE.g, Q_SHAPE.f, qk_norm=True)


def test_qwen3_block_measured_equals_memplan_term_by_term():
    # AC none, term by term: the Llama 3 terms plus q_norm's and k_norm's fp32 input, rstd and fp32 x * rstd;
    # selective-op keeps what Llama 3's keeps (the q / k norms are recomputed): its total (full, the block input
    # alone, is the checkpoint wrapper's as for Llama 3: test_measured_bytes_equal_memplan; not rerun, for time)
    s, b = 24, 2
    for ac in ("none", "selective-op"):
        measured = measure_block(Q_SHAPE, ac, s, b)
        if ac == "none":
            assert Counter(n // (s * b) for _, _, n in measured["rows"]) == Counter(
                t.bytes_per_token for t in Q_TERMS if ac in t.modes and t.id != "input" and not t.tp_only)
        input_bytes = 2 * Q_SHAPE.h * s * b if measured["input_kept"] else 0
        assert measured["total"] + input_bytes == layer_bytes(Q_TERMS, ac, s, b)


def test_qwen3_qk_norm_terms_by_hand():
    # per token, a = 4, g = 2, d = 16: q_norm 4ad + 4a + 4ad = 256 + 16 + 256 = 528, k_norm 128 + 8 + 128 = 264:
    # 792 over Llama 3's 2968 without its RoPE rows (test_layer_bytes_by_hand), and CosSinRoPE's cos and sin gathered
    # at the positions, fp32 2d = 8d = 128 B (Llama 3's complex d/2: 64), under AC none; nothing more otherwise
    assert [layer_bytes(Q_TERMS, ac, 1, 1) for ac in AC_MODES] == [2968 + 792 + 128, 128, 976]


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


def test_rope_cache_per_layer_equals_torchtitan():
    # each block builds its own RoPE module; its buffer holds max_seq_len positions (the Trainer sets training.seq_len):
    # Llama 3's ComplexRoPE s x d/2 complex64, Qwen3's CosSinRoPE cos and sin in fp32 [s, 2d] (memplan's term is
    # counted once per layer with the weights: memplan/memory/dp_stack.py; a whole step in tests/test_titan_step.py)
    from torchtitan.models.common import ComplexRoPE, CosSinRoPE

    from memplan.memory.dp_stack import rope_cache_bytes

    s, d = 48, 32
    for spec, rope in (("llama3-8b", ComplexRoPE.Config(dim=d, max_seq_len=s, theta=500000, scaling="llama")),
                       ("qwen3-8b", CosSinRoPE.Config(dim=d, max_seq_len=s, theta=1e6))):
        model = load_model(spec).model.model_copy(update=dict(seq_length=s, hidden_size=4 * d, num_attention_heads=4,
                                                              num_kv_heads=2, head_dim=d))
        cache = rope.build().cache
        by_hand = {"llama3-8b": 4, "qwen3-8b": 8}[spec] * s * d
        assert rope_cache_bytes(model) == cache.untyped_storage().nbytes() == by_hand
    # DeepSeek-V3's attention rotates qk_rope_head_dim = 64 of each head (torchtitan's deepseek_v3 flavours: a yarn
    # ComplexRoPE over that width): s x 32 complex64 = 4 s 64 bytes, whatever the head's other widths
    dsv3 = load_model("deepseek-v3").model.model_copy(update=dict(seq_length=s))
    rope = ComplexRoPE.Config(dim=64, max_seq_len=s, theta=10000.0, scaling="yarn", rope_factor=40.0, beta_fast=32.0,
                              beta_slow=1.0, original_seq_len=4096)
    assert dsv3.qk_rope_head_dim == 64
    assert rope_cache_bytes(dsv3) == rope.build().cache.untyped_storage().nbytes() == 4 * s * 64


def test_qwen3_8b_inventory_has_the_qk_norm_terms():
    # --impl torchtitan on the qwen3-8b preset (a = 32, g = 8, d = 128): CPU, the norms' fp32 input x (a d = 4,096
    # elements per token for q, g d = 1,024 for k); CUDA's fused kernel keeps the bf16 input (same elements) and the
    # rstd (a = 32, g = 8 per token); DeepSeek-V3 refused here: its layer is titan_dsv3.py's (tests/test_titan_dsv3.py)
    model = load_model("qwen3-8b").model
    cpu = {t.id: t.elements for t in titan_inventory(model, "cpu").terms}
    cuda = {t.id: t.elements for t in titan_inventory(model, "cuda").terms}
    assert cpu["q_norm.x_fp32"] == Poly.parse("4096 s b") and cpu["k_norm.x_fp32"] == Poly.parse("1024 s b")
    assert cuda["q_norm.x"] == Poly.parse("4096 s b") and cuda["k_norm.rstd"] == Poly.parse("8 s b")
    assert "q_norm.x_rstd" in cpu and "q_norm.x_rstd" not in cuda
    with pytest.raises(MemplanError):
        titan_inventory(load_model("deepseek-v3").model, "cpu")


def test_text_dataset_always_yields_positions(monkeypatch):
    # torchtitan 0.3.0's text dataset (hf_datasets/text_datasets.py, run on an in-memory dataset with a byte
    # tokenizer): every sample is {"input", "positions"} (int64, range within each document, restarting at a document
    # boundary), which its Trainer's post_dataloading_process hands the model as a kwarg; torch's default collate
    # stacks them to (b, s), the shape validation/titan.py loader_positions gives every measured block
    from datasets import Dataset
    from torch.utils.data import default_collate
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets import text_datasets as td

    class Bytes:
        def encode(self, text, add_bos=True, add_eos=True):
            return [1] * add_bos + list(text.encode()) + [2] * add_eos

    docs = ["abcdefghij", "klmno", "pqrstuvwxyz0123456789"]
    monkeypatch.setitem(td.DATASETS, "memplan_tiny", DatasetConfig(
        path="", loader=lambda _p: Dataset.from_dict({"text": docs}), sample_processor=lambda x: x["text"]))
    samples = list(td.HuggingFaceTextDataset("memplan_tiny", None, Bytes(), seq_len=8))
    assert len(samples) == (11 + 6 + 22) // 8 == 4
    assert all(set(x) == {"input", "positions"} and x["positions"].dtype == torch.int64 for x, _ in samples)
    # the first document's last 3 tokens (renumbered from 0 at a sample's start: _normalize_positions), then the
    # second's from 0
    assert samples[1][0]["positions"].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    batch, _ = default_collate(samples[:2])
    assert batch["positions"].shape == (2, 8)


def test_positions_make_each_layer_keep_its_gathered_rope_rows():
    # the same real block with and without the positions (validation/titan.py kept_storages): with them each layer's
    # RoPE gathers its own copy of the cache rows and keeps it under AC none, 4d B per token (ComplexRoPE, d/2
    # complex64) for Llama 3, 8d (CosSinRoPE's fp32 cos and sin) for Qwen3: memplan's rope.gathered; selective-op
    # recomputes the gather (not in SelectiveAC's save list), full keeps only the checkpoint's inputs
    s, b, d = 24, 2, SHAPE.h // SHAPE.a
    for shape, terms, width in ((SHAPE, TERMS, 4 * d), (Q_SHAPE, Q_TERMS, 8 * d)):
        for ac in ("none", "selective-op"):
            with_pos, without = (measure_block(shape, ac, s, b, positions=p) for p in (True, False))
            extra = Counter(with_pos["rows"]) - Counter(without["rows"])
            if ac == "none":
                assert [n for _, _, n in extra.elements()] == [width * s * b]
                assert next(t for t in terms if t.id == "rope.gathered").bytes_per_token == width
            else:
                assert not extra and with_pos["total"] == without["total"]


@pytest.mark.slow
@SLOW
def test_compiled_block_saves_the_gathered_rope_rows_too():
    # modelled since the compiled tables are traced with the positions (memplan/inventory/compiled.py rope_rows,
    # compiled_moe.py's; tests/test_compile.py, tests/test_compiled_moe.py): with them the compiled block (AOTAutograd with
    # inductor's partitioner, validation/compiled.py) saves the RoPE rows gathered at them, 4d B a token for Llama 3
    # (the conjugated complex64 copy), 8d for Qwen3 (cos and sin, two views of one fp32 [2d] gather); without them
    # none (the buffer is a graph input). s 24, b 3, d 16: 4 x 16 x 72 = 4608
    from validation.compiled import titan_saved_rope_rows

    assert titan_saved_rope_rows(False, False) == titan_saved_rope_rows(True, False) == []
    assert [(dt, n) for _, dt, n in titan_saved_rope_rows(False, True)] == [("complex64", 4608)]
    assert [(dt, n) for _, dt, n in titan_saved_rope_rows(True, True)] == [("float32", 4608)] * 2
