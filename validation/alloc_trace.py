"""The allocation stream of a real run, recorded (issue 20 item 5): the ordinary loop a script runs (build the
model on the device, create the optimizer, step 1 where AdamW creates its states, step 2, ...) with every
allocation and free in order, for memplan's caching-allocator model to replay.

* ``record_run(case, steps)``: one run of a ``validation.step.StepCase`` from the model's construction on.
  - CPU (``backend="live"``): an ``EventTracker`` (the live tracker of validation/instruments.py, keeping the order)
    sees each new storage an op outputs and each storage's free; temporaries an op makes and frees inside
    itself are not seen (CPU kernels; on CUDA the allocator sees them).
  - CUDA (``backend="cuda"``): ``torch.cuda.memory._record_memory_history()`` records every allocator call;
    ``snapshot_events`` reads the alloc / free events of ``torch.cuda.memory._snapshot()``'s device trace, and the
    run's own statistics are kept beside them (``max_memory_reserved``, the peak inactive split bytes,
    ``num_alloc_retries``, the peak segment count).
* ``first_failing_length(case, lengths)``: the shortest length whose run dies, each in a fresh process (an
  allocator's history must not leak between lengths); on CPU a cap on the tracked live bytes
  (``MEMPLAN_ALLOC_CAP_BYTES``) plays the card's capacity so the scan is testable without a GPU.
* ``save`` / ``load``: a recording as gzip-compressed JSON (the fixtures CI replays).

Nothing here predicts: every event and figure is read off the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import gzip
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import torch

from .instruments import LiveTracker
from .step import StepCase, _build, _Loop, _mode

CAP_ENV = "MEMPLAN_ALLOC_CAP_BYTES"  # CPU: live bytes above this end the run as an out-of-memory would
OOM_EXIT = 3  # a run's exit status when it dies of an out-of-memory
HISTORY_ENTRIES = 2_000_000  # torch.cuda.memory._record_memory_history's ring buffer (events kept)
# the trace actions of torch.cuda.memory._snapshot() that are allocator calls on a tensor's behalf
# (c10/cuda/CUDACachingAllocator.h TraceEntry::Action: ALLOC, FREE_REQUESTED, FREE_COMPLETED, SEGMENT_ALLOC, ...);
# a block is reusable from FREE_COMPLETED (after the streams that used it are done), which is what a replay frees
ALLOC_ACTION, FREE_ACTION = "alloc", "free_completed"


class OutOfMemory(Exception):
    """A run in a fresh process (``record_fresh``) died of an out-of-memory."""


class CapExceeded(MemoryError):
    """The CPU stand-in for torch.OutOfMemoryError: the tracked live bytes went over the cap."""


class EventTracker(LiveTracker):
    """``LiveTracker`` keeping the order: each storage an op creates (or, made outside the dispatcher, first uses) is an
    ("alloc", id, bytes, 0) event, each free of one a ("free", id, 0, 0) event (ids count up; the storage address is
    reused)."""

    def __init__(self, cap_bytes: Optional[int] = None) -> None:
        super().__init__()
        self.events: list[tuple[str, int, int, int]] = []
        self.ids: dict[int, int] = {}
        self.cap_bytes = cap_bytes

    def _free(self, cdata: int, _ref) -> None:
        with self.lock:
            if cdata in self.ids:
                self.events.append(("free", self.ids.pop(cdata), 0, 0))
        super()._free(cdata, _ref)

    def _see_input(self, t: torch.Tensor) -> None:
        """A storage first seen as an input was made outside the dispatcher (``torch.tensor(0.0)``: foreach AdamW's
        step counts): the recording starts before the run, so it is the run's, allocated by its first use."""
        st = t.untyped_storage()
        if st._cdata not in self.sizes and st.nbytes():
            self._see_output(t)

    def _see_output(self, t: torch.Tensor) -> None:
        cdata = t.untyped_storage()._cdata
        old = self.sizes.get(cdata)
        super()._see_output(t)
        new = self.sizes.get(cdata)
        if new is None or new == old:
            return
        with self.lock:
            if old is not None:  # resized in place (out= ops): the old block freed, a new one allocated
                self.events.append(("free", self.ids.pop(cdata), 0, 0))
            self.ids[cdata] = len(self.events)
            self.events.append(("alloc", self.ids[cdata], new, 0))
        if self.cap_bytes is not None and self.live > self.cap_bytes:
            raise CapExceeded(f"{self.live} live bytes over the cap of {self.cap_bytes}")


