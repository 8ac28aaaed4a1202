"""torchtitan 0.3.0's tensor parallelism (--impl torchtitan --tp T) against torchtitan's own parallelize code.

validation/titan.py ``tp_rank`` builds a 2-layer torchtitan Llama3Model with torchtitan's sharding configs
(``set_llama3_sharding_config``, sequence parallelism on) and runs ``parallelize_llama`` with
``tensor_parallel_degree`` 2 on 2 ranks over gloo (the ``partial_dtensor`` backend: DTensor TP, SequenceParallel
norms, ColwiseParallel wqkv / w1 / w3 / LM head, RowwiseParallel wo / w2 reducing-scattering to the sequence; the
vocab-parallel loss), one step with AdamW.  RECORDED holds what it measured (both ranks alike), from

    MEMPLAN_TITAN_SLOW=1 PYTHONPATH=. pytest tests/test_titan_tp.py -k gloo     (~90 s)

which re-measures it and fails if torchtitan's code keeps anything else; the states sharded over d x t are measured
on 4 ranks (FSDP 2 x TP 2) by the opt-in ``test_states_sharded_over_d_x_t_gloo`` (~50 s).  The fast tests hold memplan's per-rank
terms (memplan/inventory/titan.py: each term's split, "tp" / t, "sp" / t or whole, and the TP-only terms) against the
recorded storages term by term, and the states against a hand derivation."""

import os
from collections import Counter

import pytest

from memplan.inventory.titan import AC_MODES, layer_bytes, llama3_layer_terms, rank_bytes_per_token

H, A, G, F, V, T = 64, 4, 2, 160, 256, 2
S, B = 16, 2  # the global s b = 32 tokens; each rank holds 16 of them sequence-sharded
TERMS = llama3_layer_terms(H, A, G, F)

# measured per rank (bytes of each storage layer 0 keeps after its forward, by the op that made it; the model called
# with the dataloader's positions, as torchtitan's Trainer calls it: none keeps the RoPE rows gathered at them, 2048 =
# 4d x the whole s b, not split over t)
_NORM = [4096, 64, 4096, 4096]  # x fp32 (s b / t tokens), rstd, x * rstd, the all-gathered output (all s b tokens)
RECORDED = {
    "none": {"layer": _NORM + [1024, 2048, 2048, 1024, 2048, 256] + _NORM + [5120] * 4, "input_kept": False},
    "full": {"layer": [], "input_kept": True},
    "selective-op": {"layer": [4096, 2048, 256, 2048, 5120, 4096, 2048], "input_kept": True},
}
INPUT_BYTES = 2048  # the block input: s b / t tokens x 2h
TAIL = _NORM  # the final norm and the LM head (its input: the all-gathered final-norm output)
LOSS = [16384]  # the loss's saved fp32 log-probabilities of the rank's vocab shard: s b x v / t x 4
STATES = {"params": 238848, "grads": 238848, "adam": 477696}


def _memplan(ac):
    """memplan's terms kept under ac on one rank of t = 2 (bytes per global token), the block input apart."""
    return Counter(rank_bytes_per_token(x, T) for x in TERMS if ac in x.modes and x.id != "input")


