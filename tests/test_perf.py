"""Step-time model (memplan/perf.py) against K22 and hand derivations.

Expected values come from the paper (K22 = Korthikanti et al. 2022, arXiv 2205.05198) or are
derived by hand in the comments; none is copied from the code's output.
"""

from __future__ import annotations

from dataclasses import fields
from fractions import Fraction

import numpy as np
import pytest

from memplan import perf
from memplan.memory import PlanValues
from memplan.presets import load_gpu, load_model
from memplan.specs import ModelSpec, TrainingSpec

A100 = load_gpu("a100-80gb")
GPT22B = load_model("gpt-22b").model
TRAINING = TrainingSpec()


def plan(**over) -> PlanValues:
    """K22 Table 4's setting by default: the 22B layer, t = 8, b = 4, one GPU node."""
    values = dict(t=8, p=1, d=1, m=1, sp=0, zero=0, b=4, recompute=0, recomputed_layers=48, microbatches=1)
    values.update(over)
    values.setdefault("shard", values["d"])
    return PlanValues(**values)


def k22_eq7(B: int, L: int, s: int, h: int, v: int) -> Fraction:
    """K22 appendix A, Eq. 7: 72 B L s h^2 (1 + s/(6h) + v/(12hL))."""
    return 72 * B * L * s * h * h * (1 + Fraction(s, 6 * h) + Fraction(v, 12 * h * L))


# --- FLOPs -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,batch", [("gpt3-175b", 1536), ("gpt3-530b", 1920), ("gpt-22b", 4)])
def test_model_flops_equal_k22_eq7(name, batch):
    m = load_model(name).model
    assert m.f == 4 * m.hidden_size and m.g == m.num_attention_heads  # a K22 GPT
    expected = k22_eq7(batch, m.num_layers, m.seq_length, m.hidden_size, m.vocab_size)
    # 175B, B = 1536: 72*1536*96*2048*12288^2 * (1 + 2048/73728 + 51200/14155776) ~ 3.38e18
    assert perf.model_flops(m, batch) == pytest.approx(float(expected), rel=1e-12)


def test_model_flops_general_shapes_by_hand():
    # GQA (g = 2 of a = 4 heads) and a SwiGLU MLP of width f = 128; h = 64, s = 16, v = 100, L = 2.
    # Per layer and sequence, forward: QKV 2*16*64*(64 + 2*64*2/4) = 262,144; projection
    # 2*16*64^2 = 131,072; MLP 3*2*16*64*128 = 786,432; attention 4*16^2*64 = 65,536
    # -> 1,245,184; two layers 2,490,368; logits 2*16*64*100 = 204,800; forward 2,695,168;
    # with the backward (2x): 8,085,504 per sequence; B = 3 -> 24,256,512.
    m = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=128,
                  seq_length=16, vocab_size=100, mlp="swiglu")
    assert perf.model_flops(m, 3) == 24_256_512


def test_hardware_flops_add_the_recomputed_forward():
    B, L, s, h, v = 4, 48, 2048, 6144, 51200
    eq7 = float(k22_eq7(B, L, s, h, v))
    # Selective: QK^T and attention over V re-run, 4Bs^2h per layer (K22 section 5).
    selective = perf.hardware_flops(GPT22B, plan(recompute=1), B)
    assert selective == pytest.approx(eq7 + 4 * B * s * s * h * L, rel=1e-12)
    # Full: each layer's forward again, 24Bsh^2 + 4Bs^2h (K22 appendix A).
    full = perf.hardware_flops(GPT22B, plan(recompute=2), B)
    assert full == pytest.approx(eq7 + B * L * (24 * s * h * h + 4 * s * s * h), rel=1e-12)
    assert perf.hardware_flops(GPT22B, plan(recompute=0), B) == pytest.approx(eq7, rel=1e-12)
    # Full recompute of 2 layers per chunk, p = 4 chunks of 12: 8 layers re-run.
    partial = perf.hardware_flops(GPT22B, plan(recompute=2, p=4, recomputed_layers=2), B)
    assert partial == pytest.approx(eq7 + B * 8 * (24 * s * h * h + 4 * s * s * h), rel=1e-12)


