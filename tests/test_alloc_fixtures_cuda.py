"""CUDA recordings replayed exactly (issue 20 item 5): runs recorded on an H100 80GB HBM3 (torch 2.11.0+cu130,
transformers 5.23.0; tests/data/alloc/cuda/env.json) by validation/alloc_trace.py (`torch.cuda.memory.
_record_memory_history`, the snapshot's device trace: every alloc and free_completed in order, each with the block's
device address, and what the allocator itself reported: max_memory_reserved, max_memory_allocated,
inactive_split_bytes.all.peak, segment.all.peak, num_alloc_retries, the sizes cudaMalloc'd in order, the memory
outside the pool after the run; for a run that died, the failing request and the device's free memory then).

Each recording, replayed through memplan's caching-allocator model (memory/allocator.py) with its allocator setting
and the card's capacity (total_memory - outside_pool_bytes), must reproduce those figures exactly; they are the
measured truth, nothing here is memplan's own output. The replay places each cudaMalloc'd segment at the address
the device gave it (`ids_are_addresses`): which of two equal cached blocks a request takes follows their addresses.

Fixtures (tests/data/alloc/cuda/, as recorded):
* llama-small_{foreach,fused}_{none,full}-{default,expandable}: `memplan validate --allocator`'s cases
  (check/allocator.py ALLOCATOR_CASES), one fresh process per setting. These four pairs ran at once on the GPU, so
  their outside_pool_bytes counts the others' memory too; they use a few hundred MB and never come near it.
* llama3-8b (transformers sdpa, bf16 weights and AdamW states, b 1, alone on the GPU): default allocator trained
  with 0 retries (fused none s3535), 2 retries (foreach none s1609), 1 retry (fused full s13312, foreach full
  s9874) and died
  (fused full s13824, foreach full s10898); expandable segments trained (fused none s3470, foreach full s18532 with a
  retry) and died (fused none s4494, foreach full s19556).

Recorded with (GPU): PYTHONPATH=. python benchmarks/gpu_checks.py --out DIR --tar F.tgz --stages env,allocator
(the llama3-8b runs: the stages maxseq and probe). The reader below is gzip JSON (validation/alloc_trace.py's
`save` format) so that replaying needs no torch.
"""

import gzip
import json
from pathlib import Path

import pytest

from memplan.check.allocator import ALLOCATOR_CASES, AllocatorResult, replay_recording
from memplan.memory.alloc_result import format_size
from memplan.memory.allocator import replay
from memplan.memory.reserved import allocator_config

DATA = Path(__file__).parent / "data" / "alloc" / "cuda"
FILES = sorted(p.name for p in DATA.glob("*.json.gz"))
TRAINED = [f for f in FILES if "oom" not in json.loads(gzip.decompress((DATA / f).read_bytes()))["stats"]]
DIED = [f for f in FILES if f not in TRAINED]


def load(name: str) -> dict:
    """A recording as validation/alloc_trace.save wrote it: case, device, steps, events, stats, alloc_conf."""
    with gzip.open(DATA / name, "rt", encoding="utf-8") as f:
        return json.load(f)


def settings(rec: dict):
    return allocator_config("expandable" if "expandable_segments:True" in rec["alloc_conf"] else "default")


def capacity(rec: dict) -> int:
    """What the allocator may hold: the card's memory less what lives outside PyTorch's pool (measured after the run:
    CUDA context, cuBLAS / cuDNN handles and kernels)."""
    return rec["stats"]["total_memory"] - rec["stats"]["outside_pool_bytes"]


def test_the_fixtures_are_there():
    assert len(FILES) == 18 and len(DIED) == 4
    assert sum((DATA / f).stat().st_size for f in FILES) < 650_000  # keep the repository small


@pytest.mark.parametrize("name", TRAINED)
def test_a_run_that_trained_replays_exactly(name):
    rec = load(name)
    stats = rec["stats"]
    result = replay_recording(rec["events"], stats, settings(rec), "cuda")  # `memplan validate --allocator`'s replay
    assert result.fits
    assert result.reserved_peak_bytes == stats["max_memory_reserved"]
    assert result.allocated_peak_bytes == stats["max_memory_allocated"]
    assert result.inactive_split_peak_bytes == stats["inactive_split_peak_bytes"]
    assert result.segments_peak == stats["segments_peak"]  # 0 with expandable segments: PyTorch counts none
    assert list(result.segment_allocs) == stats["segment_allocs"]  # every cudaMalloc, in order
    assert result.num_alloc_retries == stats["num_alloc_retries"]


def _message(oom) -> str:
    """The part of PyTorch's out-of-memory message that says what the allocator held (as the replay's `oom.message`)."""
    return (f"{format_size(oom.allocated_bytes)} is allocated by PyTorch, and "
            f"{format_size(oom.reserved_unallocated_bytes)} is reserved by PyTorch but unallocated")


def _with_request(rec: dict, cut: int) -> list:
    return rec["events"][:cut] + [("alloc", 0, rec["stats"]["oom_request_bytes"], 0)]  # the request got no address