@pytest.mark.parametrize("ac", AC_MODES)
def test_recorded_layer_equals_memplan_term_by_term(ac):
    rec = RECORDED[ac]
    assert Counter(n // (S * B) for n in rec["layer"]) == _memplan(ac)
    input_bytes = INPUT_BYTES if rec["input_kept"] else 0
    assert sum(rec["layer"]) + input_bytes == layer_bytes(TERMS, ac, S, B, T)


def test_layer_bytes_by_hand():
    # per global token on one of t = 2 ranks, h 64, a 4, g 2, f 160, d 16:
    # none: 2 norms x ((4h + 4 + 4h) / t + the gathered output 2h) = 2 x (258 + 128) = 772; the RoPE rows gathered
    #       at the positions 4d = 64, whole; q 2ad / t = 64, k 2gd / t = 32, v 32, out 64, lse 4a / t = 8; SwiGLU
    #       4 x 2f / t = 640: 1676 (3032 at t = 1)
    # full: the sequence-sharded input 2h / t = 64
    # selective-op: input 64, wqkv 2(a + 2g)d / t = 128, out 64, lse 8, wo reduce-scattered 2h / t = 64, w1 2f / t
    #       = 160, w2's partial sums over the whole sequence 2h = 128, w2 reduce-scattered 64: 680
    assert [layer_bytes(TERMS, ac, 1, 1, T) for ac in AC_MODES] == [1676, 64, 680]
    assert [layer_bytes(TERMS, ac, 1, 1) for ac in AC_MODES] == [3032, 128, 976]  # the TP-only terms vanish at t 1


def test_tail_loss_and_states_by_hand():
    # the final norm as the layers' norms (fp32 x, rstd, x * rstd over s b / t tokens; the output all-gathered)
    final = [x for x in TERMS if x.id.startswith("ffn_norm.")]
    assert Counter(TAIL) == Counter(rank_bytes_per_token(x, T) * S * B for x in final)
    assert LOSS == [S * B * V // T * 4]
    # fp32 states per rank: the matrices / t (wqkv, w1, w3, LM head and embedding rows; wo, w2 columns), the norms
    # whole: embedding 256 x 64 / 2 = 8192; per layer (128 x 64 + 64 x 64 + 3 x 160 x 64) / 2 + 2 x 64 = 21632;
    # final norm 64; LM head 8192: 59712 elements, 4 B each; AdamW's two moments 8 B
    elements = 8192 + 2 * 21632 + 64 + 8192
    assert STATES == {"params": 4 * elements, "grads": 4 * elements, "adam": 8 * elements}


SLOW = pytest.mark.skipif(not os.environ.get("MEMPLAN_TITAN_SLOW"), reason="set MEMPLAN_TITAN_SLOW=1 to run")


@pytest.mark.slow
@SLOW
@pytest.mark.parametrize("ac", AC_MODES)
def test_gloo_run_equals_recorded(ac):
    pytest.importorskip("torchtitan")
    from validation.titan import Shape, measure_tp

    for r in measure_tp(Shape(h=H, a=A, g=G, f=F), layers=2, vocab=V, world=T, s=S, b=B, ac=ac):
        assert Counter(n for _, _, n in r["layer"]) == Counter(RECORDED[ac]["layer"])
        assert (r["input_kept"], r["input_bytes"]) == (RECORDED[ac]["input_kept"], INPUT_BYTES)
        assert Counter(n for _, _, n in r["tail"]) == Counter(TAIL)
        assert [n for _, _, n in r["loss"]] == LOSS
        assert {k: r[k] for k in STATES} == STATES


def test_every_term_is_needed():
    # removing any term memplan keeps on a TP rank (under any AC mode) breaks the term-by-term match above
    for removed in TERMS:
        for ac in AC_MODES:
            if ac not in removed.modes or removed.id == "input":
                continue
            kept = Counter(rank_bytes_per_token(x, T) for x in TERMS if ac in x.modes and x.id not in ("input", removed.id))
            assert kept != Counter(n // (S * B) for n in RECORDED[ac]["layer"]), (removed.id, ac)


@pytest.mark.slow
@SLOW
def test_states_sharded_over_d_x_t_gloo():
    # FSDP 2 x TP 2 on 4 ranks (torchtitan's mesh puts tp innermost: rank r is TP rank r % 2 of FSDP rank r // 2),
    # vocab 254, f 168: each parameter's TP shard (wqkv [128, 64] -> [64, 64], wo [64, 64] -> [64, 32], w1 / w3
    # [168, 64] -> [84, 64], w2 [64, 168] -> [64, 84], embedding and LM head [254, 64] -> [127, 64], norms whole)
    # sharded by fully_shard over 2 ranks, dim 0 padded (127 rows -> 64 + 64); by hand per rank: embedding 64 x 64 =
    # 4096, per layer 2048 + 1024 + 2 x 2688 + 32 x 84 + 2 x 32 = 11200, final norm 32, LM head 4096: 30624
    # elements, 122496 fp32 bytes; AdamW's moments unpadded: FSDP rank 1 holds 63 of the 127 rows (128 fewer)
    pytest.importorskip("torchtitan")
    from memplan.inventory.titan import fsdp2_states
    from validation.titan import Shape, measure_tp

    f = 168
    layer = [(64, 64), (64, 32), (84, 64), (64, 84), (84, 64), (64,), (64,)]
    shapes = [(127, 64)] + 2 * layer + [(64,), (127, 64)]
    ranks = measure_tp(Shape(h=H, a=A, g=G, f=f), layers=2, vocab=254, world=4, s=S, b=B, ac="full", tp=2)
    for rank, r in enumerate(ranks):
        st = fsdp2_states(shapes, layer, [(64,), (127, 64)], n=2, prefetch=0, rank=rank // 2)
        assert (r["params"], r["grads"], r["adam"]) == (st.params, st.grads, st.adam)
        assert r["params"] == 4 * 30624 and r["adam"] == 8 * (30624 - 128 * (rank // 2))


# torch.compile under TP (issue 24): layer 0's compiled block on each of the 2 ranks, torchtitan's parallelize_llama
# (TP, then apply_compile per block; AOTAutograd with inductor's partitioner and decompositions), measured by
#     MEMPLAN_TITAN_SLOW=1 PYTHONPATH=. pytest tests/test_titan_tp.py -k compiled_gloo     (~60 s, 2 runs)
# (validation/titan_tp_compile.py; the model called with the dataloader's positions, as torchtitan's Trainer calls it):
# the bytes of each tensor the forward graph saves for the backward, which equal the storages a saved-tensors hook
# sees in the real run (parameters and the positions, held by the training loop, apart), both ranks alike.  --ac full with
# compile and TP stops in torch 2.13 (memplan/inventory/compiled.py FULL_TP_ERROR): derived, not recorded.
COMPILED = {
    # the residual sum after attention, rstd, the all-gathered norm output, q, k, v, lse, the attention output,
    # wo's reduce-scattered output, rstd, the all-gathered norm output, w1's, w3's outputs and their SwiGLU product,
    # the RoPE rows gathered at the positions (complex64, whole: without the positions the graph saved no such row)
    "none": [2048, 64, 4096, 2048, 1024, 1024, 256, 2048, 2048, 64, 4096, 5120, 5120, 5120, 2048],
    # the block input, the fused QKV output, the attention output and lse, wo's reduce-scattered output, w1's output
    "selective-op": [2048, 4096, 2048, 256, 2048, 5120],
}


def _compiled(ac, t=T, drop=""):
    """memplan's compiled torchtitan terms kept under ac on one rank of t, in bytes at S, B (h 64, a 4, g 2, f 160)."""
    from memplan.core.training import Recompute
    from memplan.inventory.compiled import compiled_terms

    rec = {"none": Recompute.NONE, "selective-op": Recompute.SELECTIVE}[ac]
    values = dict(s=S, b=B, h=H, a=A, g=G, q=H, f=F, t=t, cp=1)
    return Counter(int(x.bytes(values, 2, 1)) for x in compiled_terms("torchtitan") if x.kept(rec) and x.id != drop)


@pytest.mark.parametrize("ac", ["none", "selective-op"])
def test_compiled_tp_recorded_equals_memplan_term_by_term(ac):
    assert _compiled(ac) == Counter(COMPILED[ac])
    for x in _compiled_ids(ac):  # a term taken out of the table breaks the match
        assert _compiled(ac, drop=x) != Counter(COMPILED[ac]), x


def _compiled_ids(ac):
    from memplan.core.training import Recompute
    from memplan.inventory.compiled import compiled_terms

    rec = {"none": Recompute.NONE, "selective-op": Recompute.SELECTIVE}[ac]
    return [x.id for x in compiled_terms("torchtitan") if x.kept(rec)]


def test_compiled_tp_split_by_hand():
    # per global token on one of t = 2 ranks (h 64, a 4, g 2, f 160, d 16), the split of each term:
    # none: residual 2h / t = 64 (sp), rstd 4 / t = 2 (sp), the all-gathered norm output 2h = 128 (whole), q 2ad / t
    #   = 64, k and v 2gd / t = 32 each, lse 4a / t = 8, attention output 64 (tp), wo's output reduce-scattered 2h / t
    #   = 64 (sp), rstd 2, norm output 128, w1, w3 and their product 2f / t = 160 each (tp), the RoPE rows gathered
    #   at the positions 4d = 64 (whole): 1132
    # selective-op: block input 64 (sp), fused QKV 2(a + 2g)d / t = 128, output 64, lse 8 (tp), wo reduce-scattered
    #   64 (sp, TP only), w1 160 (tp): 488; at t = 1 the TP-only term vanishes: 128 + 256 + 128 + 16 + 320 = 848
    tokens = S * B
    assert sum(COMPILED["none"]) == 1132 * tokens and sum(COMPILED["selective-op"]) == 488 * tokens
    assert sum(n * k for n, k in _compiled("none").items()) == 1132 * tokens
    assert sum(n * k for n, k in _compiled("selective-op", t=1).items()) == 848 * tokens


@pytest.mark.slow
@SLOW
@pytest.mark.parametrize("ac", ["none", "selective-op"])
def test_compiled_gloo_run_equals_recorded(ac):
    pytest.importorskip("torchtitan")
    from validation.titan import Shape
    from validation.titan_tp_compile import measure_compiled_tp

    for r in measure_compiled_tp(Shape(h=H, a=A, g=G, f=F), layers=2, vocab=V, world=T, s=S, b=B, ac=ac):
        assert [n for _, _, n in r["graph"]] == COMPILED[ac]
        assert Counter(n for _, n in r["saved"]) == Counter(COMPILED[ac])
        assert r["input_bytes"] == INPUT_BYTES


def test_estimate_compile_with_tp_by_hand():
    # llama3-8b (h 4096, a 32, g 8, f 14336, d 128) compiled, t = 2, per global token on a rank: residual 2h / t 4096,
    # rstd 2, gathered norm output 2h 8192, q 2ad / t 4096, k and v 2gd / t 1024 each, lse 4a / t 64, output 4096,
    # wo reduce-scattered 4096, rstd 2, gathered norm output 8192, w1 / w3 / SwiGLU 2f / t 14336 each, the RoPE rows
    # gathered at the positions 4d 512 (whole): 78,404 B;
    # selective-op: input 4096, fused QKV 2(a + 2g)d / t 6144, output 4096, lse 64, wo reduce-scattered 4096, w1 14336:
    # 32,832 B; full: the sequence-sharded input 4096 B (derived: torch 2.13 does not run it, compiled.FULL_TP_ERROR)
    from memplan.api.estimating import estimate

    for ac, per_token in (("none", 78404), ("selective-op", 32832), ("full", 4096)):
        est = estimate("llama3-8b", impl="torchtitan", gpus=8, tp=2, compile=True, ac=ac, seq_len=1024, micro_batch=1,
                       global_batch=8, device="cuda")
        assert est.estimate.per_layer_bytes == per_token * 1024, ac
        assert any("--compile with --tp 2" in n for n in est.notes) and (ac != "full") != any(
            "DERIVED" in n for n in est.notes), ac


# --float8 with --tp (issue 24): torchtitan 0.3.0 converts the linears to torchao's Float8Linear before its sharding
# configs, so DTensor TP shards them like the bf16 ones; measured per rank (both alike) by
#     MEMPLAN_TITAN_SLOW=1 PYTHONPATH=. pytest tests/test_titan_tp.py -k float8_gloo     (~150 s, 4 runs)
# (validation/titan.py measure_tp(float8=...)): each rank keeps the bf16 rank's storages (RECORDED), plus under
# selective-op with tensorwise the 10 bf16 amax scalars (2 B each) its save list (aten.max) holds; 10 Float8Linear
# modules (5 per layer), the fp32 states as bf16's (STATES)
FLOAT8 = {("none", "tensorwise"): RECORDED["none"]["layer"],
          ("selective-op", "tensorwise"): RECORDED["selective-op"]["layer"] + [2] * 10,
          ("selective-op", "rowwise"): RECORDED["selective-op"]["layer"], ("full", "rowwise"): []}


def _float8_rank(ac, recipe, drop=""):
    """memplan's float8 torchtitan layer terms kept under ac on one rank of t = 2, one entry per storage (bytes)."""
    from memplan.core.model import ModelSpec
    from memplan.core.training import Recompute
    from memplan.inventory import titan_float8
    from memplan.inventory.titan import titan_inventory

    tiny = ModelSpec(name="tiny-titan", num_layers=1, hidden_size=H, num_attention_heads=A, num_kv_heads=G,
                     ffn_hidden_size=F, seq_length=S, vocab_size=V, norm="rmsnorm", mlp="swiglu",
                     position_embedding="rope", tied_embeddings=False, dropout=False, bias=False, attention="flash")
    rec = {"none": Recompute.NONE, "selective-op": Recompute.SELECTIVE, "full": Recompute.FULL}[ac]
    out = Counter()
    for x in titan_float8.apply(titan_inventory(tiny, "cpu"), tiny, recipe).terms:
        n = int(x.bytes(dict(s=S, b=B, t=T, cp=1), 2, 1)) if x.scope == "layer" and x.kept(rec) else 0
        if n and x.id not in ("input", drop):
            out[n // x.storages] += x.storages
    return out


@pytest.mark.parametrize("ac,recipe", sorted(FLOAT8))
def test_float8_tp_recorded_equals_memplan(ac, recipe):
    assert _float8_rank(ac, recipe) == Counter(FLOAT8[ac, recipe])
    if recipe == "tensorwise" and ac == "selective-op":  # the amax term is needed
        assert _float8_rank(ac, recipe, drop="float8.amax") != Counter(FLOAT8[ac, recipe])


@pytest.mark.slow
@SLOW
@pytest.mark.parametrize("ac,recipe", sorted(FLOAT8))
def test_float8_gloo_run_equals_recorded(ac, recipe):
    pytest.importorskip("torchao")
    from validation.titan import Shape, measure_tp

    for r in measure_tp(Shape(h=H, a=A, g=G, f=F), layers=2, vocab=V, world=T, s=S, b=B, ac=ac, float8=recipe):
        assert Counter(n for _, _, n in r["layer"]) == Counter(FLOAT8[ac, recipe])
        assert r["float8_linears"] == 10 and {k: r[k] for k in STATES} == STATES


def test_float8_all_gather_of_the_tp_shard_by_hand():
    # derived: llama3-70b's layer linears are 8192 x (8192 + 2 x 8 x 128) + 8192 x 8192 + 3 x 8192 x 28672 =
    # 855,638,016 elements, 106,954,752 on a rank of TP 8; tensorwise's FSDP2 float8 all-gather holds the running
    # and the prefetched layer at 1 B instead of 2 B per element: 2 x 106,954,752 B less than rowwise (bf16 gather)
    from memplan.api.estimating import estimate

    weights = {r: estimate("llama3-70b", impl="torchtitan", gpus=256, tp=8, ac="full", seq_len=1024, micro_batch=1,
                           global_batch=256, float8=r).estimate.peak.weights for r in ("rowwise", "tensorwise")}
    assert weights["rowwise"] - weights["tensorwise"] == 2 * 106954752


def test_the_vocab_parallel_embedding_keeps_its_mask_under_tp_only(capsys):
    # torchtitan's TP makes tok_embeddings vocab-parallel (RowwiseParallel: DTensor's _MaskPartial), which keeps its
    # vocab-shard mask in bf16 for the backward: 2 B per token of the micro-batch, whole on every TP rank (the ids are
    # replicated), on the first stage: 2 x 4,096 x 1 = 8,192 B; measured in DeepSeek-V3's MTP layer calling the same
    # module (tests/test_titan_mtp_tp.py)
    import json
    from memplan.cli import main as cli_main

    def masks(tp):
        with pytest.raises(SystemExit):
            cli_main(["estimate", "--model", "llama3-8b", "--impl", "torchtitan", "--gpus", "8", "--tp", str(tp),
                      "--ac", "full", "--seq-len", "4096", "--micro-batch", "1", "--json"])
        terms = json.loads(capsys.readouterr().out)["activations"]["terms"]
        return [t["stage_bytes"] for t in terms if t["id"] == "embed_mask"]

    assert masks(1) == [] and masks(2) == [8192]