def test_selective_flop_overhead_for_gpt3():
    # 4Bs^2h per layer over Eq. 7: (s/(18h)) / (1 + s/(6h) + v/(12hL)) for GPT-3 175B
    # = 0.0092593 / 1.0313947 = 0.898%. (K22 section 5 quotes 2.7%, which is its Eq. 8 as printed,
    # 1 + s/(3h): that counts 12Bs^2h per layer, three times the re-run forward attention.)
    m = load_model("gpt3-175b").model
    ratio = perf.hardware_flops(m, plan(t=8, p=8, recompute=1, recomputed_layers=12), 1) / perf.model_flops(m, 1)
    assert ratio - 1 == pytest.approx(0.00898, abs=2e-5)


# --- K22 Table 4 ------------------------------------------------------------------------------
# K22 Table 4 (ms): baseline 7.7/11.9, SP 7.2/11.8, full 7.7/19.5, selective 7.7/13.2,
# selective + SP 7.2/13.1. Tolerance on each forward and backward: 2%.
TABLE4 = {
    "baseline": (dict(sp=0, recompute=0), 7.7, 11.9),
    "sequence parallel": (dict(sp=1, recompute=0), 7.2, 11.8),
    "full recompute": (dict(sp=0, recompute=2), 7.7, 19.5),
    "selective recompute": (dict(sp=0, recompute=1), 7.7, 13.2),
    "selective + sequence parallel": (dict(sp=1, recompute=1), 7.2, 13.1),
}


def table4_ms(row: str) -> tuple[float, float]:
    lt = perf.layer_time(GPT22B, A100, plan(**TABLE4[row][0]))
    return lt.forward_s * 1e3, lt.backward_with_recompute_s * 1e3


@pytest.mark.parametrize("row", list(TABLE4))
def test_table4_forward_and_backward_within_2_percent(row):
    forward, backward = table4_ms(row)
    _, paper_forward, paper_backward = TABLE4[row]
    assert forward == pytest.approx(paper_forward, rel=0.02)
    assert backward == pytest.approx(paper_backward, rel=0.02)


def overhead(row: str) -> float:
    return sum(table4_ms(row)) / sum(table4_ms("baseline")) - 1


def test_table4_overheads():
    # Paper overhead column: 27.2/19.6 = +38.8% (printed 39%), 20.9/19.6 = +6.6% (7%),
    # 20.3/19.6 = +3.6% (4%), 19.0/19.6 = -3.1% (-3%).
    # Full recompute: 33%..39.5%. A model that reproduces the baseline's 7.7 ms forward and
    # 11.9 ms backward and re-runs the forward predicts 7.7/19.6 = 39.3%, inside the printed 39%
    # (38.5-39.5%); Table 4's own recompute (19.5 - 11.9 = 7.6 ms) is 0.1 ms (its print
    # rounding) below its forward.
    assert 0.33 <= overhead("full recompute") < 0.395
    assert 0.04 <= overhead("selective recompute") <= 0.07
    assert 0.02 <= overhead("selective + sequence parallel") <= 0.06
    assert -0.05 < overhead("sequence parallel") < 0  # SP is faster (paper -3%)


def test_sequence_parallel_splits_the_replicated_memory_bound_work():
    base = perf.layer_time(GPT22B, A100, plan(sp=0))
    sp = perf.layer_time(GPT22B, A100, plan(sp=1))
    by = perf.layer_traffic_bytes(GPT22B)
    # 22 bytes per element forward (2*2*2 norms + 2*3*2 residual adds + 2 masks) per sequence
    # (sh = 2048*6144), for b = 4 sequences, shrinking by 1 - 1/8 with SP.
    assert by.replicated_fwd == 22 * 2048 * 6144
    saved = 4 * 22 * 2048 * 6144 * (1 - 1 / 8) / (A100.memory_bandwidth * A100.memory_bound_efficiency)
    assert base.forward_memory_s - sp.forward_memory_s == pytest.approx(saved, rel=1e-5)  # float32 times
    assert sp.forward_comm_s == pytest.approx(base.forward_comm_s)  # same collective volume
    assert sp.backward_comm_exposed_s > base.backward_comm_exposed_s  # g-bar's all-gathers


def test_k22_layer_traffic_bytes_by_hand():
    # Per sequence (b = 1), 22B layer: sh = 2048*6144 = 12,582,912; as^2 = 64*2048^2 = 268,435,456;
    # sf = 2048*24576 = 50,331,648. Forward TP-split bytes: softmax 4 + dropout 5 per score,
    # GeLU 4 per MLP element; backward: 6 + 5 and 6.
    by = perf.layer_traffic_bytes(GPT22B)
    assert by.tp_fwd == 9 * 268_435_456 + 4 * 50_331_648
    assert by.tp_bwd == 11 * 268_435_456 + 6 * 50_331_648
    assert by.replicated_bwd == 34 * 12_582_912
    assert by.attention_core_fwd == 9 * 268_435_456