def _cut(rec: dict) -> int:
    """How many events came before the failing request. A recording made since says (stats["oom_event_index"]: the
    events before the trace's "oom" entry); these fixtures were recorded before and do not. The request comes after
    the run's last allocation and before the frees of the run unwinding from the out-of-memory; in each of them the
    last allocation is followed by frees of a ~40-160 KB buffer and a 4-byte scalar, made just before it, which may
    have come before the request. The cut is the first after the last allocation whose replay says what PyTorch's
    message says about the bytes allocated at the request (to 0.01 MiB below 1 GiB, 0.01 GiB above): with
    expandable segments it takes the buffer's free (the reserved-but-unallocated 323.73 MiB of s4494 is the
    replay's only with it), with the default allocator none (the 0.01 GiB resolution cannot tell)."""
    stats = rec["stats"]
    if "oom_event_index" in stats:
        return stats["oom_event_index"]
    last = max(i for i, e in enumerate(rec["events"]) if e[0] == "alloc")
    for cut in range(last + 1, last + 4):
        oom = replay(_with_request(rec, cut), capacity(rec), settings(rec), ids_are_addresses=True).oom
        if oom is not None and _message(oom) in stats["oom"]:
            return cut
    raise AssertionError("no cut after the last allocation replays to PyTorch's message")


@pytest.mark.parametrize("name", DIED)
def test_a_run_that_died_dies_at_its_request(name):
    rec = load(name)
    stats = rec["stats"]
    cut = _cut(rec)
    result = replay(_with_request(rec, cut), capacity(rec), settings(rec), ids_are_addresses=True)
    oom = result.oom
    assert oom is not None and oom.event_index == cut
    assert result.num_alloc_retries == stats["num_alloc_retries"]  # the failing request's own retry counts
    assert result.reserved_peak_bytes == stats["max_memory_reserved"]
    assert list(result.segment_allocs) == stats["segment_allocs"]
    # after releasing every cached whole segment, what the device had free is the capacity less what PyTorch held
    assert oom.reserved_bytes + stats["oom_device_free_bytes"] == capacity(rec)
    assert f"Tried to allocate {format_size(oom.tried_to_allocate_bytes)}" in stats["oom"]
    assert _message(oom) in stats["oom"]
    # without the request it does not die: the events before it, and the whole recording (the unwinding's frees)
    assert replay(rec["events"][:cut], capacity(rec), settings(rec), ids_are_addresses=True).fits
    assert replay(rec["events"], capacity(rec), settings(rec), ids_are_addresses=True).fits


@pytest.mark.parametrize("case", ALLOCATOR_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("allocator", ["default", "expandable"])
def test_the_validate_checks_pass_on_the_h100_recordings(case, allocator):
    # `memplan validate --allocator --device cuda`'s checks of the replay against the allocator's own figures (the
    # recording of this very case and setting, made by that command on the H100); on the first run, before the
    # device's addresses and PyTorch's segment count, "replay = peak segments" failed for the four expandable ones
    rec = load(f"{case.name.replace(' ', '_')}-{allocator}.json.gz")
    replayed = replay_recording(rec["events"], rec["stats"], settings(rec), "cuda")
    result = AllocatorResult(case, allocator, "cuda", len(rec["events"]), replayed.requested_peak_bytes, replayed,
                             0, replayed, rec["stats"])
    against_pytorch = {k: v for k, v in result.checks.items() if k.startswith("replay = ")}
    assert len(against_pytorch) == 4 and all(against_pytorch.values()), against_pytorch


def test_equal_blocks_follow_where_the_driver_puts_segments(monkeypatch):
    # which of two equal cached blocks a request takes follows their addresses. With the device's (above) every
    # figure is exact; with the model's own placement, each new large-pool segment below the earlier ones as the
    # driver did (216 of 227 segment addresses fell in one of these runs), the no-retry run is exact too
    rec = load("llama3-8b_fused_none-default-s3535.json.gz")
    stats = rec["stats"]
    own = replay(rec["events"], capacity(rec), settings(rec))
    assert list(own.segment_allocs) == stats["segment_allocs"]
    assert (own.reserved_peak_bytes, own.allocated_peak_bytes, own.inactive_split_peak_bytes) == (
        stats["max_memory_reserved"], stats["max_memory_allocated"], stats["inactive_split_peak_bytes"])
    # placed upwards (memplan before these recordings), from event 385 on a request takes the other of two equal
    # blocks and the inactive split peak comes out otherwise; foreach AdamW's run that died at 10,898 tokens (5.21
    # GiB asked for with 15.14 GiB free in split segments) replays as one that completes
    from memplan.memory import allocator

    def upwards(self, nbytes):
        self._low += -(-nbytes // (2 << 20)) * (2 << 20)  # segments aligned to 2 MiB, each above the last
        return self._low

    monkeypatch.setattr(allocator.CachingAllocatorModel, "new_address", upwards)
    assert replay(rec["events"], capacity(rec), settings(rec)).inactive_split_peak_bytes != \
        stats["inactive_split_peak_bytes"]
    died = load("llama3-8b_foreach_full-default-s10898.json.gz")
    assert replay(_with_request(died, _cut(died)), capacity(died), settings(died)).fits
