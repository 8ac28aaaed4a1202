"""memplan's torchtitan allocation stream against recordings of the real step (issues 20 and 24).

validation/titan_alloc.py records torchtitan 0.3.0's FSDP2 step (validation/titan_step.py: its parallelize_llama,
fused AdamW, loss, clip_grad_norm_, zero_grad; 2 gloo CPU ranks, the second step recorded, rank 0) as every storage
made and freed in order, FSDP2's resize-to-0 frees and re-allocations included, gloo's own reduce-scatter copy apart:
tests/data/alloc/titan/{tiny,mid}_{none,full,selective-op}.json.gz (tiny: h 64, a 4, g 2, f 160, 2 layers, v 256, s 32,
b 2; mid: h 512, a 8, g 4, f 1,408, 2 layers, v 8,192, s 1,024, b 1).  memplan's stream of the same plan
(``memory.reserved.allocation_stream``, --impl torchtitan --device cpu, 2 GPUs), its last step with the tensors alive
at the step's start allocated first (``check.stream_match.last_step``), is compared with each: what each layer's
forward keeps; the fp32 states at the step's start; every requested size; the order (``check.stream_match.alignment``);
and both replayed through memplan's caching-allocator model on a CUDA-like capacity (80 GB: nothing released): the
requested and reserved peaks, the segments.  Figures:

    PYTHONPATH=. python tests/test_titan_alloc.py

Re-record (about a minute a run on 2 cores; the allocations come out the same, a free of a collective's tensor
may move by an op: gloo's worker thread drops them): MEMPLAN_TITAN_SLOW=1 runs
``test_rerecorded_stream_equals_the_fixture`` (the tiny AC none run) or

    PYTHONPATH=. python -m validation.titan_alloc tests/data/alloc/titan
"""

import os
import sys
import tempfile
from collections import Counter
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

from memplan.api.estimating import estimate
from memplan.check.stream_match import alignment, kept, last_step
from memplan.memory.allocator import replay
from memplan.memory.reserved import allocation_stream, allocator_config

DATA = Path(__file__).parent / "data" / "alloc" / "titan"
ACS = ("none", "full", "selective-op")
CASES = [(n, ac) for n in ("tiny", "mid") for ac in ACS]
CAPACITY = 80 * 10**9  # a CUDA-like capacity far above these runs (under 0.4 GB): nothing is released
MiB = 1 << 20
SLOW = pytest.mark.skipif(not os.environ.get("MEMPLAN_TITAN_SLOW"), reason="set MEMPLAN_TITAN_SLOW=1 to run")


def _load(name: str, ac: str) -> dict:
    import gzip
    import json

    with gzip.open(DATA / f"{name}_{ac}.json.gz", "rt", encoding="utf-8") as f:
        rec = json.load(f)
    rec["events"] = [tuple(e) for e in rec["events"]]
    return rec


@lru_cache(maxsize=None)
def streams(name: str, ac: str) -> tuple:
    """(recorded events, their labels, memplan's last step, its names, the run) of one fixture."""
    rec = _load(name, ac)
    run = rec["run"]
    model = dict(name=f"titan-{name}", num_layers=run["layers"], hidden_size=run["h"], num_attention_heads=run["a"],
                 num_kv_heads=run["g"], ffn_hidden_size=run["f"], seq_length=run["s"], vocab_size=run["vocab"],
                 norm="rmsnorm", mlp="swiglu", position_embedding="rope", tied_embeddings=False, dropout=False,
                 bias=False, attention="flash")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.yaml"
        path.write_text(yaml.safe_dump({"model": model}))
        config = estimate(str(path), impl="torchtitan", gpus=run["world"], ac=ac, device="cpu", seq_len=run["s"],
                          micro_batch=run["b"], global_batch=run["b"] * run["world"]).config
    ours, names = last_step(allocation_stream(config, "torchtitan", "cpu"))
    return rec["events"], rec["where"], ours, names, run


def _allocs(events) -> list[int]:
    return [n for op, _, n, _ in events if op == "alloc"]


