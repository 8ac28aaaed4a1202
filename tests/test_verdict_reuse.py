"""What `--max-seq` reuses across the lengths it tries is the verdict made afresh (issue 20): with one plan's
`StreamLengths` (memplan/memory/stream_lengths.py: its streams evaluated at later lengths, the most loaded stage's
replays kept by length and capacity), `device_bytes` of every stage and of the most loaded alone give what they
give without it, at each length of a walk that comes back to lengths it tried (as `every_stage_fits` checks every
stage at the length the most loaded stage's replays settled on), and the most loaded stage replayed at a length is
not replayed there again. The stages of one plan share their terms' sizes and still make their own streams."""

from __future__ import annotations

import pytest

import memplan.plan.stage_verdict as stage_verdict
from memplan import estimate
from memplan.api.options import PlanOptions
from memplan.memory.stream_lengths import StreamLengths
from memplan.plan.estimate import device_bytes
from memplan.plan.limits import _with

# llama3-8b on 8 H100s: the uneven 4-stage plan of tests/test_stage_verdict.py (8 / 6 / 6 / 12 layers, stage 0 dies
# first at 61.2 GB and s = 6,720) and an even 2-stage one with 4 micro-batches per step, the replay alone deciding
PLANS = [
    dict(gpus=8, tp=1, pp=4, dp=2, vpp=1, sp=False, zero=1, micro_batch=1, recompute="selective", seq_len=6720,
         gpu="h100-80gb", first_stage_layers=8, last_stage_layers=12, frag_margin=0.0, mem="61.2GB"),
    dict(gpus=8, tp=2, pp=2, dp=2, vpp=1, sp=True, zero=0, micro_batch=1, global_batch=8, recompute="selective",
         seq_len=4096, gpu="h100-80gb", frag_margin=0.0, mem="40GB"),
]
WALK = (6400, 6720, 6080, 6720, 6400)  # lengths in tokens (multiples of every plan's step), two tried twice


@pytest.mark.parametrize("plan", PLANS, ids=["uneven-p4", "p2-t2"])
def test_reused_verdicts_are_the_verdicts_made_afresh(plan, monkeypatch):
    est = estimate("llama3-8b", **plan).estimate
    config = PlanOptions(model="llama3-8b", **plan).config()[1]
    calls: list[tuple[int, int]] = []
    replay_run = stage_verdict.replay_run

    def counting(stream, capacity, *args, **kwargs):
        calls.append((stream.stage, len(kwargs["ops"])))
        return replay_run(stream, capacity, *args, **kwargs)

    def need(s: int, lengths, every_stage: bool) -> int:
        return device_bytes(_with(config, model=dict(seq_length=s)), gpu=est.gpu, fragmentation_margin=0.0,
                            budget_bytes=est.budget_bytes, lengths=lengths, every_stage=every_stage)

    monkeypatch.setattr(stage_verdict, "replay_run", counting)
    lengths = StreamLengths(config.training.micro_batch)
    reused = [(need(s, lengths, every), every) for s in WALK for every in (False, True)]
    replayed_reusing = len(calls)
    afresh = [(need(s, None, every), every) for s in WALK for every in (False, True)]
    assert reused == afresh
    # the walk's verdicts differ (some lengths fit, some do not, or the needs move with s): the check can fail
    assert len({n for n, _ in afresh}) > 2
    # the most loaded stage is not replayed again at a length (after itself alone, with every stage, at a length
    # tried before): fewer replays than afresh
    assert replayed_reusing < len(calls) - replayed_reusing
    assert lengths.replays and all(key[1] in WALK for key in lengths.replays)


def _walked_pair_by_definition(order, is_first, is_last, m):
    # walked_pair's rule written out as its docstring says it: at each backward right after a forward (of the
    # chunk with the embedding / the loss), count the chunk-0 micro-batches alive then; the last of the most
    alive, best = set(), (-1, 0)
    for i, (what, mb, c) in enumerate(order):
        if what == "F":
            alive.add((mb, c))
            continue
        if i and order[i - 1][0] == "F" and (not is_first or c == 0) and (not is_last or c == m - 1):
            best = max(best, (sum(1 for x in alive if x[1] == 0), i))
        alive.discard((mb, c))
    return {best[1] - 1, best[1]}


@pytest.mark.parametrize("kind", ["1F1B", "GPipe"])
def test_walked_pair_counts_as_its_rule(kind):
    # the stream's walked pair (memory/pipeline.py walked_pair counts the chunk-0 micro-batches alive as it goes)
    from memplan.memory.pipeline import schedule, walked_pair

    for p, m, microbatches in [(1, 1, 3), (4, 1, 8), (4, 2, 8), (6, 1, 9), (8, 2, 16), (35, 1, 37)]:
        if kind == "GPipe" and m > 1:
            continue
        for stage in range(p):
            order = schedule(stage, p, m, microbatches, kind)
            ends = (stage == 0, stage == p - 1)
            assert walked_pair(order, *ends, m) == _walked_pair_by_definition(order, *ends, m)


def test_stages_sharing_term_sizes_make_their_own_streams(monkeypatch):
    # the stages of one plan at one length share their terms' sizes (memory/stream_params.py _shared); a dense / MoE
    # layer term's size depends on the stage's share of its kind (DeepSeek-V3's 3 dense first layers on stage 0 of
    # torchtitan's split: 3 / 15 dense there, 0 / 16 on the next stages, shares asserted below), kept in the key.
    # Each stage's stream made after the others' (in order, then in reverse) is the one made with nothing shared
    import memplan.memory.stream_params as stream_params
    from memplan.memory.reserved import allocation_stream

    config = PlanOptions(model="deepseek-v3", impl="torchtitan", gpus=8, pp=4, dp=2, ep=1, micro_batch=1,
                         global_batch=8, seq_len=1024).config()[1]

    def ops(stage: int, alone: bool) -> list[int]:
        if alone:
            monkeypatch.setattr(stream_params, "_SHARED", type(stream_params._SHARED)())
        return allocation_stream(config, impl="torchtitan", stage=stage).ops()

    afresh = [ops(i, alone=True) for i in range(4)]
    monkeypatch.setattr(stream_params, "_SHARED", type(stream_params._SHARED)())
    assert [ops(i, alone=False) for i in range(4)] == afresh
    shares = {key[2:] for entries in stream_params._SHARED.values() for key in entries}
    assert {(3, 15), (12, 15), (0, 16), (16, 16)} <= shares  # dense / MoE shares of stages 0 and 1
    monkeypatch.setattr(stream_params, "_SHARED", type(stream_params._SHARED)())
    assert [ops(i, alone=False) for i in reversed(range(4))] == afresh[::-1]
    assert len({tuple(x) for x in afresh}) == 4  # every stage's stream its own
