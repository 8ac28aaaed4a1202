"""torchtitan's multi-stage pipeline schedules (torch 2.13's Interleaved1F1B, LoopedBFS, InterleavedZeroBubble,
ZBVZeroBubble, DualPipeV; memplan/memory/pipeline_multi.py): placement, torch's order per rank (by hand here; against
torch's own pipeline_order opt-in), what each rank holds at its peak against torch's real schedules run over gloo
(validation/titan_pp.py: saved tensors, the split backward's I -> W gradients), estimate / search / their refusals.
Opt-in (MEMPLAN_TITAN_SLOW=1): the re-measurement (~6 min at load 4-7 on the shared 2 cores) and the comparison with torch's order."""

import os

import numpy as np
import pytest

from memplan.api.estimating import estimate
from memplan.api.searching import search
from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.inventory.titan import layer_bytes, llama3_layer_terms, split_backward_grads
from memplan.memory.pipeline import titan_stage_layers
from memplan.memory.pipeline_multi import (MULTI_SCHEDULES, bubble_share, multi_refusal, peak_state, rank_chunks,
                                           rank_order, rank_stages, rank_states, steady_microbatches)
from memplan.plan.titan import titan_dims

SLOW = pytest.mark.skipif(not os.environ.get("MEMPLAN_TITAN_SLOW"), reason="set MEMPLAN_TITAN_SLOW=1 to run")
H, A, G, F, V, S = 64, 4, 2, 160, 128, 16  # validation/titan.py Shape(), vocab 128, s 16, b 1, 6 layers, 2 ranks
TINY = ModelSpec(name="tiny-titan", num_layers=6, hidden_size=H, num_attention_heads=A, num_kv_heads=G,
                 ffn_hidden_size=F, vocab_size=V, seq_length=S, norm="rmsnorm", dropout=False, tied_embeddings=False,
                 position_embedding="rope", mlp="swiglu", bias=False)

# PYTHONPATH=. python -m validation.titan_pp Interleaved1F1B InterleavedZeroBubble LoopedBFS ZBVZeroBubble DualPipeV
# (2 ranks x 2 stages, 6 layers; labels a storage of their own; the dataloader's positions a model kwarg of every stage,
# as torchtitan's Trainer passes them): per rank (saved_peak, grads_peak, held_peak)
MEASURED = {
    ("Interleaved1F1B", 3): ((436_992, 0, 436_992), (358_468, 0, 358_468)),
    ("Interleaved1F1B", 4): ((340_096, 0, 340_096), (291_072, 0, 291_072)),
    ("InterleavedZeroBubble", 3): ((339_968, 53_248, 393_216), (417_284, 106_496, 478_336)),
    ("InterleavedZeroBubble", 4): ((291_584, 53_248, 344_832), (388_096, 106_496, 494_592)),
    ("LoopedBFS", 3): ((436_992, 0, 436_992), (492_492, 0, 492_492)),
    ("LoopedBFS", 4): ((582_656, 0, 582_656), (656_656, 0, 656_656)),
    ("ZBVZeroBubble", 3): ((213_316, 34_816, 239_552), (388_096, 159_744, 450_816)),
    ("ZBVZeroBubble", 4): ((213_572, 34_816, 239_680), (388_096, 159_744, 450_816)),
    ("DualPipeV", 4): ((262_084, 34_816, 262_084), (485_120, 106_496, 485_120)),
    ("DualPipeV", 5): ((262_340, 34_816, 262_340), (485_120, 106_496, 485_120)),
}


def test_placement_by_hand():
    # torchtitan's _get_pp_rank_to_stage_indices_mapping: "loop" r, r + p; "v" (ZBV, DualPipeV) r, 2p - 1 - r. Llama 3
    # 8B, p = 2: 4 virtual stages of 34 effective layers: 9, 9, 8, 8 -> 8, 9, 8, 7 layers
    assert rank_stages(1, 2, 2, "Interleaved1F1B") == (1, 3) and rank_stages(1, 2, 2, "ZBVZeroBubble") == (1, 2)
    assert [rank_chunks(r, 2, 2, 32, "LoopedBFS") for r in (0, 1)] == [(8, 8), (9, 7)]
    assert [rank_chunks(r, 2, 2, 32, "DualPipeV") for r in (0, 1)] == [(8, 7), (9, 8)]