@pytest.mark.parametrize("name,ac", CASES)
def test_each_layer_forward_keeps_what_the_real_one_keeps(name, ac):
    # what a layer's forward leaves alive at the loss (autograd's saved tensors): the same sizes as the recording's,
    # layer by layer.  The recorded layer's last allocation is its output (the residual add's; the next layer's
    # input, alive at the loss in every mode: under full and selective AC kept by the next layer's checkpoint, memplan's
    # next layer's "block input"), left out on both sides
    real, where, ours, names, run = streams(name, ac)
    loss_real = next(k for k, w in enumerate(where) if w.startswith("loss/"))
    loss_ours = next(k for k, n in enumerate(names) if "micro-batch" in n and ("loss" in n or "final norm" in n))
    for j in range(run["layers"]):
        theirs = kept(real[:loss_real], where[:loss_real], lambda w: w.startswith(f"forward/{j}/"))
        mine = kept(ours[:loss_ours], names[:loss_ours], lambda n: f"layer {j + 1}," in n and "block input" not in n)
        output = 2 * run["h"] * run["s"] * run["b"]  # bf16
        made = [n for (op, _, n, _), w in zip(real, where) if op == "alloc" and w.startswith(f"forward/{j}/")]
        assert made[-1] == output and theirs[-1] == output
        assert sorted(mine) == sorted(theirs[:-1]), (name, ac, j)
        assert len(mine) == {"none": 18, "full": 0, "selective-op": 5}[ac]


@pytest.mark.parametrize("name,ac", CASES)
def test_every_size_memplan_requests_is_a_recorded_size(name, ac):
    # the sizes decide the allocator's pools and blocks: every request of memplan's step is a size the real step
    # requests.  Before the fixes the stream requested flat shards (238,208 B tiny, 28,578,816 B mid), reduce-scatter
    # inputs without their norms (172,032 B tiny), the layer's weight gradients as lumps at each moment (w1, w2, w3:
    # 3 x 160 x 64 x 2 = 61,440 B; with wo + 64 x 64 x 2 = 69,632 B; the matrices + 64 x 128 x 2 = 86,016 B tiny),
    # w1 and w3 as one tensor (2 x 160 x 64 x 4 / 2 = 40,960 B, fp32 shards tiny): sizes no real request has
    real, _, ours, names, run = streams(name, ac)
    recorded = set(_allocs(real))
    assert {n for n in _allocs(ours) if n not in recorded} == set()


@pytest.mark.parametrize("name,ac", CASES)
def test_fsdp2s_unsharded_storages_are_made_as_the_real_ones(name, ac):
    # FSDP2's alloc_storage (each parameter's unsharded bf16 storage resized back before its copy-out) in the step, in
    # order, against memplan's per-parameter unsharded allocations: event for event, the embedding for its forward,
    # each layer (wqkv, wo, w1, w2, w3, the norms), the final norm + LM head at the loss, the layers again in the
    # backward, the embedding for its backward (32 in all); and as many free_storage reshards
    real, where, ours, names, run = streams(name, ac)
    resized = [n for (op, _, n, _), w in zip(real, where) if op == "alloc" and w.endswith("/fsdp.alloc_storage")]
    storages = {i: n for (op, i, n, _), nm in zip(ours, names) if op == "alloc"
                and nm.startswith("unsharded parameters:") and "flat all-gather" not in nm}
    assert resized == list(storages.values()) and len(resized) == 2 * (2 * 7 + 1) + 2
    assert sum(w.endswith("/fsdp.free_storage") for w in where) == len(resized)
    assert sum(op == "free" and i in storages for op, i, _, _ in ours) == len(resized)


@pytest.mark.parametrize("name,ac", CASES)
def test_the_states_at_the_step_start_are_the_recorded_tensors(name, ac):
    # FSDP2's fp32 states alive at the step's start, as the real step holds them: each parameter's shard, AdamW's
    # exp_avg and exp_avg_sq per parameter, the gradients one tensor per unit (4: the embedding, 2 layers, the final
    # norm + LM head).  Differences, by hand: fused AdamW's 17 fp32 step counters (4 B each, not in memplan); the 2
    # layers' RoPE caches (2 x 4 s d B = 2 x 2,048 B tiny, 2 x 262,144 B mid) as memplan's one "other parameters and
    # weight caches"
    real, where, ours, names, run = streams(name, ac)
    theirs = Counter(n for (op, _, n, _), w in zip(real, where) if w.startswith("start/"))
    first = next(k for k, n in enumerate(names) if "micro-batch" in n or "all-gather" in n or "unsharded" in n)
    mine = Counter(n for _, _, n, _ in ours[:first])
    rope = 4 * run["s"] * run["h"] // run["a"]
    assert mine - theirs == Counter({2 * rope: 1})
    assert theirs - mine == Counter({4: 17, rope: 2})
    assert sum(theirs.elements()) - sum(mine.elements()) == 17 * 4


