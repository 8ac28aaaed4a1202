"""memplan's allocation stream against runs recorded on an H100 (issue 20 item 5): `python benchmarks/gpu_checks.py`
ran transformers' Llama (sdpa, bf16 weights and AdamW states, build + optimizer + two steps, one fresh process per run
and allocator setting) under torch.cuda.memory._record_memory_history (torch 2.11.0+cu130, an H100 80GB HBM3,
transformers 5.23.0); tests/data/alloc/cuda holds the traces (validation/alloc_trace.py's format, with the run's own
max_memory_reserved, segments and what lived outside the pool).

What holds, measured: memplan's stream of the same run peaks at the recorded live peak within 0.01 % (the small runs
+3.9 KB of 115-126 MB, 0.0034 %; llama3-8b -2 KB to +150 KB of 76-82 GB, once the stream makes cuBLAS's two workspaces), and its
replay through memplan's allocator model reserves within 2 % of what the run reserved (max_memory_reserved: small runs
-2 MiB with the default allocator, exact with expandable segments; llama3-8b -0.73 % to +1.19 %), the capacity being the
card's less what lived outside PyTorch's pool in that run. What does not (docs/how-it-works.md): on CUDA a checkpointed
layer's re-run and backward make more tensors than the stream has, and where that decides an out-of-memory (foreach
AdamW with checkpointing at 10,898 tokens) memplan's replay completes where the run died. Without the stream's second
cuBLAS workspace (32 MiB) the small runs' peaks are 29 % short: the peak check fails.

With llama3-8b's traced inventory (configs/traced/llama3-8b/hf-sdpa-cuda.yaml: the step's order traced from
transformers' code, memplan/memory/stream_traced.py) memplan's stream replays to each trained run's
max_memory_reserved to the byte but one (2 MiB short: one expandable-segment page), and its verdict is the H100's at
all 24 recorded lengths (`PYTHONPATH=. python benchmarks/layer_replay.py tests/data/alloc/cuda/*.json.gz`, and
`--verdicts tests/data/alloc/cuda/h100_runs.json`).
"""

import dataclasses
import json
import re
from pathlib import Path

import pytest

from memplan.check.allocator import ALLOCATOR_CASES, MAX_SEQ_CASES, case_config
from memplan.check.peak import card_preset, peak_config
from memplan.memory.reserved import Replay, allocation_stream, allocator_config, replay_stream
from memplan.plan.estimate import device_bytes

pytest.importorskip("torch")

from validation.alloc_trace import load  # noqa: E402

DATA = Path(__file__).parent / "data" / "alloc" / "cuda"
H100 = card_preset("NVIDIA H100 80GB HBM3")
PEAK_TOLERANCE = 1e-4  # 0.01 %
RESERVED_TOLERANCE = 0.02
NAME = re.compile(r"(llama-small|llama3-8b)_(foreach|fused)_(none|full)-(default|expandable)(?:-s(\d+))?\.json\.gz")


def _case(path: Path):
    small, opt, rec, allocator, s = NAME.fullmatch(path.name).groups()
    cases = ALLOCATOR_CASES if small == "llama-small" else MAX_SEQ_CASES
    case = next(c for c in cases if c.optimizer == opt and c.recompute == rec)
    return (case if s is None else dataclasses.replace(case, s=int(s))), allocator


# the runs that trained (those that died: tests/test_alloc_fixtures_cuda.py), but fused AdamW's at 13,312 tokens,
# which trained after a retry and which memplan's replay, on the capacity the run had after its step, calls a death
# (the safe side: test_memplans_verdict_is_the_h100s_at_every_recorded_length)
TRAINED = [p for p in sorted(DATA.glob("*.json.gz")) if not load(p).stats.get("oom") and "fused_full-default-s13312"
           not in p.name]