def test_orders_by_hand():
    # torch 2.13 ScheduleLoopedBFS: every forward of stage r, then of r + p; the backwards from the last stage, the
    # micro-batches in reverse
    assert rank_order(0, 2, 2, 2, "LoopedBFS") == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1), ("B", 1, 1),
                                                   ("B", 0, 1), ("B", 1, 0), ("B", 0, 0)]
    # ScheduleZBVZeroBubble, p = 2, M = 3, rank 1: warm-up 2(p - r) - 1 = 1 F0; r = 1 (F1, F0); p - r = 1 (F1 I1 W1);
    # stable while F0 < 3: F0 I0 W0 F1 I1 W1; cool-down r = 1 (I0 I1), p - r = 1 (I0 W0), then the W1, the W0 left
    F_, I_, W_ = "F", "I", "W"
    assert rank_order(1, 2, 2, 3, "ZBVZeroBubble") == [
        (F_, 0, 0), (F_, 0, 1), (F_, 1, 0), (F_, 1, 1), (I_, 0, 1), (W_, 0, 1), (F_, 2, 0), (I_, 0, 0), (W_, 0, 0),
        (F_, 2, 1), (I_, 1, 1), (W_, 1, 1), (I_, 1, 0), (I_, 2, 1), (I_, 2, 0), (W_, 1, 0), (W_, 2, 1), (W_, 2, 0)]
    # ScheduleDualPipeV, p = 2, M = 4, rank 1: step 2 (r + 1 = 2 x F0 F1); step 4 (M - 2p + r + 1 = 2): F0 B1 (not
    # overlapped on the last rank: the same order), F1 B0, F0 B1, F1 B0; step 6 (r + 1 = 2): B1 B0, then from
    # i = 1 (odd rank) split: I1 I0; step 8: the queued W's
    assert rank_order(1, 2, 2, 4, "DualPipeV") == [
        (F_, 0, 0), (F_, 0, 1), (F_, 1, 0), (F_, 1, 1), (F_, 2, 0), ("B", 0, 1), (F_, 2, 1), ("B", 0, 0), (F_, 3, 0),
        ("B", 1, 1), (F_, 3, 1), ("B", 1, 0), ("B", 2, 1), ("B", 2, 0), (I_, 3, 1), (I_, 3, 0), (W_, 3, 1), (W_, 3, 0)]


def test_torchs_limits_by_hand():
    assert multi_refusal(2, 3, 8, "ZBVZeroBubble")  # ScheduleZBVZeroBubble: exactly 2 stages per rank
    assert multi_refusal(2, 2, 3, "DualPipeV") and not multi_refusal(2, 2, 4, "DualPipeV")  # M >= 2p
    assert multi_refusal(4, 2, 9, "Interleaved1F1B") and not multi_refusal(4, 2, 10, "Interleaved1F1B")  # M % rounds
    assert multi_refusal(2, 2, 8, "InterleavedZeroBubble", compiled=True)  # I / W through compile: not modelled
    assert not multi_refusal(2, 2, 8, "Interleaved1F1B", compiled=True) and not multi_refusal(2, 2, 1, "LoopedBFS")
    base = dict(impl="torchtitan", gpus=16, pp=2, global_batch=64, seq_len=1024)
    for extra, match in ((dict(pipeline_schedule="InterleavedZeroBubble", compile=True), "split backward"),
                         (dict(pipeline_schedule="ZBVZeroBubble", pipeline_layers_per_stage=3), "exactly 2 stages"),
                         (dict(pipeline_schedule="LoopedBFS", pp=1), "--pp 2 or more"),
                         (dict(vpp=2, pipeline_schedule="Interleaved1F1B"), "--vpp is Megatron-LM.s"),
                         (dict(pipeline_layers_per_stage=4), "multi-stage schedules"),
                         (dict(pipeline_schedule="Interleaved1F1B", pipeline_layers_per_stage=17), "at least 2")):
        with pytest.raises(MemplanError, match=match):
            estimate("llama3-8b", **{**base, **extra})


def test_the_steady_state_repeats():
    # what a search evaluates for M micro-batches: the order of `steady_microbatches(M)` (its distinct held states,
    # so its peak, are M's); fails if the reduction drops a state the full order has
    for kind in ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        for p in (2, 3, 4):
            for micro in range(1, 25):
                if multi_refusal(p, 2, micro, kind) or steady_microbatches(p, 2, micro, kind) == micro:
                    continue
                few = steady_microbatches(p, 2, micro, kind)
                for r in range(p):
                    full, short = (rank_states(r, p, 2, n, kind) for n in (micro, few))
                    assert {tuple(x) for x in np.concatenate(full, axis=1).tolist()} == {
                        tuple(x) for x in np.concatenate(short, axis=1).tolist()}, (kind, p, micro, r)
    assert steady_microbatches(4, 2, 15, "Interleaved1F1B") == 10  # 3 rounds of 5: two of them
    assert steady_microbatches(2, 2, 9, "LoopedBFS") == 9