@dataclass
class Recording:
    """One recorded run: its events in order and, on CUDA, what the allocator itself reported."""

    case: dict
    device: str
    steps: int
    events: list = field(default_factory=list)  # (op, id, size, stream)
    stats: dict = field(default_factory=dict)  # cuda: max_memory_reserved, ... (empty on CPU)
    torch_version: str = torch.__version__
    alloc_conf: str = ""

    @property
    def live_peak_bytes(self) -> int:
        """The most bytes live at once in the events (the sizes as recorded)."""
        live = peak = 0
        sizes: dict = {}
        for op, tid, size, _ in self.events:
            if op == "alloc":
                sizes[tid] = size
                live += size
                peak = max(peak, live)
            else:
                live -= sizes.pop(tid, 0)
        return peak


def snapshot_events(snapshot: dict, device: int = 0) -> list[tuple[str, int, int, int]]:
    """The alloc / free events of a ``torch.cuda.memory._snapshot()`` device trace, in order: each entry's
    ``action``, ``addr`` (the block's address: its id while it lives), ``size`` and ``stream``."""
    events = []
    for entry in snapshot["device_traces"][device]:
        if entry["action"] == ALLOC_ACTION:
            events.append(("alloc", entry["addr"], entry["size"], entry.get("stream", 0)))
        elif entry["action"] == FREE_ACTION:
            events.append(("free", entry["addr"], 0, entry.get("stream", 0)))
    return events


def events_before_oom(snapshot: dict, device: int = 0) -> Optional[int]:
    """How many of ``snapshot_events`` came before the device trace's first "oom" entry (the request that failed),
    None when there is none: the events after it are the frees of the run unwinding from the out-of-memory."""
    trace = snapshot["device_traces"][device]
    at = next((i for i, entry in enumerate(trace) if entry["action"] == "oom"), None)
    return None if at is None else len(snapshot_events({"device_traces": {device: trace[:at]}}, device))


def _run(case: StepCase, steps: int) -> None:
    model, layers, forward = _build(case)
    loop = _Loop(case, model, forward, layers)
    for _ in range(steps):
        loop.step(None)
    del loop, model, layers, forward


def record_run(case: StepCase, steps: int = 2, cap_bytes: Optional[int] = None) -> Recording:
    """Run ``case`` ``steps`` times from its construction on and record every allocation and free (module
    docstring). CPU: ``CapExceeded`` when the live bytes pass ``cap_bytes``; CUDA: torch.OutOfMemoryError."""
    case.check()
    rec = Recording(dataclasses.asdict(case), "cuda" if case.backend == "cuda" else "cpu", steps,
                    alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    gc.collect()
    if case.backend == "cuda":
        # the alloc / free trace without stack traces (context None): symbolising millions of C++ frames would take
        # minutes at llama3-8b's sizes, and nothing here reads them
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                                 max_entries=HISTORY_ENTRIES)
        oom = None
        try:
            with _mode(case):
                _run(case, steps)
        except torch.OutOfMemoryError as e:  # the events up to the failing request are kept (stats["oom"])
            oom = str(e).splitlines()[0][:300]
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        stats = torch.cuda.memory_stats()
        free, total = torch.cuda.mem_get_info()
        rec.events = snapshot_events(snapshot)
        rec.stats = {"max_memory_reserved": torch.cuda.max_memory_reserved(),
                     "max_memory_allocated": torch.cuda.max_memory_allocated(),
                     "inactive_split_peak_bytes": stats.get("inactive_split_bytes.all.peak", 0),
                     "num_alloc_retries": stats.get("num_alloc_retries", 0),
                     "segments_peak": stats.get("segment.all.peak", 0),
                     # the cudaMalloc'd segments in order (the replay's segments are checked against them)
                     "segment_allocs": [e["size"] for e in snapshot["device_traces"][0]
                                        if e["action"] == "segment_alloc"],
                     "segment_frees": sum(e["action"] == "segment_free" for e in snapshot["device_traces"][0]),
                     # what the device holds outside PyTorch's pool after the run (CUDA context, cuBLAS, ...)
                     "outside_pool_bytes": total - free - torch.cuda.memory_reserved(), "total_memory": total}
        if oom is not None:  # the trace's own "oom" entry: the request that failed and what the device had free
            entry = next((e for e in snapshot["device_traces"][0] if e["action"] == "oom"), {})
            rec.stats.update(oom=oom, oom_request_bytes=entry.get("size"),
                             oom_device_free_bytes=entry.get("device_free"),
                             oom_event_index=events_before_oom(snapshot))  # the events before the failing request
        return rec
    if case.backend != "live":
        raise ValueError("record_run runs the live (CPU) or cuda backend")
    tracker = EventTracker(cap_bytes)
    with tracker:
        _run(case, steps)
    gc.collect()
    rec.events = tracker.events
    return rec


