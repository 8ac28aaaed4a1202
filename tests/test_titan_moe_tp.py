"""torchtitan 0.3.0's Qwen3 MoE with tensor parallelism (--impl torchtitan --tp T, with and without --ep) against
torchtitan's own parallelize_qwen3 run over gloo.

validation/titan_moe.py ``moe_tp_rank`` builds a 2-layer torchtitan Qwen3 MoE model (h 64, 4 heads, 2 KV heads,
head dim 16, 8 experts of width 32, top-2, vocab 256) with torchtitan's sharding configs
(``set_qwen3_sharding_config``, sequence parallelism on) and runs ``parallelize_qwen3`` with
``tensor_parallel_degree`` 2 on 2 ranks (ep 1: the experts' hidden dim sharded over tp, the MoE's input all-gathered
over the sequence, its output reduce-scattered; ep 2: the experts sharded over ep, the MoE keeping the rank's
sequence shard), balanced routing, one step with AdamW. RECORDED holds what it measured (both ranks alike), from

    MEMPLAN_TITAN_SLOW=1 PYTHONPATH=. pytest tests/test_titan_moe_tp.py -k gloo     (~90 s)

which re-measures it. The fast tests hold memplan's per-rank terms (memplan/inventory/titan_moe.py: the MoE's
token-sized terms ``etp_gathered``: whole at ep 1 (etp = t), / t at ep 2 (etp 1); the experts' four / t either way)
against the recorded storages term by term, so removing any term fails; the grouped GEMMs' int32 offsets (4 E / ep
bytes a layer) are the one storage memplan leaves out, as without TP (tests/test_titan_moe.py).  Needs torchtitan."""

import dataclasses
import os
from collections import Counter

import pytest
import yaml

pytest.importorskip("torchtitan")

from memplan.api.estimating import estimate  # noqa: E402
from memplan.cli import main  # noqa: E402
from memplan.core.errors import MemplanError  # noqa: E402
from memplan.core.training import Recompute  # noqa: E402
from memplan.inventory.titan import titan_inventory  # noqa: E402
from memplan.inventory.titan_moe import moe_etp  # noqa: E402
from memplan.presets.catalog import load_model  # noqa: E402
from validation.titan_moe import MoeShape, measure_moe_tp  # noqa: E402

