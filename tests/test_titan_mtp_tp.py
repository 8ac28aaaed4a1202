"""torchtitan 0.3.0's DeepSeek-V3 MTP layer with tensor and expert parallelism (`--impl torchtitan --mtp N --tp T
--ep E`) against torchtitan's own parallelize_deepseekv3 run over gloo, `search --mtp` against `estimate --mtp`, and
the MTP layers' FLOPs in the step time counted by hand.

validation/titan_mtp.py ``mtp_rank`` runs the 2-layer DeepSeek-V3 of tests/test_titan_dsv3_tp.py (h 64, 4 heads, r_q 32,
r_kv 48, d_n 16, d_r 8, d_v 12; 16 experts of 32, one shared, top-2; vocab 256; s 16, b 2) with 0 and 1 MTP layer on
2 ranks (tp 2 at ep 1 and 2, and tp 1 at ep 2: FSDP2 over the 2 ranks), one step with MTPLoss and AdamW. RECORDED holds
the bytes of each storage autograd keeps for the MTP layer per rank (the run with the MTP layer less the run without;
both ranks alike), and STATES the fp32 parameters per rank, from

    MEMPLAN_TITAN_SLOW=1 PYTHONPATH=. pytest tests/test_titan_mtp_tp.py -k gloo      (~20 s a layout)
    PYTHONPATH=. python -m validation.titan_mtp TP EP [none|full|selective-op]

The decoder layers under full or selective-op AC (tp 2, ep 1) leave the MTP layer's storages as under none.

Needs torchtitan."""

import os
from collections import Counter

import pytest
import yaml

from memplan.api.estimating import estimate
from memplan.api.searching import search
from memplan.core.errors import MemplanError
from memplan.inventory.titan import titan_model
from memplan.inventory.titan_dsv3 import dsv3_inventory
from memplan.inventory.titan_moe import moe_etp
from memplan.presets.catalog import load_gpu, load_model
from memplan.timing.flops import mtp_flops
from tests.test_titan_dsv3 import SHAPE, _model

SLOW = pytest.mark.skipif(not os.environ.get("MEMPLAN_TITAN_SLOW"), reason="set MEMPLAN_TITAN_SLOW=1 to run")
S, B, V = 16, 2, 256

# measured per rank (tp, ep): what the MTP layer keeps.  tp 2 (sequence parallel, 16 of the 32 tokens a rank): enorm /
# hnorm / mtp_norm's fp32 x, x * rstd (4096 each) and rstd (64) on the rank's sequence shard, eh_proj's input cat
# (4096 bf16) and the valid mask (32 bf16) too; mtp_norm's output all-gathered (4096); the block as a decoder layer's
# (tests/test_titan_dsv3_tp.py); the shifted ids clamped to the rank's vocab shard (int64 256) and the embedding's vocab
# mask (bf16 64: torchtitan's vocab-parallel Embedding keeps it), the shifted labels (256), the depth's log-softmax on
# the rank's vocab shard (16384).  tp 1 ep 2: every tensor over the 32 tokens, nll_loss's total_weight (4)
RECORDED = {
    (2, 1): [32, 64, 64, 64, 64, 64, 64, 64, 64, 128, 128, 128, 128, 256, 256, 256, 512, 512, 512, 1024, 1024, 1024,
             1024, 1024, 1024, 1536, 1536, 2048, 2048, 2048, 2048, 2048, 3072, 3072, 3072, 3584, 4096, 4096, 4096,
             4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 6144, 6144, 8192, 16384,
             16384],
    (2, 2): [32, 32, 32, 64, 64, 64, 64, 64, 64, 64, 64, 128, 128, 256, 256, 256, 256, 256, 256, 256, 512, 1024, 1024,
             1024, 1024, 1024, 1536, 1536, 2048, 2048, 2048, 2048, 2048, 2048, 3072, 3072, 3072, 3584, 4096, 4096,
             4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 6144, 6144,
             8192, 16384],
    (1, 2): [4, 32, 64, 64, 128, 128, 128, 128, 128, 128, 128, 128, 128, 256, 256, 512, 512, 512, 512, 512, 1024, 1024,
             2048, 2048, 2048, 2048, 2048, 3072, 3072, 3072, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096,
             6144, 6144, 6144, 6144, 7168, 8192, 8192, 8192, 8192, 8192, 8192, 8192, 8192, 8192, 8192, 8192, 8192,
             16384, 32768],
}
# fp32 parameters per rank after the step, without and with the MTP layer (gradients the same, AdamW's two moments
# twice that). By hand: the MTP layer is the MoE layer (24,528 + 98,304 routed experts) + enorm, hnorm, mtp_norm
# (3 x 64)
# + eh_proj (64 x 128, replicated over tp: _set_deepseek_v3_mtp_sharding). tp 2 (dp 1): the MoE layer's per-rank 64,848
# (tests/test_titan_dsv3_tp.py: 11,600 + 53,248) + 192 + 8,192 = 73,232 more; tp 1 ep 2 (FSDP2 over 2 ranks, the experts
# over ep): (24,528 + 192 + 8,192) / 2 + 98,304 / 2 = 65,608 more
STATES = {(2, 1): (408448, 701376), (2, 2): (408448, 701376), (1, 2): (382912, 645344)}


