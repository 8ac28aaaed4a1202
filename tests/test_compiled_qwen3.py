"""torch.compile on torchtitan's dense Qwen3 block (`--compile` on a dense Qwen3, memplan/inventory/compiled_qwen3.py)
against the compiled block on CPU.

The expected values are measurements of torchtitan 0.3.0's dense Qwen3 block (``_build_qwen3_layers``, bf16, sdpa
for FlexAttention, q_norm / k_norm, CosSinRoPE) compiled by torch 2.13's inductor on CPU as torchtitan's apply_compile
compiles it (validation/compiled.py ``trace_compiled_layer(qwen3=True)``: h 40, a 6, g 2, head 8 so q 48, f 154;
dynamic s, b traced at s 24, b 3; the block called with the dataloader's positions, as torchtitan's Trainer calls it):

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m validation.compiled_qwen3 AC S B

(AC none, selective-op, full; S B 20 2 and 32 4; ~30 s of CPU each) prints the forward graph's saved tensors
(RECORDED below, parameters and the positions left out) and the bytes alive after the forward (MEASURED: output
included, s b h bf16; the window makes the block's input, so a kept input counts; under full FullAC's CPU generator
state, 5,056 B, torch.get_rng_state, not modelled: CPU's).  The suite checks memplan's table against those
recordings and a hand derivation; MEMPLAN_COMPILE_SLOW=1 compiles the block again and checks the recordings.
"""

import json
import os
from collections import Counter
from pathlib import Path

import pytest

from memplan.core.symbolic import Poly
from memplan.core.training import Recompute, TrainingSpec
from memplan.inventory import compiled_qwen3
from memplan.inventory.assemble import training_inventory
from memplan.inventory.titan import is_qwen3_dense
from memplan.presets.catalog import load_model
from tests.test_compiled_moments import _coefficients, _front, memplan_moments

H, A, G, D, F = 40, 6, 2, 8, 154
SHAPES = ((20, 2), (32, 4))
RNG_STATE = 5056  # torch.get_rng_state()'s bytes (FullAC on CPU)
REC = {"none": Recompute.NONE, "selective-op": Recompute.SELECTIVE, "full": Recompute.FULL}
# bytes alive after the compiled block's forward, measured (the command above), per (ac, s, b): output included
MEASURED = {("none", 20, 2): 73440, ("none", 32, 4): 235008,
            ("selective-op", 20, 2): 29920, ("selective-op", 32, 4): 95744,
            ("full", 20, 2): 11456, ("full", 32, 4): 25536}
# hand derivation, bytes per token (bf16 2 B, fp32 4 B; q = a d = 48, g d = 16):
# none: block input 2h 80, attention_norm rstd 4, its output 2h 80, q_norm's input 2q 96, k_norm's input 2 g d 32,
#   q_norm rstd 4a 24, k_norm rstd 4g 8, cos and sin rows gathered at the positions 2 x 4d 64, rotated q 96, k 32,
#   v 32, log-sum-exp 4a 24, attention output 96, wo's output 80, ffn_norm rstd 4, its output 80, w1 / w3 outputs and
#   their product 3 x 2f 924: 1,756 B;
# selective-op: block input 80, the fused QKV's output 2 (q + 2 g d) 160, log-sum-exp 24, attention output 96, w1's
#   output 308: 668 B;  full: the block input 80 B
HAND = {"none": 1756, "selective-op": 668, "full": 80}
# the traced saved tensors (elements, dtype) of the command's runs, parameters and the positions (int64 s b, a batch
# input the training loop holds: selective-op and full save it) left out; "5056" the CPU generator state
RECORDED = {
    "none": [("s b h", "bfloat16"), ("s b", "float32"), ("s b h", "bfloat16"), ("s b q", "bfloat16"),
             ("s b g q /a", "bfloat16"), ("s b a", "float32"), ("s b g", "float32"), ("2 s b q /a", "float32"),
             ("s b q", "bfloat16"), ("s b g q /a", "bfloat16"), ("s b g q /a", "bfloat16"), ("s b a", "float32"),
             ("s b q", "bfloat16"), ("s b h", "bfloat16"), ("s b", "float32"), ("s b h", "bfloat16"),
             ("s b f", "bfloat16"), ("s b f", "bfloat16"), ("s b f", "bfloat16")],
    "selective-op": [("s b h", "bfloat16"), ("s b q + 2 s b g q /a", "bfloat16"), ("s b q", "bfloat16"),
                     ("s b a", "float32"), ("s b f", "bfloat16")],
    "full": [("s b h", "bfloat16"), ("5056", "uint8")],
}
DTYPES = {"act": "bfloat16", "fp32": "float32"}
SLOW = pytest.mark.skipif(not os.environ.get("MEMPLAN_COMPILE_SLOW"), reason="set MEMPLAN_COMPILE_SLOW=1 to run")