# --- sanity -------------------------------------------------------------------------------------
def step(model=GPT22B, gb=None, **over):
    pv = plan(**over)
    if gb is None:
        gb = pv.b * pv.d * pv.microbatches
    return perf.step_time(model, TRAINING, A100, pv, gb)


def test_recompute_order():
    for over in (dict(), dict(sp=1), dict(p=4, microbatches=8, recomputed_layers=12), dict(d=4, zero=1)):
        none, selective, full = (step(**over, recompute=r).step_time_s for r in (0, 1, 2))
        assert full > selective > none


def test_partial_full_recompute_is_in_between():
    chunk = dict(p=4, microbatches=8)
    times = [step(**chunk, recompute=2, recomputed_layers=k).step_time_s for k in (0, 4, 8, 12)]
    assert times == sorted(times) and times[0] == pytest.approx(step(**chunk).step_time_s)


def test_bubble_shrinks_with_interleaving_and_microbatches():
    # (p - 1)/(m M): p = 4, m = 1, M = 8 -> 3/8; m = 2 -> 3/16; M = 32 -> 3/32.
    assert step(p=4, microbatches=8).bubble_fraction == pytest.approx(3 / 8)
    assert step(p=4, m=2, microbatches=8, recomputed_layers=6).bubble_fraction == pytest.approx(3 / 16)
    assert step(p=4, microbatches=32).bubble_fraction == pytest.approx(3 / 32)
    assert step(p=1, microbatches=8).bubble_fraction == 0
    per_sequence = [step(p=4, microbatches=M).step_time_s / M for M in (4, 8, 16, 64)]
    assert per_sequence == sorted(per_sequence, reverse=True)


def test_parts_add_up_and_mfu_is_a_fraction():
    for over in (dict(), dict(sp=1, recompute=1), dict(p=4, m=3, microbatches=12, recomputed_layers=4, d=8, zero=1),
                 dict(t=16, d=4, zero=3, microbatches=4), dict(t=1, d=64, zero=2, b=1)):
        st = step(**over)
        pv = plan(**over)
        parts = (st.compute_s + st.memory_s + st.tp_comm_exposed_s + st.recompute_s + st.bubble_s + st.pp_comm_s
                 + st.dp_comm_exposed_s + st.zero3_gather_exposed_s + st.optimizer_s)
        assert parts == pytest.approx(st.step_time_s, rel=1e-6)  # float32 times
        assert 0 < st.mfu <= st.hfu < 1
        assert st.tp_comm_exposed_s <= st.tp_comm_s and st.dp_comm_exposed_s <= st.dp_comm_s
        sequences = pv.b * pv.d * pv.microbatches
        assert st.tokens_per_s == pytest.approx(sequences * 2048 / st.step_time_s)
        gpus = pv.t * pv.p * pv.d
        assert st.mfu == pytest.approx(st.model_flops / (st.step_time_s * gpus * 312e12))


def test_k22_22b_step_is_compute_bound():
    # K22's 22B preset (t = 8, b = 4, one micro-batch, SP + selective): 48 layers of about
    # 20.4 ms (Table 4) = 0.98 s plus the head and the optimizer; no bubble, no DP.
    st = step(sp=1, recompute=1)
    assert 0.98 < st.step_time_s < 1.25
    assert st.bubble_s == st.pp_comm_s == st.dp_comm_s == st.zero3_gather_s == 0