# the replays (the default allocator, 80 GB): memplan's reserved peak against the recording's, measured (the table):
# tiny: both 2 MiB, one small-pool segment; mid: -5.3 % (none), -0.7 % (full), -6.0 % (selective-op), at the reserved
# peak 26 / 28, 22 / 23, 23 / 25 segments.  The stream as it was (flat states, two blocks per FSDP2 unit, the weight
# gradients as lumps made at each moment): -5.9 %, -7.2 %, -6.7 %; the fixes one by one, in the commits' order (states
# per tensor; reduce-scatter inputs flat; the computing unit's storages; the weight gradients per parameter; the
# embedding's forward gather and the flat output kept to the next gather): none -12.9, -12.9, -6.5, -6.5, -5.3 %; full
# -8.7, -8.7, -8.0, -8.0, -0.7 %; selective-op -8.1, -8.1, -7.4, -7.4, -6.0 %; w1 and w3 as two
# tensors moved none.  What is left is the order of what the
# stream does not make (RMSNorm's fp32 temporaries, 2 MiB at mid, made and freed op by op; a moment's tensors made one
# by one): large-pool blocks that split the 20 MiB segments differently (at mid without AC the real step's bf16 logits,
# 16 MiB, find no free block and take a segment of their own, memplan's fit in the embedding's freed one)
RESERVED_GAP = {("tiny", ac): 0.0 for ac in ACS} | {("mid", "none"): 0.06, ("mid", "full"): 0.01,
                                                    ("mid", "selective-op"): 0.065}


@pytest.mark.parametrize("name,ac", CASES)
def test_the_replays(name, ac):
    f = figures(name, ac)
    (rq, rr, rs), (oq, orr, os_) = f["recorded"], f["memplan"]
    # the requested peak: the recording's 84 B over memplan's at tiny (test_titan_step.py: the token count, the loss
    # and its seed gradient, 16 B, and fused AdamW's 17 step counters), 100 B at mid
    assert 0 < rq - oq <= 100
    assert rr * (1 - RESERVED_GAP[name, ac]) <= orr <= rr and os_ <= rs
    # in order: the allocations of memplan's step that align with the recording's (difflib's matching blocks of the
    # two size sequences; the recording has about twice as many: the CPU kernels' temporaries, the scalars), measured
    # 69-89 % of memplan's (tiny 195, 182, 177 and mid 179, 160, 156 of 219 / 223 / 227), 44-72 % before the fixes
    # (80, 55, 72 and 82, 91, 68 of 126 / 130).  With attention_norm's backward moment and the re-run layer's w2
    # moment (tests/test_titan_tp_moments.py) memplan issues 16 allocations more (tiny 185, 169, 164 and mid 183,
    # 159, 156 of 207 / 211 before them): the matched counts rose at tiny and stayed within 4 at mid
    matched, mine, _ = f["matched"]
    assert matched >= 0.65 * (matched + sum(mine.values()))


@SLOW
def test_rerecorded_stream_equals_the_fixture():
    from validation.titan_alloc import RUNS, record

    rec = record(*RUNS["tiny"], "none")
    fixture = _load("tiny", "none")
    # the allocations in order; the frees of the same tensors (when gloo's worker thread drops a finished
    # collective's tensors varies: recorded twice, tiny full's tail all-gather output was freed one op apart)
    allocs = [(tuple(e), w) for e, w in zip(rec["events"], rec["where"]) if e[0] == "alloc"]
    assert allocs == [(e, w) for e, w in zip(fixture["events"], fixture["where"]) if e[0] == "alloc"]
    assert sorted(e[1] for e in rec["events"] if e[0] == "free") == sorted(e[1] for e in fixture["events"]
                                                                            if e[0] == "free")


def figures(name: str, ac: str) -> dict:
    real, _, ours, _, _ = streams(name, ac)
    out = {}
    for who, events in (("recorded", real), ("memplan", ours)):
        r = replay(events, CAPACITY, allocator_config("default"))
        out[who] = (r.requested_peak_bytes, r.reserved_peak_bytes, r.segments_at_reserved_peak)
    out["matched"] = alignment(_allocs(ours), _allocs(real))
    return out


def _table() -> None:
    for name, ac in CASES:
        f = figures(name, ac)
        (rq, rr, rs), (oq, orr, os_) = f["recorded"], f["memplan"]
        matched, mine, theirs = f["matched"]
        print(f"{name:4s} {ac:12s} recorded: requested {rq:>12,} B reserved {rr:>12,} B {rs:3d} segments | memplan: "
              f"requested {oq:>12,} B reserved {orr:>12,} B {os_:3d} segments ({(orr - rr) / rr:+.1%}) | "
              f"{matched} allocations aligned of {sum(mine.values()) + matched} / {sum(theirs.values()) + matched}")
        big = lambda c: sorted((n, k) for n, k in c.items() if n > MiB)  # noqa: E731
        print(f"     large only memplan's: {big(mine)}\n     large only recorded: {big(theirs)}")


if __name__ == "__main__":
    _table()
    sys.exit(0)