def test_states_by_hand():
    for (tp, _), (without, with_) in STATES.items():
        assert with_ - without == 4 * (73232 if tp == 2 else 65608)


def _unmodelled(tp, ep):
    """The storages memplan leaves out everywhere: the grouped GEMMs' int32 offsets (4 E / ep) and, without loss
    parallel, nll_loss's total_weight (4)."""
    return Counter([4 * SHAPE.E // ep] + ([4] if tp == 1 else []))


def _memplan(tp, ep, terms=None):
    model = titan_model(_model(), 1)
    values = {**model.symbols(b=B, t=tp, cp=1, ep=ep, etp=moe_etp(ep, tp)), "s": S}
    out = Counter()
    for t in terms if terms is not None else dsv3_inventory(model, "cpu").terms:
        n = t.bytes(values, 2, int(tp > 1)) if t.id.startswith("mtp.") else 0
        if n:
            out[int(n) // t.storages] += t.storages
    return out


@pytest.mark.parametrize("tp, ep", sorted(RECORDED))
def test_recorded_mtp_layer_equals_memplan_term_by_term(tp, ep):
    assert Counter(RECORDED[tp, ep]) - _unmodelled(tp, ep) == _memplan(tp, ep)
    assert not _unmodelled(tp, ep) - Counter(RECORDED[tp, ep])


def test_a_removed_mtp_term_fails():
    terms = dsv3_inventory(titan_model(_model(), 1), "cpu").terms
    for drop in {t.id for t in terms if t.id.startswith("mtp.")}:
        less = [t for t in terms if t.id != drop]
        assert any(_memplan(tp, ep, less) != _memplan(tp, ep, terms) for tp, ep in RECORDED), drop


def _yaml(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({"model": _model().model_dump(exclude={"inventory"})}))
    return str(path)


@pytest.mark.parametrize("tp, ep", sorted(STATES))
def test_states_per_rank_equal_memplan(tp, ep, tmp_path):
    for mtp, params in zip((0, 1), STATES[tp, ep]):
        st = estimate(_yaml(tmp_path), impl="torchtitan", gpus=2, tp=tp, ep=ep, mtp=mtp, micro_batch=B,
                      global_batch=B * 2 // tp, seq_len=S, ac="none").estimate.peak.states
        assert st.gradients == params and st.optimizer == 3 * params, (tp, ep, mtp)


@pytest.mark.slow
@SLOW
@pytest.mark.parametrize("tp, ep, ac", [(*k, "none") for k in sorted(RECORDED)]
                         + [(2, 1, "full"), (2, 1, "selective-op")])
def test_gloo_equals_recorded(tp, ep, ac):
    # the decoder layers under full or selective-op AC: the MTP layer keeps the same (torchtitan's AC wraps
    # model.layers only), measured at tp 2 too
    from validation.titan_mtp import measure_mtp
    for rank in measure_mtp(SHAPE, tp, ep, vocab=V, s=S, b=B, ac=ac):
        assert sorted(n for _, n, _ in rank["saved"]) == RECORDED[tp, ep] and not rank["missing"]
        assert (rank["params_without"], rank["params"]) == STATES[tp, ep]
        assert rank["grads"] == rank["params"] and rank["adam"] == 2 * rank["params"]


# search --mtp: torchtitan's plans without PP or CP, each the plan estimate --mtp gives with the same flags
BASE = dict(impl="torchtitan", gpus=64, global_batch=64, seq_len=4096, gpu="h100-80gb", mtp=1)


def test_search_plans_mtp_as_estimate_does():
    out = search("deepseek-v3", all_variants=True, top=3, mem=250 * 10**9, emit="torchtitan", **BASE)  # some fit
    found = out.result
    assert "num_mtp_layers=1" in "\n".join(out.launch["deepseek-v3"].args)  # the best plan emitted with its MTP layer
    assert found.model.mtp_layers == 1 and found.candidates > 20
    e = found.evaluated
    rows = [found.row(i)["torchtitan"] for i in range(found.candidates)]
    assert {(r["pp"], r["cp"]) for r in rows} == {(1, 1)} and {r["ep"] for r in rows} > {1}
    assert {r["tp"] for r in rows} > {1}
    for i in range(0, found.candidates, max(1, found.candidates // 6)):  # ~6 plans (each estimate replays ~0.4 M events)
        r = rows[i]
        flags = dict(tp=r["tp"], ep=r["ep"], dp_replicate=r["dp_replicate"], ac=r["ac"], micro_batch=r["local_batch"],
                     compile=r["compile"])  # compile searched for DeepSeek-V3 at tp = ep = cp = 1 since i24dc
        est = estimate("deepseek-v3", **BASE, **flags).estimate
        assert est.step.peak_bytes == e.peak_bytes[i], r
        assert est.perf.step_time_s == pytest.approx(e.step_time_s[i], rel=1e-6)
        one = estimate("deepseek-v3", **{**BASE, "mtp": None}, **flags).estimate
        assert est.step.peak_bytes > one.step.peak_bytes and est.perf.step_time_s > one.perf.step_time_s


@pytest.mark.parametrize("kw, match", [(dict(pp=2), "pipeline"), (dict(cp=2), "context"),
                                       (dict(pipeline_schedule="GPipe"), "pipeline"),
                                       (dict(impl="megatron"), "--mtp N is torchtitan's")])
def test_search_refuses_in_one_line(kw, match):
    with pytest.raises(MemplanError, match=match):
        search("deepseek-v3", mem="80GB", **{**BASE, **kw})


def test_mtp_flops_by_hand():
    # DeepSeek-V3 671B, s = 4096, one MTP layer, forward per sequence: its block is an MoE layer: MLA projections
    # (h r_q + a (d_n + d_r) r_q + h (r_kv + d_r) + a (d_n + d_v) r_kv) + wo a d_v h, the 8 routed and the shared
    # expert's SwiGLU 3 h (8 f_e + f_s), the router h E: 2 s x each; eh_proj 2 s (2h) h; the shared head 2 s h v;
    # the attention core 2 s^2 a (d_n + d_r + d_v)
    s, h, a, rq, rkv, dn, dr, dv, fe, E, v = 4096, 7168, 128, 1536, 512, 128, 64, 128, 2048, 256, 129280
    weights = h * rq + a * (dn + dr) * rq + h * (rkv + dr) + a * (dn + dv) * rkv + a * dv * h + 3 * h * 9 * fe + h * E
    matmuls = 2 * s * weights + 2 * s * 2 * h * h + 2 * s * h * v
    attention = 2 * s * s * a * (dn + dr + dv)
    model = titan_model(load_model("deepseek-v3").model, 1).model_copy(update={"seq_length": s})
    assert mtp_flops(model) == pytest.approx((matmuls, attention), rel=1e-12)
    assert mtp_flops(model, causal=True)[1] == attention / 2
    # in the step time: model FLOPs 3 x forward more per sequence (the attention halved as MFU counts it), and the
    # compute of the last stage 3 x forward over the peak at the GEMM efficiency (a flash kernel: the causal half; tp 1,
    # one sequence a rank)
    kw = dict(impl="torchtitan", gpus=64, ep=8, seq_len=s, micro_batch=1, global_batch=64, ac="full",
              gpu="h100-80gb")
    with_, without = (estimate("deepseek-v3", mtp=n, **kw).estimate.perf for n in (1, None))
    assert with_.model_flops - without.model_flops == pytest.approx(64 * 3 * (matmuls + attention / 2), rel=1e-9)
    gpu = load_gpu("h100-80gb")
    per_sequence = 3 * (matmuls + attention / 2) / (gpu.peak_bf16_flops * gpu.matmul_efficiency)
    assert with_.compute_s - without.compute_s == pytest.approx(per_sequence, rel=1e-5)  # float32 times