def _i_to_w_per_token() -> tuple[int, int]:
    """The I -> W gradients of the tiny model on CPU, by hand: a layer's bf16 output gradients of wq (a d = 64), wk,
    wv (g d = 32 each), wo (64), w1, w3 (160 each), w2 (64) and the fp32 ones of its two RMSNorm weight products
    (torch's composite CPU rms_norm multiplies in fp32: 4 x 64 each); the head's: the final norm's (fp32, 4 x 64)
    and the LM head's (the logits, bf16, 2 x 128)."""
    layer = 2 * (64 + 32 + 32 + 64 + 160 + 160 + 64) + 2 * 4 * 64
    return layer, 4 * 64 + 2 * 128


def expected(kind: str, micro: int) -> list[tuple[int, int, int]]:
    """Each rank's (saved peak, I -> W peak, both) from torch's order: a chunk's saved tensors (its layers; stage 0
    the token ids storage, 8 s M bytes, the last stage the final norm) until its B or W; the loss (the fp32
    log-softmax 4 v and nll_loss's 4-byte total_weight a micro-batch, the labels' 8 s M storage) until its B or I;
    the I -> W gradients (memplan's split_backward_grads terms, checked against the hand count) from I to W
    (stage 0 runs no I)."""
    layer = layer_bytes(llama3_layer_terms(H, A, G, F), "none", S, 1)
    norm = sum(t.bytes_per_token for t in llama3_layer_terms(H, 1, 1, 1, 1) if t.id.startswith("ffn_norm."))
    values = TINY.symbols(b=1, t=1)
    grads = {t.id: t.bytes(values, 2, 0) // S for t in split_backward_grads(TINY, "cpu")}
    per_layer = sum(n for k, n in grads.items() if k in ("zb.linear_out_col", "zb.linear_out_row", "zb.norm_out"))
    assert (per_layer, grads["zb.final_norm_out"] + grads["zb.logits"]) == _i_to_w_per_token()
    split, ids, last = titan_stage_layers(4, 6), 8 * S * micro, 3
    out = []
    for r in range(2):
        stages = rank_stages(r, 2, 2, kind)
        kw = dict(weight=[split[s] * layer + (s == last) * norm * S for s in stages],
                  once=[(s == 0) * ids for s in stages], early=[(s == last) * (4 * V * S + 4) for s in stages],
                  early_once=[(s == last) * ids for s in stages], first_chunk_i=stages.index(0) if 0 in stages else None)
        between = [(s != 0) * (split[s] * per_layer + (s == last) * (grads["zb.final_norm_out"] + grads["zb.logits"]))
                   * S for s in stages]
        order = rank_order(r, 2, 2, micro, kind)
        saved = peak_state(order, **kw)[0]
        only = peak_state(order, [0, 0], between=between, first_chunk_i=kw["first_chunk_i"])[0]
        out.append((int(saved), int(only), int(peak_state(order, between=between, **kw)[0])))
    return out


@pytest.mark.parametrize("kind,micro", sorted(MEASURED))
def test_peaks_match_measurement(kind, micro):
    assert expected(kind, micro) == list(MEASURED[kind, micro])


PER_TOKEN = 168_584  # a Llama 3 8B layer's kept bytes per token on CUDA, AC none (tests/test_titan_cli.py, by hand)


def test_estimate_interleaved_by_hand():
    # p = 2, M = 64 / 8 = 8, rank 0 holds stages 0 and 2 (8 layers each). torch's order (p divides M: Megatron-LM's):
    # warm-up 2 (p - 1) + (m - 1) p = 4 forwards, then (F, B) pairs: after F(3, chunk 0), B(1, chunk 1) has not run
    # yet... the most held is 5 (micro-batch, chunk) sets, at most 4 of them of chunk 0 (with the token ids)
    est = estimate("llama3-8b", impl="torchtitan", gpus=16, pp=2, global_batch=64, seq_len=1024,
                   pipeline_schedule="Interleaved1F1B").estimate
    s0 = est.stages[0]
    assert [int(s.layers) for s in est.stages] == [16, 16] and [int(n) for n in s0.held] == [4, 1]
    assert s0.activations == 40 * PER_TOKEN * 1024 + 4 * 8 * 1024
    assert not est.reserved  # the allocation stream does not model these schedules: not replayed
    assert any("8 + 8, 9 + 7 layers" in n for n in est.notes)


def test_estimate_zero_bubble_keeps_the_i_to_w_gradients():
    # CUDA: the norms' weight products in bf16 (the fused kernel): a layer's I -> W bytes per token
    # 2 (4096 + 2 x 8 x 128 + 2 x 14336) + 2 (2 x 4096) + 2 (2 x 4096) = 102,400
    zb = estimate("llama3-8b", impl="torchtitan", gpus=16, pp=2, global_batch=64, seq_len=1024,
                  pipeline_schedule="InterleavedZeroBubble").estimate
    rows = {r.term.id: r for r in zb.rows}
    assert sum(rows[k].bytes for k in ("zb.linear_out_col", "zb.linear_out_row", "zb.norm_out")) == 102_400 * 1024
    for s in zb.stages:  # the rank's activations: its saved terms and the I -> W gradients at its peak
        assert s.activations == sum(s.term_bytes.values()) + s.recompute_working_bytes
    assert zb.perf.bubble_over_ideal == pytest.approx((2 - 1) / (2 * 8) / 3)  # bubble_share: ZB-H1's third
    assert bubble_share("Interleaved1F1B") == 1.0


def test_search_tries_the_multistage_schedules_as_estimate():
    found = search("llama3-8b", impl="torchtitan", gpus=16, pp=2, tp=1, compile=False, all_variants=True, top=1,
                   global_batch=32, seq_len=1024, mem=80 * 10**9, gpu="h100-80gb").result
    dims = [titan_dims(found.config(i)) for i in range(found.candidates)]
    got = {d["pipeline_schedule"] for d in dims}
    assert set(MULTI_SCHEDULES) <= got
    # d = 8, local batch 4: M = 4 / b; DualPipeV needs M >= 2p = 4 (b = 1 only)
    assert {d["pipeline_microbatch_size"] for d in dims if d["pipeline_schedule"] == "DualPipeV"} == {1}
    e = found.evaluated
    for kind in MULTI_SCHEDULES:
        i = next(i for i, d in enumerate(dims) if d["pipeline_schedule"] == kind and d["ac"] == "none")
        d = dims[i]
        est = estimate("llama3-8b", impl="torchtitan", gpus=16, global_batch=32, seq_len=1024, gpu="h100-80gb",
                       tp=d["tp"], dp_replicate=d["dp_replicate"], ac=d["ac"], pp=2, pipeline_schedule=kind,
                       micro_batch=d["pipeline_microbatch_size"])
        assert est.estimate.step.peak_bytes == e.peak_bytes[i], kind
        assert est.estimate.perf.step_time_s == pytest.approx(e.step_time_s[i], rel=1e-6), kind


@SLOW
@pytest.mark.parametrize("kind,micro", sorted(MEASURED))
def test_peaks_measured_over_gloo(kind, micro):
    from validation.titan import Shape
    from validation.titan_pp import measure_pp

    ranks = measure_pp(Shape(H, A, G, F), 6, V, S, 1, micro, kind, chunks=2)
    assert [tuple(r[k] for k in ("saved_peak", "grads_peak", "held_peak")) for r in ranks] == list(
        MEASURED[kind, micro]) == expected(kind, micro)
    assert all(r["saved_after"] == 0 and r["grads_after"] == 0 for r in ranks)


class _Stage:
    """What torch's multi-stage schedules read of their stages to build the order (no process group needed)."""

    def __init__(self, rank: int, p: int, index: int, stages: int) -> None:
        self.group_size, self.group_rank, self.stage_index, self.num_stages = p, rank, index, stages
        self.is_first, self.is_last = index == 0, index == stages - 1
        self.submod = None  # the zero-bubble classes look for compiled modules in it (none: not a Module)


@SLOW  # importing torch.distributed.pipelining takes ~3 s; the orders themselves a fraction of a second
def test_orders_are_torchs():
    # torch 2.13's own pipeline_order (compute actions; DualPipeV's overlapped F + B as its sub-actions in order)
    pytest.importorskip("torch")
    from torch.distributed.pipelining.schedules import get_schedule_class

    for kind in MULTI_SCHEDULES:
        for p in (2, 3, 4):
            for micro in range(1, 13):
                if multi_refusal(p, 2, micro, kind):
                    continue
                sched = get_schedule_class(kind)([_Stage(0, p, s, 2 * p) for s in rank_stages(0, p, 2, kind)],
                                                 n_microbatches=micro)
                for r in range(p):
                    stages = rank_stages(r, p, 2, kind)
                    real = [(x.computation_type.value, x.microbatch_index, stages.index(x.stage_index))
                            for a in sched.pipeline_order[r] if a is not None for x in (a.sub_actions or (a,))]
                    assert real == rank_order(r, p, 2, micro, kind), (kind, p, micro, r)
