"""The allocation-stream harness of issue 20 item 5 (validation/alloc_trace.py, memplan/check/allocator.py,
`memplan validate --allocator`), tested on CPU with tiny shapes: no GPU was at hand, so what only CUDA records
(torch.cuda.memory._snapshot()) is read from a snapshot written by hand in PyTorch's format."""

import dataclasses
import json
import os

import pytest

pytest.importorskip("transformers")

from memplan.check.allocator import run_allocator  # noqa: E402
from memplan.check.peak import PeakCase  # noqa: E402
from memplan.memory.alloc_conf import AllocatorConfig  # noqa: E402
from memplan.memory.allocator import replay  # noqa: E402
from validation import alloc_trace  # noqa: E402
from validation.step import StepCase, measure_step  # noqa: E402

MiB = 1 << 20
TINY = dict(model="llama", attn="sdpa", s=32, b=2, h=64, a=4, g=2, f=160, L=1, v=256, optimizer="foreach")


def test_a_snapshots_trace_becomes_the_replays_events():
    # torch.cuda.memory._snapshot()["device_traces"][0]: one entry per allocator action (TraceEntry); a block is
    # reused from free_completed, so that is the free; segment actions and free_requested are the allocator's own
    a, b = 0x7F0000000000, 0x7F0000200000
    snapshot = {"segments": [], "device_traces": [[
        {"action": "segment_alloc", "addr": a, "size": 2 * MiB, "stream": 0},
        {"action": "alloc", "addr": a, "size": 1000, "stream": 0},
        {"action": "segment_alloc", "addr": b, "size": 20 * MiB, "stream": 0},
        {"action": "alloc", "addr": b, "size": 3 * MiB, "stream": 0},
        {"action": "free_requested", "addr": a, "size": 1000, "stream": 0},
        {"action": "free_completed", "addr": a, "size": 1000, "stream": 0},
        {"action": "alloc", "addr": a, "size": 4096, "stream": 0},
    ]]}
    events = alloc_trace.snapshot_events(snapshot)
    assert events == [("alloc", a, 1000, 0), ("alloc", b, 3 * MiB, 0), ("free", a, 0, 0), ("alloc", a, 4096, 0)]
    # by hand, PyTorch's rules (../shared/reference/allocator.md): 1000 B is a small block (<= 1 MiB), rounded to
    # 1,024 B, in a new 2 MiB segment; 3 MiB is a large block below 10 MiB: a new 20 MiB segment; 4,096 B reuses
    # the small segment freed into. Reserved: 2 + 20 MiB in 2 segments
    result = replay(events, 1 << 40, AllocatorConfig())
    assert result.reserved_peak_bytes == 22 * MiB and result.segments_at_reserved_peak == 2
    assert alloc_trace.events_before_oom(snapshot) is None


def test_the_events_before_the_out_of_memory_are_counted():
    # the trace's "oom" entry (TraceEntry::OOM: the request's size, the device's free memory) comes after the
    # events the run did before the failing request and before the frees of its unwinding: 2 of the 3 here
    a, b = 0x7F0000000000, 0x7F0000200000
    snapshot = {"device_traces": [[
        {"action": "alloc", "addr": a, "size": 1000, "stream": 0},
        {"action": "alloc", "addr": b, "size": 3 * MiB, "stream": 0},
        {"action": "oom", "addr": 5 * MiB, "size": 40 * MiB, "stream": 0},
        {"action": "free_requested", "addr": b, "size": 3 * MiB, "stream": 0},
        {"action": "free_completed", "addr": b, "size": 3 * MiB, "stream": 0},
    ]]}
    assert alloc_trace.events_before_oom(snapshot) == 2


@pytest.fixture(scope="module")
def tiny_run():
    case = StepCase(**TINY)
    return case, alloc_trace.record_run(case, steps=2)


def test_the_recorded_run_is_the_measured_step(tiny_run):
    # the recording (build, optimizer, two steps, every storage in order) peaks where the harness's live tracker
    # measures the second step's peak (weights, gradients and states counted as its persistent base)
    case, rec = tiny_run
    assert rec.events[0][0] == "alloc" and rec.device == "cpu"
    assert rec.live_peak_bytes == measure_step(case).tracked_peak_bytes


def test_a_run_over_the_cap_dies_as_out_of_memory(tiny_run, monkeypatch):
    # the CPU stand-in for the card's capacity: `python -m validation.alloc_trace` exits OOM_EXIT when the live
    # bytes pass the cap, and completes at the recorded peak itself
    case, rec = tiny_run
    args = ["--case", json.dumps(dataclasses.asdict(case)), "--steps", "2"]
    monkeypatch.setenv(alloc_trace.CAP_ENV, str(rec.live_peak_bytes - 1))
    with pytest.raises(SystemExit) as died:
        alloc_trace.main(args)
    assert died.value.code == alloc_trace.OOM_EXIT
    monkeypatch.setenv(alloc_trace.CAP_ENV, str(rec.live_peak_bytes))
    alloc_trace.main(args)


def test_recordings_round_trip(tiny_run, tmp_path):
    _, rec = tiny_run
    alloc_trace.save(rec, tmp_path / "run.json.gz")
    back = alloc_trace.load(tmp_path / "run.json.gz")
    assert back.events == rec.events and back.steps == rec.steps and back.live_peak_bytes == rec.live_peak_bytes


def test_validate_allocator_compares_a_run_with_memplans_stream():
    # the check's own criteria on a real run: the replay keeps the recording's bytes, and memplan's stream of the
    # same plan peaks within 1 % of it (the whole-step claim: tests/test_validate_peak.py)
    case = PeakCase(name="tiny", **{k: v for k, v in TINY.items()})
    (result,) = run_allocator([case], allocators=("default",))
    assert result.checks == {"replay keeps the recording's bytes": True, "memplan's stream peaks within 1 %": True}
    assert result.memplan_events > 0 and result.recorded_events > result.memplan_events  # every op output vs terms


@pytest.mark.skipif(not os.environ.get("MEMPLAN_ALLOC_SLOW"), reason="spawns two fresh processes (MEMPLAN_ALLOC_SLOW=1)")
def test_first_failing_length_runs_a_fresh_process_per_length():
    small = StepCase(**{**TINY, "s": 16})
    cap = alloc_trace.record_run(small).live_peak_bytes  # s = 16 fits its own peak, s = 32 does not
    assert alloc_trace.first_failing_length(StepCase(**TINY), [16, 32], cap_bytes=cap) == 32
