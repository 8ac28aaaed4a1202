"""torchtitan's multi-stage pipeline schedules Interleaved1F1B and InterleavedZeroBubble (torch 2.13): torchtitan's
stages per rank, torch's step order and what each rank holds at its peak, against torch's real schedule measured
over gloo (validation/titan_pp.py). Opt-in (MEMPLAN_TITAN_SLOW=1): the re-measurement (~130 s) and the comparison with
torch's own order (~3 s of import)."""

import os

import pytest

from memplan.inventory.titan import layer_bytes, llama3_layer_terms
from memplan.memory.pipeline import chunks_in_flight, schedule, titan_stage_layers, titan_stages_per_rank, torch_round
from memplan.memory.pipeline_multi import peak_sets

I1F1B = "Interleaved1F1B"
SLOW = pytest.mark.skipif(not os.environ.get("MEMPLAN_TITAN_SLOW"), reason="set MEMPLAN_TITAN_SLOW=1 to run")
H, A, G, F, V, S = 64, 4, 2, 160, 128, 16  # validation/titan.py Shape(), vocab 128, s 16, b 1, 6 layers

ZB = "InterleavedZeroBubble"
# PYTHONPATH=. python -m validation.titan_pp Interleaved1F1B InterleavedZeroBubble (2 ranks x 2 stages, 6 layers; the
# dataloader's positions a model kwarg of every stage): saved_peak per rank
MEASURED = {(I1F1B, 3): (436_992, 358_468), (I1F1B, 4): (340_096, 291_072), (ZB, 3): (339_968, 417_284),
            (ZB, 4): (291_584, 388_096)}


def test_stages_per_rank():
    # torchtitan 0.3.0 _get_pipeline_metadata: 2 a rank by default; else ceil((L + 2) / layers_per_stage) stages,
    # a multiple of p, >= 2 a rank. L = 32, 4 a stage: ceil(34 / 4) = 9: p = 3 gives 3; p = 2 refused (9 odd);
    # 17 a stage: 2 stages, one a rank at p = 2: refused
    assert titan_stages_per_rank(2, 32) == 2
    assert titan_stages_per_rank(3, 32, 4) == 3
    for p, per in ((2, 4), (2, 17)):
        with pytest.raises(ValueError):
            titan_stages_per_rank(p, 32, per)
    # the p m virtual stages split as titan_stage_layers: L = 32, p = 2, m = 2: 8, 9, 8, 7 (rank 0: 8 + 8, rank 1:
    # 9 + 7); the measured L = 6: 8 effective, 2 each: 1, 2, 2, 1
    assert titan_stage_layers(4, 32) == (8, 9, 8, 7) and titan_stage_layers(4, 6) == (1, 2, 2, 1)


def test_order_by_hand():
    # torch's _get_1f1b_rank_ops, p = 2, m = 2, M = 4: round = 4 // max(1, 4 // 2) = 2; rank 1's warm-up
    # 2 (p - 1 - 1) + (m - 1) 2 = 2 forwards of chunk 0; then step k: forward of chunk (k // 2) % 2, backward of
    # chunk 1 - ((k - 2) // 2) % 2
    assert schedule(1, 2, 2, 4, I1F1B)[:8] == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("B", 0, 1), ("F", 1, 1),
                                           ("B", 1, 1), ("F", 2, 0), ("B", 0, 0)]
    # the round differs from Megatron-LM's p when p does not divide M: p = 2, M = 3: one round of 3; rank 0 warm-up
    # 2 + 3 = 5 forwards, + 1 = 6 = every (micro-batch, chunk) set, where Megatron-LM's count is 2 + 2 + 1 = 5
    assert torch_round(2, 3) == 3 and torch_round(4, 10) == 5
    assert chunks_in_flight(0, 2, 2, 3, torch_round(2, 3)) == 6 and chunks_in_flight(0, 2, 2, 3) == 5
    with pytest.raises(ValueError):
        torch_round(4, 9)  # 2 rounds do not divide 9: torch refuses


def test_zero_bubble_order_by_hand():
    # torch's ScheduleInterleavedZeroBubble (ZB1P): warm-up (m - 1) round + 1 (p - 1 - rank) (multiply_factor 1);
    # each backward split into I (input gradients) and W (weight gradients), the W of the n-th I right after the
    # (n + rank)-th I. p = 2, m = 2, M = 4, rank 1: warm-up 2; F(0,1) I(0,1); F(1,1) I(1,1) W(0,1); F(2,0) I(0,0)
    # W(1,1); ...; its W's hold the forward's saved tensors (torch's stage_backward_input retains the graph):
    # rank 1 holds 4 of chunk 0 at once (F(3,0) before W(0,0)), where Interleaved1F1B holds 3
    order = schedule(1, 2, 2, 4, ZB)
    assert order[:12] == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("I", 0, 1), ("F", 1, 1), ("I", 1, 1), ("W", 0, 1),
                          ("F", 2, 0), ("I", 0, 0), ("W", 1, 1), ("F", 3, 0), ("I", 1, 0)]
    assert peak_sets(order, [1, 0])[0] == 4 and peak_sets(schedule(1, 2, 2, 4, I1F1B), [1, 0])[0] == 3