def _canon(elements: str) -> str:
    return " + ".join(sorted(" ".join(sorted(m.split())) for m in elements.split(" + ")))


def model(s: int = 20, **widths):
    w = dict(hidden_size=H, num_attention_heads=A, num_kv_heads=G, head_dim=D, ffn_hidden_size=F) | widths
    return load_model("qwen3-8b").model.model_copy(update=dict(seq_length=s, num_layers=1, **w))


def _layer_terms(ac: str, **widths):
    m = model(**widths)
    assert is_qwen3_dense(m)
    inv = training_inventory(m, "torchtitan", "cpu", TrainingSpec(compile=True, recompute=REC[ac]))
    return m, [t for t in inv.terms if t.scope == "layer" and t.kept(REC[ac]) and not t.needs_tp]


def _layer_bytes(ac: str, s: int, b: int) -> int:
    """memplan's compiled Qwen3 block: the bytes its layer terms keep under ``ac`` at s, b (tp 1)."""
    _, terms = _layer_terms(ac)
    values = model(s).symbols(b=b, t=1, cp=1)
    return sum(int(t.bytes(values, 2, 0)) for t in terms)


def _measured_kept(ac: str, s: int, b: int) -> int:
    return MEASURED[(ac, s, b)] - 2 * H * s * b - (RNG_STATE if ac == "full" else 0)


@pytest.mark.parametrize("ac,s,b", list(MEASURED))
def test_hand_derivation_equals_the_measurement(ac, s, b):
    assert HAND[ac] * s * b == _measured_kept(ac, s, b)


@pytest.mark.parametrize("ac,s,b", list(MEASURED))
def test_compiled_qwen3_layer_bytes_equal_the_cpu_measurement(ac, s, b):
    # fails when a row of compiled_qwen3.QWEN3_ROWS or of compiled.py's TITAN_LAYER / TITAN_SAC is taken out, or the
    # eager block's terms are left in
    assert _layer_bytes(ac, s, b) == _measured_kept(ac, s, b)


def test_terms_are_the_traced_saved_set():
    # memplan's terms, per AC mode, equal the recorded trace (elements, dtype) as a multiset (the CPU generator state
    # excepted: not modelled)
    for ac, rows in RECORDED.items():
        traced = Counter((Poly.parse_sum(el).text(), dt) for el, dt in rows if dt != "uint8")
        ours = Counter((t.elements.text(), DTYPES[t.dtype]) for t in _layer_terms(ac)[1])
        assert ours == traced, ac


def test_a_removed_qwen3_row_fails(monkeypatch):
    for i in range(len(compiled_qwen3.QWEN3_ROWS)):
        rows = compiled_qwen3.QWEN3_ROWS
        monkeypatch.setattr(compiled_qwen3, "QWEN3_ROWS", rows[:i] + rows[i + 1:])
        assert _layer_bytes("none", 20, 2) != _measured_kept("none", 20, 2)
        monkeypatch.undo()


def test_estimate_answers_compiled_qwen3_and_refuses_what_is_not_traced(run_cli):
    argv = ["estimate", "--model", "qwen3-8b", "--impl", "torchtitan", "--gpus", "8", "--compile"]
    for ac in ("none", "full", "selective-op", "selective-layer:18"):
        code, out, err = run_cli(*argv, "--ac", ac)
        assert code == 0, err
        assert "validation/compiled.py trace_compiled_layer(qwen3=True)" in " ".join(out.split())
    for extra, why in ((("--tp", "2"), "--compile with --tp on a dense Qwen3 is not traced"),
                       (("--float8", "rowwise"), "--compile --float8 on a dense Qwen3 is not traced"),
                       (("--cp", "2"), "--compile with --cp is not modelled")):
        code, out, err = run_cli(*argv, *extra)
        assert code == 2 and len(err.strip().splitlines()) == 1 and why in err, err