SHAPE = MoeShape()
T, S, B, LAYERS, V = 2, 16, 2, 2, 256  # global s b = 32 tokens, 16 on a rank's sequence shard
REC = {"none": Recompute.NONE, "selective-op": Recompute.SELECTIVE, "full": Recompute.FULL}
SLOW = pytest.mark.skipif(not os.environ.get("MEMPLAN_TITAN_SLOW"), reason="set MEMPLAN_TITAN_SLOW=1 to run")
OFFSETS = {1: 4 * SHAPE.E, 2: 4 * SHAPE.E // 2}  # the grouped GEMMs' int32 offsets (not modelled)

# measured per rank, bytes of each storage layer 0 keeps after its forward (the block's output and parameters apart)
# the attention half as dense TP (tests/test_titan_tp.py) with Qwen3's q / k norms on the rank's heads (the model
# called with the dataloader's positions, as torchtitan's Trainer calls it: CosSinRoPE's cos and sin gathered at them,
# 8d x all 32 tokens = 4096, whole on each TP rank)
_ATTN = [4096, 64, 4096, 4096, 1024, 4096, 256, 4096, 2048, 128, 2048, 4096, 2048, 1024, 2048, 256]
RECORDED = {
    # ep 1: ffn_norm's fp32 tensors sequence-sharded, its output all-gathered (4096: 32 tokens x 2h); the router and
    # the dispatcher over all 32 tokens (softmax 512, ids 512, scores 128, route_norm 64, argsort 512, sorted scores
    # 128, token idx 512, routed copies 8192), offsets 32, the experts' four k s b x fe / t (2048 each), combine's
    # fp32 output whole (16384)
    (1, "none"): _ATTN + [4096, 64, 4096, 4096, 512, 512, 128, 64, 512, 128, 512, 8192, 32, 2048, 2048, 2048, 2048,
                          16384],
    # wqkv / t 4096, attention out 2048 + lse 256, wo reduce-scattered 2048, topk over all tokens (fp32 256, int64
    # 512), the MoE's output reduce-scattered over the sequence (2048: s b / t x 2h)
    (1, "selective-op"): [4096, 2048, 256, 2048, 256, 512, 2048],
    (1, "full"): [],
    # ep 2: the MoE's input stays the rank's sequence shard (ffn_norm's bf16 output 2048), every MoE tensor over its
    # 16 tokens (R = k x 16 copies received: balanced), the permutation index 256 (R int64), offsets E / ep x 4
    (2, "none"): _ATTN + [4096, 64, 4096, 2048, 256, 256, 64, 32, 256, 64, 256, 256, 4096, 16, 2048, 2048, 2048, 2048,
                          8192],
    # topk over the rank's tokens (128, 256), the all-to-alls' outputs: counts 64 (E int64), received copies 4096,
    # combined copies 4096; no reduce-scatter of the MoE output (already sequence-sharded)
    (2, "selective-op"): [4096, 2048, 256, 2048, 128, 256, 64, 4096, 4096],
    (2, "full"): [],
}
INPUT_KEPT = {"none": False, "selective-op": True, "full": True}
INPUT_BYTES = 2048  # the block input: 16 tokens x 2h
# per rank after one AdamW step, ep 1 and 2 alike (dp_shard 1): TP shards wqkv, wo, the embedding and the LM head; the
# experts by their width (ep 1) or by their number (ep 2): 79,232 parameters x 4 B (hand count in test_states_by_hand)
STATES = {"params": 316928, "grads": 316928, "adam": 633856}


def _model(**kw):
    spec = load_model("qwen3-30b-a3b").model
    return spec.model_copy(update=dict(hidden_size=SHAPE.h, num_attention_heads=SHAPE.a, num_kv_heads=SHAPE.g,
                                       head_dim=SHAPE.d, num_experts=SHAPE.E, moe_top_k=SHAPE.k,
                                       moe_ffn_hidden_size=SHAPE.fe, seq_length=S, num_layers=LAYERS, vocab_size=V,
                                       name="tiny-qwen3-moe", **kw))


def _memplan(ep, ac, inv=None):
    """memplan's kept layer terms (bytes) on one of t = 2 ranks, the block input apart."""
    inv = inv or titan_inventory(_model(), "cpu")
    values = _model().symbols(b=B, t=T, cp=1, ep=ep, etp=moe_etp(ep, T))
    out = Counter()
    for t in inv.terms:
        if t.scope == "layer" and t.id != "input" and t.kept(REC[ac]):
            n = t.bytes(values, 2, 1)
            if n:
                out[n] += 1
    return out


@pytest.mark.parametrize("ep, ac", sorted(RECORDED))
def test_recorded_layer_equals_memplan_term_by_term(ep, ac):
    rec = Counter(RECORDED[ep, ac])
    if ac == "none":
        rec[OFFSETS[ep]] -= 1
    assert +rec == _memplan(ep, ac)


def test_a_removed_term_fails():
    inv = titan_inventory(_model(), "cpu")
    ids = [t.id for t in inv.terms if t.scope == "layer" and t.id.startswith(("moe.", "ffn_norm.out"))]
    for drop in ids:
        less = dataclasses.replace(inv, terms=tuple(t for t in inv.terms if t.id != drop))
        assert any(_memplan(ep, ac, less) != _memplan(ep, ac, inv) for ep, ac in RECORDED), drop


def test_etp_by_hand():
    # torchtitan's set_moe_sharding_config: at ep 1 the experts' hidden dim over tp (w1 / w3 Shard(1), w2 Shard(2));
    # at ep > 1 the experts over ep only (Shard(0)), the MoE reusing the tp ranks for its tokens
    assert [moe_etp(1, 4), moe_etp(2, 4), moe_etp(8, 1)] == [4, 1, 1]


def _yaml(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({"model": _model().model_dump(exclude={"inventory"})}))
    return str(path)


def test_states_by_hand(tmp_path):
    # a layer per rank: wqkv 128 x 64 / 2, wo 64 x 64 / 2, the experts 3 x 8 x 32 x 64 / 2, the router 8 x 64, two
    # norms 2 x 64, q / k norms 2 x 16: 31,392; the embedding and LM head 256 x 64 / 2 each, the final norm 64
    n = LAYERS * (4096 + 2048 + 24576 + 512 + 128 + 32) + 2 * 8192 + 64
    assert 4 * n == STATES["params"]
    for ep in (1, 2):
        st = estimate(_yaml(tmp_path), impl="torchtitan", gpus=2, tp=2, ep=ep, micro_batch=B, global_batch=B,
                      ac="full").estimate.peak.states
        assert st.gradients == STATES["grads"] and st.optimizer == STATES["params"] + STATES["adam"], ep


# 4 ranks, tp 2 x dp_shard 2 (ep 1: the experts fe / 2 wide, FSDP2 over dp_shard; ep 2 and 4: E / ep experts, FSDP2
# over efsdp = dp_shard tp / ep = 2 and 1), the same per-rank fp32 states at every ep: half the 2-rank run's
#   MEMPLAN_TITAN_SLOW=1 PYTHONPATH=. pytest tests/test_titan_moe_tp.py -k states_4_ranks_gloo   (~50 s an ep)
STATES_4 = {"params": 158464, "grads": 158464, "adam": 316928}
LOCAL_W1 = {1: (SHAPE.E, SHAPE.fe // 2, SHAPE.h), 2: (SHAPE.E // 2, SHAPE.fe, SHAPE.h), 4: (2, SHAPE.fe, SHAPE.h)}


@pytest.mark.parametrize("ep", sorted(LOCAL_W1))
def test_states_on_4_ranks_equal_recorded(ep, tmp_path):
    st = estimate(_yaml(tmp_path), impl="torchtitan", gpus=4, tp=2, ep=ep, micro_batch=B, global_batch=2 * B,
                  ac="full").estimate.peak.states
    assert st.gradients == STATES_4["grads"] and st.optimizer == STATES_4["params"] + STATES_4["adam"]


@pytest.mark.slow
@SLOW
@pytest.mark.parametrize("ep", sorted(LOCAL_W1))
def test_states_4_ranks_gloo(ep):
    # w1's local shard: FSDP2 splits dim 0 of the TP / EP shard (LOCAL_W1) over dp_shard 2 at ep 1 ((8, 16, 64) ->
    # (4, 16, 64)), over efsdp 2 at ep 2 ((4, 32, 64) -> (2, 32, 64)), not at ep 4 (efsdp 1: (2, 32, 64))
    for rank in measure_moe_tp(SHAPE, "full", tp=T, ep=ep, world=4, layers=LAYERS, vocab=V, s=S, b=B):
        assert {k: rank[k] for k in STATES_4} == STATES_4
        w1 = [v for k, v in rank["local_shapes"].items() if k.endswith("layers.0._checkpoint_wrapped_module.moe."
                                                                         "routed_experts.inner_experts.w1_EFD")]
        assert w1 == [(LOCAL_W1[ep][0] // (2 if ep < 4 else 1), *LOCAL_W1[ep][1:])]


# context parallelism: the MoE block (FlexAttention) under torchtitan's apply_cp_to_forward on rank 0 of a fake cp
# group of 2, 16 tokens of each of 2 sequences on the rank (validation/titan_moe.py measure_moe_cp; ~1 s once the
# FlexAttention path is imported, ~25 s with it):
#   MEMPLAN_TITAN_SLOW=1 PYTHONPATH=. pytest tests/test_titan_moe_tp.py -k cp_gloo_free
# none: the attention half as the dense CP row (the whole sequence's K and V all-gathered, 4096 each, in place of the
# rank's rotated k and contiguous v; the cos and sin gathered at the rank's own positions, 8d x 32 = 4096), then the
# MoE over the rank's 32 tokens as without CP (offsets 32 apart)
CP_S_LOCAL = 16
RECORDED_CP = {
    "none": [8192, 128, 8192, 4096, 8192, 512, 8192, 4096, 256, 4096, 4096, 4096, 4096, 4096, 4096, 512, 8192, 128,
             8192, 4096, 512, 512, 128, 64, 512, 128, 512, 8192, 32, 4096, 4096, 4096, 4096, 16384],
    "selective-op": [8192, 4096, 512, 256, 512],
}


@pytest.mark.parametrize("ac", sorted(RECORDED_CP))
def test_cp_recorded_equals_memplan(ac):
    inv = titan_inventory(_model(), "cpu")
    values = {**_model().symbols(b=B, t=1, cp=2, ep=1, etp=1), "s": 2 * CP_S_LOCAL}
    got = Counter()
    for t in inv.terms:
        if t.scope == "layer" and t.id != "input" and t.kept(REC[ac]):
            n = t.bytes(values, 2, 0)
            if n:
                got[n // t.storages] += t.storages
    rec = Counter(RECORDED_CP[ac])
    if ac == "none":
        rec[OFFSETS[1]] -= 1
    assert +rec == got


def test_cp_counts_do_not_shrink_by_hand():
    # the all-to-all's token counts (int64 E a layer, EP only) are per layer, not per token: cp leaves them whole
    inv = titan_inventory(_model(), "cpu")
    counts = next(t for t in inv.terms if t.id == "moe.ep_a2a_counts")
    assert [counts.bytes({**_model().symbols(b=B, t=1, cp=cp, ep=2, etp=1), "s": 64}, 2, 0) for cp in (1, 2, 4)] == [
        8 * SHAPE.E] * 3


@pytest.mark.slow
@SLOW
@pytest.mark.parametrize("ac", sorted(RECORDED_CP))
def test_cp_gloo_free_equals_recorded(ac):
    from validation.titan_moe import measure_moe_cp
    got = measure_moe_cp(SHAPE, 2, CP_S_LOCAL, B, ac)
    assert [n for _, _, n in got["rows"]] == RECORDED_CP[ac] and got["input_kept"] == (ac != "none")


@pytest.mark.parametrize("argv", [["--etp", "2", "--ep", "2"], ["--etp", "1"],
                                  ["--model", "deepseek-v3", "--pp", "2", "--pipeline-schedule", "InterleavedZeroBubble"],
                                  ["--compile"]])
def test_refused_in_one_line(argv, capsys):
    base = ["estimate", "--model", "qwen3-30b-a3b", "--impl", "torchtitan", "--gpus", "8", "--tp", "2"]
    with pytest.raises(SystemExit) as exit_:
        main(base + argv)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and "\n" not in err and "Traceback" not in err


def test_qwen3_30b_ep_under_tp_by_hand():
    # qwen3-30b-a3b (h 2048, E 128, k 8) at tp 2, s b = 4096 global tokens, on CUDA (the router in fp32): the MoE's
    # token-sized tensors cover the whole sequence at ep 1 and the rank's half at ep 2, per token: scores 4E = 512,
    # ids 8k = 64, top-k scores 4k = 32, route_norm 4, argsort 64, sorted scores 32, token idx 64, routed copies 2kh
    # = 32768, combine's fp32 4kh = 65536, the gate's fp32 input 4h = 8192, ffn_norm's output 2h = 4096: 111,364 B,
    # half of it over 4096 tokens, less ep 2's permutation index (8k / t = 32 B a token)
    base = dict(impl="torchtitan", gpus=8, tp=2, global_batch=8, micro_batch=1, seq_len=4096, gpu="h100-80gb")

    def layer(ac, ep):
        return estimate("qwen3-30b-a3b", ac=ac, ep=ep, **base).estimate.per_layer_bytes

    assert layer("none", 1) - layer("none", 2) == 111364 * 2048 - 32 * 4096
    # selective-op: topk (4k + 8k = 96 B) whole at ep 1, half at ep 2; ep 1 keeps the MoE output reduce-scattered
    # (2h / t = 2048 B), ep 2 the all-to-alls' outputs (2 x 2kh / t = 32768 B) and counts (8E B a layer)
    assert layer("selective-op", 1) - layer("selective-op", 2) == 96 * 2048 + 2048 * 4096 - 32768 * 4096 - 8 * 128


def test_search_pins_tp_and_agrees_with_estimate():
    # search --tp 2 on a Qwen3 MoE: ep over the divisors of E dividing dp_shard x tp = 8, each plan's experts laid
    # out as torchtitan lays them (etp = tp at ep 1, 1 at ep > 1); a listed plan is what estimate gives
    from memplan import search

    base = dict(impl="torchtitan", gpus=8, tp=2, global_batch=16, gpu="h100-80gb", seq_len=2048)
    found = search("qwen3-30b-a3b", all_variants=True, **base).result
    plans = found.evaluated.plans
    assert set(plans.t.tolist()) == {2} and set(plans.ep.tolist()) == {1, 2, 4, 8}
    assert (plans.expert_tp == [2 if e == 1 else 1 for e in plans.ep.tolist()]).all()
    row = found.row(found.top[0])
    dims = row["torchtitan"]
    assert dims["tp"] == 2
    piped = dict(pp=dims["pp"], pipeline_schedule=dims["pipeline_schedule"]) if dims["pp"] > 1 else {}
    est = estimate("qwen3-30b-a3b", **base, ep=dims["ep"], ac=dims["ac"], dp_replicate=dims["dp_replicate"],
                   micro_batch=dims["pipeline_microbatch_size"] or dims["local_batch"], **piped)
    assert row["memory"]["device_bytes"] == est.device_bytes
    with pytest.raises(MemplanError):  # torchtitan has no expert TP at ep > 1
        search("qwen3-30b-a3b", ep=2, etp=2, **base)


@pytest.mark.slow
@SLOW
@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("ac", sorted(REC))
def test_gloo_equals_recorded(ep, ac):
    for rank in measure_moe_tp(SHAPE, ac, tp=T, ep=ep, layers=LAYERS, vocab=V, s=S, b=B):
        assert [n for _, _, n in rank["layer"]] == RECORDED[ep, ac]
        assert rank["input_kept"] == INPUT_KEPT[ac] and rank["input_bytes"] == INPUT_BYTES
        assert {k: rank[k] for k in STATES} == STATES


def test_no_routed_token_gather_timed_for_torchtitan():
    # Megatron-LM's etp > 1 all-gathers the routed copies over etp (4 k s h / t (etp - 1) bytes a sequence a layer);
    # torchtitan at ep 1, etp = tp, gathers the MoE's input once over tp, timed as the dense layer's TP collectives:
    # its cp / ep communication is 0 at cp 1, ep 1 (memplan/timing/comm.py)
    from memplan.presets.catalog import load_gpu
    from memplan.timing.arrays import PlanFloats
    from memplan.timing.comm import cp_ep_comm_s

    model = load_model("qwen3-30b-a3b").model
    pf = PlanFloats(t=2.0, inv_t=0.5, sp=1.0, p=1.0, m=1.0, d=4.0, b=1.0, M=1.0, selective=0.0, full=0.0, first=1.0,
                    sharded=1.0, k=4.0, zero3=1.0, cp=1.0, ep=1.0, etp=2.0)
    gpu = load_gpu("h100-80gb")
    assert cp_ep_comm_s(model, gpu, pf, 2, 48.0, 0.0, "allgather") == 0.0
    assert cp_ep_comm_s(model, gpu, pf, 2, 48.0, 0.0, "p2p") > 0.0  # Megatron-LM's allgather of the routed copies