@pytest.mark.parametrize("p,m", [(2, 2), (4, 2), (3, 3)])
def test_order_peak_is_the_count(p, m):
    for micro in (1, 2, p, 2 * p, 3 * p):
        rnd = torch_round(p, micro)
        for r in range(p):
            order = schedule(r, p, m, micro, I1F1B)
            assert sorted(order) == sorted((k, mb, c) for k in "FB" for mb in range(micro) for c in range(m))
            assert all(order.index(("F", mb, c)) < order.index(("B", mb, c)) for _, mb, c in order)
            flight = chunks_in_flight(r, p, m, micro, rnd)
            assert peak_sets(order, [1] * m)[0] == flight
            if micro % p == 0:  # torch's count and order are Megatron-LM's where p divides M
                assert flight == chunks_in_flight(r, p, m, micro) and order == schedule(r, p, m, micro)


def expected_saved(kind: str, micro: int) -> tuple[int, int]:
    """Each rank's saved peak from the order: rank 0's chunks hold 1 and 2 layers (chunk 0 + the token ids),
    rank 1's 2 and 1 (chunk 1 + the final norm; the loss's fp32 log-softmax 4 v and nll_loss's 4-byte total_weight
    per micro-batch); + the token ids (saved by rank 0's embedding) / the targets (by rank 1's loss) of all M
    micro-batches, one storage of 8 s M bytes (as in tests/test_titan_pp.py), alive while such a micro-batch is held
    (rank 1's Interleaved1F1B peak at M = 4 is 3 micro-batches of chunk 0, 6 layers' worth against 5 + the loss's,
    without it). InterleavedZeroBubble: the loss (above lm_head, the last weight) is dropped at I, the rest at W.
    Not saved tensors, not counted by the hook: the intermediate gradients ZB keeps from I to W."""
    layer = layer_bytes(llama3_layer_terms(H, A, G, F), "none", S, 1)
    norm = sum(t.bytes_per_token for t in llama3_layer_terms(H, 1, 1, 1, 1) if t.id.startswith("ffn_norm."))
    ids = 8 * S * micro
    rank0 = dict(weight=[layer, 2 * layer], once=[ids, 0])
    rank1 = dict(weight=[2 * layer, layer + norm * S], early=[0, 4 * V * S + 4], early_once=[0, ids])
    return tuple(peak_sets(schedule(r, 2, 2, micro, kind), **kw)[0] for r, kw in enumerate((rank0, rank1)))


@pytest.mark.parametrize("kind,micro", sorted(MEASURED))
def test_saved_peak_matches_measurement(kind, micro):
    assert expected_saved(kind, micro) == MEASURED[kind, micro]


@SLOW
@pytest.mark.parametrize("kind,micro", sorted(MEASURED))
def test_saved_peak_measured_over_gloo(kind, micro):
    from validation.titan import Shape
    from validation.titan_pp import measure_pp

    ranks = measure_pp(Shape(H, A, G, F), 6, V, S, 1, micro, kind, chunks=2)
    assert [[sum(n.startswith("layers.") for n in c) for c in r["modules"]] for r in ranks] == [[1, 2], [2, 1]]
    assert tuple(r["saved_peak"] for r in ranks) == expected_saved(kind, micro) == MEASURED[kind, micro]
    assert all(r["saved_after"] == 0 for r in ranks)


class _Stage:
    """What ScheduleInterleaved1F1B reads of its stages to build its order (no process group needed)."""

    def __init__(self, rank: int, p: int, index: int, stages: int) -> None:
        self.group_size, self.group_rank, self.stage_index, self.num_stages = p, rank, index, stages
        self.is_first, self.is_last = index == 0, index == stages - 1
        self.submod = None  # InterleavedZeroBubble looks for compiled modules in it (none: not a Module)


@SLOW  # importing torch.distributed.pipelining takes ~3 s (the order itself 0.02 s); test_order_by_hand is the fast one
def test_order_is_torchs():
    # torch 2.13's own ScheduleInterleaved1F1B.pipeline_order (its compute actions; a rank's stage r + c p is its
    # local chunk c) against `schedule`, p dividing M or not (p = 4, M = 6: one round of 6; M = 10: 2 of 5)
    pytest.importorskip("torch")
    from torch.distributed.pipelining.schedules import get_schedule_class

    for kind in (I1F1B, ZB):
        for p, m, micro in ((2, 2, 3), (2, 2, 4), (4, 2, 6), (4, 2, 10), (3, 3, 6), (4, 2, 2), (2, 3, 4)):
            sched = get_schedule_class(kind)([_Stage(0, p, c * p, p * m) for c in range(m)], n_microbatches=micro)
            for r in range(p):
                real = [(a.computation_type.value, a.microbatch_index, (a.stage_index - r) // p)
                        for a in sched.pipeline_order[r] if a is not None]
                assert real == schedule(r, p, m, micro, kind), (kind, p, m, micro, r)
