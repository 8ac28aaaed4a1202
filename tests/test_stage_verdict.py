"""The fit verdict covers every pipeline stage (issue 20, plan/stage_verdict.py): a stage with a lower allocated peak
than the most loaded one can fragment more and die first; stages with the same run are replayed once; the verdict
alone stops at the first run that dies."""

from __future__ import annotations

from click.testing import CliRunner

import memplan.plan.stage_verdict as stage_verdict
from memplan import estimate
from memplan.api.options import PlanOptions
from memplan.cli import cli
from memplan.memory.reserved import allocation_stream
from memplan.plan.estimate import device_bytes

MiB = 1 << 20

# llama3-8b (h = 4096, v = 128,256, 32 layers) on 8 H100s as Megatron-LM runs it with t = 1, p = 4, d = 2, ZeRO-1,
# selective recompute, uneven stages (--decoder-first-pipeline-num-layers 8 --decoder-last-pipeline-num-layers 12:
# 8 / 6 / 6 / 12 layers), s = 6,720, the replay alone deciding (--frag-margin 0), 61.2 GB per GPU.
PLAN = dict(gpus=8, tp=1, pp=4, dp=2, vpp=1, sp=False, zero=1, micro_batch=1, recompute="selective", seq_len=6720,
            gpu="h100-80gb", first_stage_layers=8, last_stage_layers=12, frag_margin=0.0, mem="61.2GB")