def save(rec: Recording, path: str | Path) -> None:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump(dataclasses.asdict(rec), f, separators=(",", ":"))


def load(path: str | Path) -> Recording:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    data["events"] = [tuple(e) for e in data["events"]]
    return Recording(**data)


def record_fresh(case: StepCase, s: Optional[int] = None, steps: int = 2, out: Optional[str | Path] = None,
                 cap_bytes: Optional[int] = None, alloc_conf: Optional[str] = None,
                 timeout_s: float = 600) -> Optional[Recording]:
    """``case`` (at length ``s`` where given) run in a fresh process (``python -m <this module> --case JSON``: an
    allocator's state and settings are the process's), with ``PYTORCH_CUDA_ALLOC_CONF=alloc_conf`` where given; the
    recording (saved to ``out``, read back) when ``out`` is given, else None; ``OutOfMemory`` when the run dies of
    an out-of-memory (CPU: ``cap_bytes`` plays the card's capacity)."""
    env = dict(os.environ)
    if alloc_conf is not None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    if cap_bytes is not None:
        env[CAP_ENV] = str(cap_bytes)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    args = [sys.executable, "-m", __name__, "--case", json.dumps(dataclasses.asdict(case)), "--steps", str(steps)]
    args += ["--seq-len", str(s)] if s is not None else []
    args += ["--out", str(out)] if out is not None else []
    done = subprocess.run(args, env=env, cwd=root, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode == OOM_EXIT:
        raise OutOfMemory(f"the run at s = {s if s is not None else case.s} died of an out-of-memory")
    if done.returncode != 0:
        raise RuntimeError(f"the run at s = {s if s is not None else case.s} failed (exit {done.returncode}): "
                           f"{done.stderr.strip()[-2000:]}")
    return load(out) if out is not None else None


def first_failing_length(case: StepCase, lengths: Sequence[int], steps: int = 2, cap_bytes: Optional[int] = None,
                         alloc_conf: Optional[str] = None, timeout_s: float = 600) -> Optional[int]:
    """The first of ``lengths`` (ascending) whose run dies of an out-of-memory, each run in a fresh process
    (``record_fresh``); None when every one trains. CPU: ``cap_bytes`` plays the card's capacity."""
    for s in lengths:
        try:
            record_fresh(case, s, steps, cap_bytes=cap_bytes, alloc_conf=alloc_conf, timeout_s=timeout_s)
        except OutOfMemory:
            return s
    return None


def main(argv: Optional[list[str]] = None) -> None:
    """One run in this process (what ``first_failing_length`` starts): exit 0 when it trains, ``OOM_EXIT`` when it
    dies of an out-of-memory; ``--out FILE`` saves the recording."""
    parser = argparse.ArgumentParser(prog="python -m validation.alloc_trace")
    parser.add_argument("--case", required=True, help="a StepCase as JSON")
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    fields = json.loads(args.case)
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
    if args.seq_len is not None:
        fields["s"] = args.seq_len
    case = StepCase(**fields)
    cap = os.environ.get(CAP_ENV)
    try:
        rec = record_run(case, args.steps, int(cap) if cap else None)
    except (CapExceeded, torch.OutOfMemoryError):
        sys.exit(OOM_EXIT)
    if args.out:
        save(rec, args.out)
    if rec.stats.get("oom"):  # CUDA: recorded up to the out-of-memory
        sys.exit(OOM_EXIT)


if __name__ == "__main__":
    main()
