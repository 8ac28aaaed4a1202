"""torchtitan's context parallelism (`--impl torchtitan --cp C`, memplan/inventory/titan.py) against torchtitan's own
apply_cp_to_forward on its Llama 3 block, run on one rank of a fake cp group on CPU (validation/titan_cp.py: the CPU
sdpa kernel in place of FlexAttention's, which has no CPU backward), and by hand through the API: every per-token
term over cp, the whole sequence's K and V kept in place of the rank's own, FSDP2's states over dp_shard x cp."""

from collections import Counter

import pytest

from memplan.api.estimating import estimate
from memplan.core.errors import MemplanError
from memplan.inventory import titan

H, A, G, F, D = 4096, 32, 8, 14336, 128  # llama3-8b
PARAMS = 8_030_261_248  # llama3-8b's parameters (tests/test_titan_cli.py test_fsdp2_states_by_hand counts them)


def _rows(inv, cp, s_local, b, mode):
    """memplan's layer terms kept under ``mode`` on one cp rank, one entry per storage (the block input apart)."""
    rows = Counter()
    for t in inv.terms:
        if t.scope != "layer" or not t.kept(mode) or t.id == "input":
            continue
        n = t.bytes({"s": cp * s_local, "b": b, "t": 1, "cp": cp}, 2, 0)
        if n:
            rows[n // t.storages] += t.storages
    return rows


# ~0.7 s each once torchtitan is imported (its import ~5 s, shared with tests/test_titan*.py in a worker)
@pytest.mark.parametrize("ac,cp,s_local,b", [("none", 4, 8, 3), ("selective-op", 2, 16, 2)])
def test_measured_cp_layer_equals_memplan(ac, cp, s_local, b):
    pytest.importorskip("torchtitan")
    from test_titan_float8 import MODES, TINY  # h 64, a 4, g 2, f 160: head dim 16

    from validation.titan_cp import measure_cp_block
    measured = measure_cp_block(TINY_SHAPE(), cp, s_local, b, ac)
    memplan = _rows(titan.titan_inventory(TINY, "cpu"), cp, s_local, b, MODES[ac])
    assert Counter(n for _, _, n in measured["rows"]) == memplan
    if ac == "none":
        # by hand: 3032 B per local token (tests/test_titan.py test_layer_bytes_by_hand; the RoPE rows gathered at
        # the rank's own positions, CP-sharded with the tokens, among them) less the rank's k and v (2 g d = 64 B
        # each) plus the whole sequence's K and V (64 B each per token of cp s_local): the two all-gathered storages
        # measured are 64 cp s_local b each
        gathered = sorted(n for op, _, n in measured["rows"] if op == "flex_cp_allgather")
        assert gathered == [64 * cp * s_local * b] * 2
        assert measured["total"] == (3032 - 128) * s_local * b + 128 * cp * s_local * b


def TINY_SHAPE():
    from validation.titan import Shape
    return Shape(h=64, a=4, g=2, f=160)


def _est(cp, ac="none", **kw):
    return estimate("llama3-8b", impl="torchtitan", gpus=8, cp=cp, ac=ac, micro_batch=1,
                    **{"seq_len": 8192, "global_batch": 8, "device": "cuda", **kw}).estimate


def test_cp_layer_and_states_by_hand():
    # CUDA, AC none: 168584 B per token (tests/test_titan_cli.py PER_TOKEN), of which the rank's rotated k and
    # contiguous v are 2 x 2 g d = 4096; under cp 2 a rank holds 4096 of the 8192 tokens and keeps the whole
    # sequence's K and V (4096 B per token of all 8192)
    one, two = _est(1), _est(2)
    assert one.per_layer_bytes == 168584 * 8192
    assert two.per_layer_bytes == (168584 - 4096) * 4096 + 4096 * 8192
    # full AC keeps only the block input, 2h = 8192 B per local token
    assert _est(2, "full").per_layer_bytes == 8192 * 4096
    # FSDP2 over dp_shard x cp = 4 x 2: the fp32 parameters and AdamW moments 12 B / 8 per parameter, as at cp 1
    assert two.config.parallel.dp == 4
    assert two.peak.states.optimizer == one.peak.states.optimizer == -(-12 * PARAMS // 8)


def test_cp_refusals():
    with pytest.raises(MemplanError, match="cp-comm-type"):
        _est(2, cp_comm_type="a2a")
    with pytest.raises(MemplanError):  # the head-tail layout: 2 cp chunks of the sequence
        _est(2, seq_len=8190)


def test_search_tries_cp_and_each_plan_estimates_the_same():
    # s = 16384 (memplan/plan/space.py CP_MIN_SEQ): cp 1, 2, 4, 8 searched beside tp and HSDP; every plan launches
    # on the 8 GPUs (dp_replicate x dp_shard x tp x cp), compile only with cp 1, and estimate with a row's flags gives
    # the row's peak and step time
    from memplan import search
    from memplan.plan.titan import titan_dims

    base = dict(impl="torchtitan", gpus=8, global_batch=8, seq_len=16384, gpu="h100-80gb", pp=1)  # pp: test_titan_pp_search
    found = search("llama3-8b", all_variants=True, top=2, mem=80 * 10**9, **base).result
    dims = [titan_dims(found.config(i)) for i in range(found.candidates)]
    assert {d["cp"] for d in dims} == {1, 2, 4, 8}
    for d in dims:
        assert d["dp_replicate"] * d["dp_shard"] * d["tp"] * d["cp"] == 8 and (not d["compile"] or d["cp"] == 1)
    e = found.evaluated
    for i in [i for i, d in enumerate(dims) if d["cp"] > 1][::23]:
        d = dims[i]
        est = estimate("llama3-8b", **base, tp=d["tp"], cp=d["cp"], dp_replicate=d["dp_replicate"], ac=d["ac"],
                       micro_batch=d["local_batch"]).estimate
        assert est.step.peak_bytes == e.peak_bytes[i], d
        assert est.perf.step_time_s == pytest.approx(e.step_time_s[i], rel=1e-6)


def test_cp_all_gather_is_timed_not_overlapped():
    # torchtitan's K/V all-gather (forward) and the reduce-scatter of their gradients (backward), each waited for at
    # once (cplib::flex_cp_allgather): per layer each moves (cp - 1)/cp of the sequence's K and V, 2 g d s = 2 x 8 x
    # 128 x 8192 bf16 = 33,554,432 B, half of it at cp 2: 16,777,216 B x 2 directions x 32 layers = 2^30 B per
    # sequence, 2 sequences per GPU (global batch 8 over d = 4), over NVLink (a cp group of 2 in one node)
    from memplan.presets.catalog import load_gpu
    from memplan.timing.comm import link_per_byte

    one, two = _est(1).perf, _est(2).perf
    assert one.cp_ep_comm_exposed_s == 0
    assert two.cp_ep_comm_exposed_s == pytest.approx(2 * 2**30 * link_per_byte(load_gpu("h100-80gb"), 2), rel=1e-9)


@pytest.mark.parametrize("impl,cp,per_layer", [("torchtitan", 2, 707_297_280), ("torchtitan", 1, 1_381_040_128),
                                               ("megatron", 2, None)])
def test_explain_with_cp(impl, cp, per_layer, capsys):
    # explain binds cp (it ended in KeyError 'cp' with --cp before, Megatron-LM's included); torchtitan by hand:
    # (168584 - 4096) x 4096 + 4096 x 8192 at cp 2 (test_cp_layer_and_states_by_hand), 168584 x 8192 at cp 1
    from memplan.cli import main

    args = ["--model", "llama3-8b", "--impl", impl, "--gpus", "8", "--cp", str(cp), "--seq-len", "8192",
            "--global-batch", "8"]
    with pytest.raises(SystemExit) as exit_:
        main(["explain"] + args)
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("per layer, with what real code keeps"))
    expected = per_layer or estimate("llama3-8b", impl=impl, gpus=8, cp=cp, seq_len=8192,
                                     global_batch=8).estimate.per_layer_bytes
    assert f"= {expected:,} B" in line
    assert ("whole sequence" in out) == (impl == "torchtitan" and cp > 1)