def test_a_stage_below_the_most_loaded_dies_first():
    """Stage 3 (12 layers, the head and its fp32 logits, one micro-batch in flight) has the highest allocated peak
    and its run completes in 61.2 GB: the old verdict, which replayed the most loaded stage only, said "fits".
    Stage 0 (8 layers, the embedding, p = 4 micro-batches in flight at its first backward) has a lower allocated
    peak and dies. Why it fragments more, by hand: at s = 6,720 a layer's s x h activation is s h 2 B = 6,720 x
    4,096 x 2 = 55,050,240 B = 52.5 MiB, not a multiple of kRoundLarge (2 MiB); a segment made for it is rounded up
    to 54 MiB and the 1.5 MiB left over (more than kSmallSize, 1 MiB: should_split) is split off and stays free
    inside the segment while the activation lives: no large-pool request of the step is that small. Every such
    activation alive in a segment of its own leaves 1.5 MiB that no other tensor can use; stage 0 holds 4 x 8 layer
    activation sets at its first backward, stage 3 1 x 12, so stage 0 makes more of those segments and holds more
    free bytes in pieces. Under pressure the allocator releases its whole free segments and retries, but the tails
    sit in segments with a live block, so stage 0 dies with the bytes it asks for free in total, in pieces.
    Asserted: the ordering of the stages and the event, not memplan's figures."""
    tail = -(-PLAN["seq_len"] * 4096 * 2 // (2 * MiB)) * 2 * MiB - PLAN["seq_len"] * 4096 * 2
    assert tail == 3 * MiB // 2 > MiB  # the hand figure above: split off, kept free while the activation lives
    result = estimate("llama3-8b", **PLAN)
    est = result.estimate
    by_stage = {v.stage: v for v in est.stage_verdicts}
    assert sorted(by_stage) == [0, 1, 2, 3]
    assert est.most_loaded == 3 and by_stage[3].device.allocated_peak > by_stage[0].device.allocated_peak
    # the old verdict: the most loaded stage's run completes within the budget
    assert not by_stage[3].dies and by_stage[3].device.total <= est.budget_bytes
    # the new one: stage 0's run dies, so the plan does not fit, and stage 0 decides
    assert by_stage[0].dies and not result.fits and est.decided == 0
    oom = by_stage[0].reserved.oom_event
    assert oom["phase"] == "step 2"  # in the steady state, not the first step's lazily made optimizer states
    # it dies of fragmentation: what is allocated plus the request is within what the allocator may take
    assert oom["allocated_bytes"] + oom["requested_bytes"] <= by_stage[0].reserved.capacity_bytes
    # more segments of 54 MiB for 52.5 MiB activations on stage 0 than on stage 3 (its micro-batches in flight)
    segments = {i: by_stage[i].reserved.result.segment_allocs.count(54 * MiB) for i in (0, 3)}
    assert segments[0] > segments[3] > 0
    memory = result.to_dict()["memory"]
    assert memory["verdict_stage"] == memory["replayed_stage"] == 0 and memory["oom_event"] == oom
    assert [(s["stage"], s["dies"]) for s in memory["stages_replayed"]] == [(0, True), (1, False), (2, False),
                                                                            (3, False)]
    # search and --max-seq decide the plan as estimate does (tests/test_verdict_agreement.py: their lengths)
    assert device_bytes(PlanOptions(model="llama3-8b", **PLAN).config()[1], gpu=est.gpu, fragmentation_margin=0.0,
                        budget_bytes=est.budget_bytes) > est.budget_bytes
    args = ["estimate", "--model", "llama3-8b", "--no-sp"] + [
        f"--{k.replace('_', '-')}={v}" for k, v in PLAN.items() if k != "sp"]
    out = CliRunner().invoke(cli, args).output
    assert "the run of stage 0 replayed" in out and "stage 0 decides" in out and "does not fit" in out, out


def _counting(monkeypatch) -> list:
    calls = []
    replay_run = stage_verdict.replay_run

    def counted(stream, *args, **kwargs):
        calls.append(stream.stage)
        return replay_run(stream, *args, **kwargs)

    monkeypatch.setattr(stage_verdict, "replay_run", counted)
    return calls


def test_identical_runs_are_replayed_once(monkeypatch):
    # One micro-batch per step (global batch 2 = d x b): every stage holds one micro-batch in flight, so the middle
    # stages 1 and 2 (8 layers each, no embedding, no head) run the same allocations and frees; stage 0 adds the
    # embedding, stage 3 the head and the loss. 40 GB: every stage's allocated peak x 1.5 + runtime is above it
    # (asserted), so every stage is worth a replay (stage_verdict.worth_replaying)
    plan = dict(gpus=8, tp=1, pp=4, dp=2, micro_batch=1, global_batch=2, seq_len=4096, gpu="h100-80gb", mem="40GB")
    config = PlanOptions(model="llama3-8b", **plan).config()[1]
    ops = {i: allocation_stream(config, stage=i).ops() for i in range(4)}
    assert ops[1] == ops[2] and ops[0] != ops[1] and ops[3] != ops[1]
    calls = _counting(monkeypatch)
    est = estimate("llama3-8b", **plan).estimate
    assert sorted(set(calls)) == [0, 1, 3]  # three distinct runs, stage 2 standing on stage 1's replay (stage 3's
    # run dies at 40 GB: replayed once more with expandable segments for the report)
    by_stage = {v.stage: v for v in est.stage_verdicts}
    assert by_stage[2].same_as == 1 and by_stage[2].reserved.result == by_stage[1].reserved.result
    assert by_stage[2].reserved.stage == 2 and all(by_stage[i].same_as is None for i in (0, 1, 3))
    assert all(3 * v.device.allocated_peak + 2 * v.device.runtime_bytes > 2 * est.budget_bytes for v in by_stage.values())


def test_a_stage_far_below_the_budget_is_not_replayed(monkeypatch):
    # the same plan on a whole H100: stages 1 and 2 hold 8 layers and one micro-batch each, their allocated peak x 1.5
    # + runtime is within the budget (asserted): not replayed, their flat need counted; the most loaded always is
    plan = dict(gpus=8, tp=1, pp=4, dp=2, micro_batch=1, global_batch=2, seq_len=4096, gpu="h100-80gb")
    calls = _counting(monkeypatch)
    est = estimate("llama3-8b", **plan).estimate
    skipped = [v for v in est.stage_verdicts if v.reserved is None]
    assert est.most_loaded in calls and est.most_loaded not in [v.stage for v in skipped]
    assert {v.stage for v in skipped} >= {1, 2} and not set(calls) & {v.stage for v in skipped}
    assert all(3 * v.device.allocated_peak + 2 * v.device.runtime_bytes <= 2 * est.budget_bytes for v in skipped)
    assert all(not v.device.replayed and v.device.total == v.device.flat_total for v in skipped)


def test_the_verdict_alone_stops_at_the_first_run_that_dies(monkeypatch):
    # 60.9 GB less the runtime leaves the allocator less than stage 3's allocated peak (asserted): its run, replayed
    # first (the most loaded), must die, and the plan does not fit whatever the other stages do
    plan = {**PLAN, "mem": "60.9GB"}
    config = PlanOptions(model="llama3-8b", **plan).config()[1]
    est = estimate("llama3-8b", **plan).estimate
    assert est.stage_verdicts[3].device.allocated_peak > est.budget_bytes - est.device.runtime_bytes
    calls = _counting(monkeypatch)
    need = device_bytes(config, gpu=est.gpu, fragmentation_margin=0.0, budget_bytes=est.budget_bytes)
    assert calls == [3] and need > est.budget_bytes