def test_communication_terms_switch_on_and_off():
    assert step(t=1).tp_comm_s == 0
    layer8 = perf.layer_time(GPT22B, A100, plan(t=8))
    layer16 = perf.layer_time(GPT22B, A100, plan(t=16))
    # t = 16 spans two 8-GPU nodes: 25 GB/s instead of 300 GB/s per GPU, ring factor 15/16 vs 7/8.
    assert layer16.forward_comm_s / layer8.forward_comm_s == pytest.approx((15 / 16) / (7 / 8) * 300 / 25)
    plain, zero1, zero3 = (step(d=8, zero=z, microbatches=4) for z in (0, 1, 3))
    # reduce-scatter of fp32 grads + all-gather of bf16 weights, (4 + 2)(d-1)/d, vs an fp32
    # all-reduce, 2 * 4 (d-1)/d: 0.75
    assert zero1.dp_comm_s == pytest.approx(0.75 * plain.dp_comm_s)
    assert zero3.zero3_gather_s > 0 and zero1.zero3_gather_s == 0
    assert zero3.step_time_s > zero1.step_time_s
    assert zero1.optimizer_s == pytest.approx(plain.optimizer_s / 8, rel=1e-6)
    across = step(t=8, d=2, microbatches=4)  # d-ranks on two nodes
    within = step(t=4, d=2, microbatches=4)
    assert across.dp_comm_s / 2 > within.dp_comm_s  # network vs NVLink, for half the grads per GPU


# --- scalars and arrays ------------------------------------------------------------------------
PLANS = [
    dict(),
    dict(sp=1, recompute=1),
    dict(recompute=2, p=4, m=3, microbatches=12, recomputed_layers=2),
    dict(t=2, d=4, zero=1, b=2, microbatches=8),
    dict(t=16, d=2, zero=3, b=1, microbatches=16, sp=1),
    dict(t=1, p=2, d=8, zero=2, b=1, microbatches=4, recomputed_layers=24, recompute=1),
]


def as_arrays(plans: list[PlanValues], repeat: int = 1) -> PlanValues:
    return PlanValues(**{f.name: np.tile(np.array([getattr(pl, f.name) for pl in plans]), repeat)
                         for f in fields(PlanValues)})


@pytest.mark.parametrize("repeat", [1, 11_000])  # 66,000 plans: more than one CHUNK_SIZE block
def test_arrays_and_scalars_agree(repeat):
    plans = [plan(**over) for over in PLANS]
    batches = [pl.b * pl.d * pl.microbatches for pl in plans]
    arrays = as_arrays(plans, repeat)
    st = perf.step_time(GPT22B, TRAINING, A100, arrays, np.tile(np.array(batches), repeat))
    for i, (pl, gb) in enumerate(zip(plans, batches)):
        one = perf.step_time(GPT22B, TRAINING, A100, pl, gb)
        for f in fields(perf.StepTime):
            value = getattr(st, f.name)
            got = value[i + len(plans) * (repeat - 1)] if isinstance(value, np.ndarray) else value
            assert float(got) == getattr(one, f.name), f.name  # bit for bit (perf.TIME_DTYPE)
    lean = perf.step_time(GPT22B, TRAINING, A100, arrays, np.tile(np.array(batches), repeat), breakdown=False)
    assert lean.compute_s is None
    for name in ("model_flops", "bubble_fraction", "step_time_s", "tokens_per_s", "mfu"):
        np.testing.assert_array_equal(getattr(lean, name), getattr(st, name))


def test_layer_time_arrays_and_scalars_agree():
    plans = [plan(**over) for over in PLANS]
    arrays = perf.layer_time(GPT22B, A100, as_arrays(plans))
    for i, pl in enumerate(plans):
        one = perf.layer_time(GPT22B, A100, pl)
        for f in fields(perf.LayerTime):
            assert float(getattr(arrays, f.name)[i]) == getattr(one, f.name)


def test_many_plans_as_arrays():
    # Speed is measured by benchmarks/bench_search.py, not by a timed test; this checks a large
    # random batch of plans evaluates to sane numbers in one vectorised call.
    n = 200_000
    rng = np.random.default_rng(0)
    t = rng.choice([1, 2, 4, 8, 16], n)
    p = rng.choice([1, 2, 4, 8, 16], n)
    d = rng.choice([1, 2, 4, 8, 64], n)
    pv = PlanValues(t=t, p=p, d=d, shard=d, m=np.where(p > 1, rng.choice([1, 2, 3], n), 1),
                    sp=((rng.random(n) < 0.5) & (t > 1)).astype(np.int64), zero=rng.integers(0, 4, n),
                    b=rng.choice([1, 2, 4], n), recompute=rng.integers(0, 3, n), recomputed_layers=np.ones(n, np.int64),
                    microbatches=rng.choice([8, 16, 64], n))
    gb = pv.b * pv.d * pv.microbatches
    st = perf.step_time(load_model("gpt3-175b").model, TRAINING, A100, pv, gb, breakdown=False)
    assert np.all((st.mfu > 0) & (st.mfu < 1))