def test_search_compiles_qwen3_at_tp_1_only():
    from memplan.api.estimating import estimate
    from memplan.api.searching import search

    base = dict(impl="torchtitan", gpus=8, global_batch=16, gpu="h100-80gb", seq_len=4096)
    found = search("qwen3-8b", compile=True, **base).result
    assert set(found.evaluated.plans.t.tolist()) == {1} and found.top
    row = found.row(found.top[0])
    dims = row["torchtitan"]
    assert dims["compile"] and dims["tp"] == 1 and dims["cp"] == 1
    piped = dict(pp=dims["pp"], pipeline_schedule=dims["pipeline_schedule"]) if dims["pp"] > 1 else {}
    est = estimate("qwen3-8b", **base, compile=True, ac=dims["ac"], dp_replicate=dims["dp_replicate"],
                   micro_batch=dims["pipeline_microbatch_size"] or dims["local_batch"], **piped)
    assert row["memory"]["device_bytes"] == est.device_bytes


@SLOW
@pytest.mark.parametrize("ac,s,b", list(MEASURED))
def test_recorded_trace_and_measurement(ac, s, b):
    pytest.importorskip("torchtitan")
    from validation.compiled import trace_compiled_layer

    r = trace_compiled_layer("inductor", "torchtitan", ac=ac, qwen3=True, s=s, b=b)
    positions = ("s b", "int64")  # the dataloader's positions, a batch input (memplan's held positions)
    rows = [(t.elements, t.dtype) for t in r.saved
            if t.kind != "parameter" and not (t.kind == "input" and (t.elements, t.dtype) == positions)]
    assert Counter((_canon(el), dt) for el, dt in rows) == Counter((_canon(el), dt) for el, dt in RECORDED[ac])
    assert (r.s, r.b, r.after_forward) == (s, b, MEASURED[(ac, s, b)])


# -- the backward moments (memplan/inventory/compiled_qwen3.py MODES) against tests/data/titan_compiled_backward_qwen3.json,
# measured by
#     OMP_NUM_THREADS=1 PYTHONPATH=. python -m validation.compiled_backward qwen3 tests/data/titan_compiled_backward_qwen3.json
# (validation/compiled_backward.py QWEN3_SHAPES: h 40, a 6, g 2, d 8, f 154 and h 64, a 8, g 4, d 12, f 224; ~6 min of
# CPU): per AC mode the replayed front (a s b + d s + c bytes per non-dominated moment of Inductor's generated
# backward, s, b symbolic) and the peak measured on real tensors at s 32, b 2 and s 64, b 3 (the CPU kernels' own
# scratch left out), evaluated as tests/test_compiled_moments.py evaluates Llama 3's
BACKWARD = json.loads((Path(__file__).parent / "data" / "titan_compiled_backward_qwen3.json").read_text())
CASES = BACKWARD["cases"]
IDS = [f"{c['ac']}-h{c['widths']['h']}" for c in CASES]


def _tiny(s: int, w: dict):
    return model(s, hidden_size=w["h"], num_attention_heads=w["a"], num_kv_heads=w["g"], head_dim=w["d"],
                 ffn_hidden_size=w["f"])


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_qwen3_moments_are_the_replayed_front(case):
    ours = _coefficients(case["ac"], case["widths"], _tiny)
    assert all(id.startswith("compiled_") for id in ours), ours  # the eager block's moments are left out
    assert _front(set(ours.values())) == {(r["a"], r["d"], r["c"]) for r in case["front"]}


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_qwen3_measured_peak_is_memplan_largest_moment(case):
    for row in case["measured"]:
        assert max(memplan_moments(case["ac"], row["s"], row["b"], case["widths"], _tiny).values()) == row["peak"]


def test_swiglu_moment_by_hand():
    # AC none, h 40, q 48, g d 16, f 154: the compiled block keeps 1,756 B per token (above), SwiGLU's product
    # (2f = 308) freed at its fused backward; the incoming gradient 2h = 80, w2's input gradient 2f = 308 and
    # silu(w1)'s 2f = 308: 2,144 B per token; w2's weight gradient h f x 2 B = 12,320 B (the front's first moment)
    assert memplan_moments("none", 32, 2, BACKWARD["cases"][0]["widths"], _tiny)["compiled_swiglu"] == \
        2144 * 64 + 12320


@pytest.mark.slow
@SLOW
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_inductor_backward_gives_the_recorded_figures(case):
    pytest.importorskip("torchtitan")
    from validation.compiled_backward import RERUN_KEYS, rerun

    measured, fronts = rerun(case)
    assert measured == [{k: row[k] for k in RERUN_KEYS} for row in case["measured"]]
    assert fronts == {(r["a"], r["d"], r["c"]) for r in case["front"]}