@pytest.mark.parametrize("path", TRAINED, ids=lambda p: p.name.split(".")[0])
def test_memplans_stream_is_the_recorded_run(path):
    case, allocator = _case(path)
    rec = load(path)
    assert rec.device == "cuda" and not rec.stats.get("oom")
    ours = allocation_stream(peak_config(case), case.impl, "cuda", workspace_bytes=H100.workspace_bytes)
    # the small runs shared the GPU with each other (their outside_pool_bytes is the device's, not theirs) and never
    # came near it: no capacity; llama3-8b ran alone at the card's edge: its capacity is what its run could have
    capacity = (1 << 40) if case in ALLOCATOR_CASES else rec.stats["total_memory"] - rec.stats["outside_pool_bytes"]
    result = replay_stream(ours, capacity, allocator_config(allocator))
    assert result.fits
    assert abs(result.requested_peak_bytes - rec.live_peak_bytes) <= PEAK_TOLERANCE * rec.live_peak_bytes
    measured = rec.stats["max_memory_reserved"]
    assert abs(result.reserved_peak_bytes - measured) <= RESERVED_TOLERANCE * measured



RUNS = json.loads((DATA / "h100_runs.json").read_text(encoding="utf-8"))["runs"]
# the one recorded length where memplan's verdict and the H100's differ, on the safe side: the run trained after one
# retry, its memory outside PyTorch's pool still below the 0.80 GB the preset counts (kernels load on first use)
SAFE_SIDE = {("llama3-8b fused full", "default", 13312)}


def test_memplans_verdict_is_the_h100s_at_every_recorded_length():
    # tests/data/alloc/cuda/h100_runs.json: 24 runs of llama3-8b on the H100 (8 plans, the lengths memplan's
    # --max-seq answered then and one 1,024-token step around them); memplan's verdict on the H100 preset for each,
    # from its stream derived from the step timeline (the hand-written inventory); never "fits" where a run died
    assert _verdicts(traced=False) == {x + (False,) for x in SAFE_SIDE}


def _verdicts(traced: bool) -> set:
    """The recorded lengths (h100_runs.json) where memplan's verdict on the H100 preset (what `estimate` decides fit
    on, without its report: `device_bytes`; the replay alone decides, no flat margin) is not the H100's; `traced`:
    llama3-8b's traced inventory (`case_config`), else the hand-written one."""
    wrong = set()
    for run in RUNS:
        case = dataclasses.replace(next(c for c in MAX_SEQ_CASES if c.name == run["case"]), s=run["seq_len"])
        config = case_config(case) if traced else peak_config(case)
        fits = device_bytes(config, case.impl, "cuda", H100, None, H100.process_memory_bytes,
                            Replay(run["allocator"])) <= H100.process_memory_bytes
        if fits != (run["run"] == "trains"):
            wrong.add((run["case"], run["allocator"], run["seq_len"], fits))
    return wrong


def test_the_traced_streams_verdict_is_the_h100s_at_every_recorded_length():
    # the same 24 runs, memplan's stream made from llama3-8b's traced step (every allocation and free of
    # transformers' code in order, cuBLAS's workspaces where the recordings have them): 24 of 24
    assert _verdicts(traced=True) == set()


LLAMA3_8B_TRAINED = [p for p in sorted(DATA.glob("llama3-8b_*.json.gz")) if not load(p).stats.get("oom")]


def test_the_traced_stream_replays_to_the_recorded_reserved_peak():
    # every llama3-8b run that trained (6, fused AdamW's retried 13,312 tokens among them) replayed from memplan's
    # traced stream on the capacity the run had: max_memory_reserved to the byte, but fused / none / expandable at
    # 3,470 tokens, 2 MiB short (one 2 MiB page of an expandable segment; which allocation the trace lacks: not
    # identified); memplan's derived stream: -1,808 MB to +973 MB of them
    short = {}
    for path in LLAMA3_8B_TRAINED:
        case, allocator = _case(path)
        rec = load(path)
        stream = allocation_stream(case_config(case), case.impl, "cuda", workspace_bytes=H100.workspace_bytes)
        assert any(getattr(e, "name", "").startswith("traced (") for e in stream.events)
        result = replay_stream(stream, rec.stats["total_memory"] - rec.stats["outside_pool_bytes"],
                               allocator_config(allocator))
        assert result.fits
        assert abs(result.requested_peak_bytes - rec.live_peak_bytes) <= PEAK_TOLERANCE * rec.live_peak_bytes
        short[path.name.split(".")[0]] = rec.stats["max_memory_reserved"] - result.reserved_peak_bytes
    assert len(short) == 6 and short.pop("llama3-8b_fused_none-expandable-s3470") == 2 << 20
    assert set(short.values()) == {0}
