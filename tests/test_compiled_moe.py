"""torch.compile on torchtitan's Qwen3 MoE block (`--compile`, memplan/inventory/compiled_moe.py) against the compiled
block on CPU.

The expected values are measurements of torchtitan 0.3.0's Qwen3 MoE block (``_build_qwen3_moe_layers``, bf16, the
router's own top-k, sdpa for FlexAttention) compiled by torch 2.13's inductor on CPU as torchtitan's apply_compile
compiles it (validation/compiled_moe.py: h 40, a 6, g 2, head 8 so q 48, fe 24, E 10, k 4; dynamic s, b; measured at
s 20, b 2 = 40 tokens; the block called with the dataloader's positions, as torchtitan's Trainer calls it):

    PYTHONPATH=. python -m validation.compiled_moe none           # and selective-op, full (~25 s of CPU each)

prints the forward graph's saved tensors (RECORDED below, parameters and the positions left out) and "after forward
93644 B (output 3200 B), eager 145568 B" (none; without the positions 91,084 and 143,008 B: both keep CosSinRoPE's
cos and sin rows gathered at them, 8d = 64 B per token), "19204 B (output 3200 B), eager 24584 B" (selective-op), "11780 B (output 3200 B),
eager 11464 B" (full): what the block keeps after its forward is that less its output (the window makes the block's
input, so a kept input counts), under full less the CPU generator state FullAC stashes (5,056 B; torch.get_rng_state,
not modelled: CPU's).  The suite checks memplan's table against those recordings; MEMPLAN_COMPILE_SLOW=1 compiles
the block again and checks the recordings (~75 s of CPU).
"""

import os
from collections import Counter

import pytest

from memplan.api.estimating import estimate
from memplan.api.searching import search
from memplan.core.training import Recompute, TrainingSpec
from memplan.inventory import compiled_moe
from memplan.inventory.assemble import training_inventory
from memplan.presets.catalog import load_model

H, A, G, D, FE, E, K = 40, 6, 2, 8, 24, 10, 4
S, B = 20, 2
OUTPUT, RNG_STATE = 3200, 5056  # the block's output (s b h bf16); torch.get_rng_state()'s bytes (FullAC on CPU)
MEASURED = {"none": 93644 - OUTPUT, "selective-op": 19204 - OUTPUT, "full": 11780 - OUTPUT - RNG_STATE}
# the hand derivation (memplan/inventory/compiled_moe.py's comment over TABLE): bytes per token, bytes per layer
HAND = {"none": (2260, 40 + 4), "selective-op": (400, 4), "full": (88, 4)}
REC = {"none": Recompute.NONE, "selective-op": Recompute.SELECTIVE, "full": Recompute.FULL}
# the traced saved tensors (elements, dtype) of each run of the docstring's command, parameters and the positions
# (int64 s b, a batch input the training loop holds: selective-op and full save it) left out; "10" the offsets' E, "1"
# route_scale, "5056" the CPU generator state; "2 s b q /a" the RoPE cos and sin rows (fp32 2d)
_ATTN = [("s b h", "bfloat16"), ("s b", "float32"), ("s b h", "bfloat16"), ("s b q", "bfloat16"),
         ("s b g q /a", "bfloat16"), ("s b a", "float32"), ("s b g", "float32"), ("2 s b q /a", "float32"),
         ("s b q", "bfloat16"),
         ("s b g q /a", "bfloat16"), ("s b g q /a", "bfloat16"), ("s b q", "bfloat16"), ("s b a", "float32"),
         ("s b h", "bfloat16"), ("s b", "float32"), ("s b h", "bfloat16")]
RECORDED = {
    "none": _ATTN + [("s b E", "bfloat16"), ("s b k", "int64"), ("s b k", "bfloat16"), ("1", "float32"),
                     ("s b k", "int64"), ("s b k", "bfloat16"), ("s b k", "int64"), ("s b k h", "bfloat16"),
                     ("10", "int32"), ("s b k fe", "bfloat16"), ("s b k fe", "bfloat16"), ("s b k fe", "bfloat16"),
                     ("s b k h", "bfloat16"), ("s b h", "bfloat16")],
    "selective-op": [("s b h", "bfloat16"), ("s b q + 2 s b g q /a", "bfloat16"), ("s b q", "bfloat16"),
                     ("s b a", "float32"), ("s b k", "int64"), ("1", "float32"), ("s b k", "bfloat16")],
    "full": [("s b h", "bfloat16"), ("1", "float32"), ("s b k", "bfloat16"), ("5056", "uint8")],
}
DTYPES = {"act": "bfloat16", "router": "bfloat16", "fp32": "float32", "int64": "int64"}  # on CPU
SLOW = pytest.mark.skipif(not os.environ.get("MEMPLAN_COMPILE_SLOW"), reason="set MEMPLAN_COMPILE_SLOW=1 to run")


def _canon(elements: str) -> str:
    return " + ".join(sorted(" ".join(sorted(m.split())) for m in elements.split(" + ")))


def _model():
    spec = load_model("qwen3-30b-a3b").model
    return spec.model_copy(update=dict(hidden_size=H, num_attention_heads=A, num_kv_heads=G, head_dim=D,
                                       num_experts=E, moe_top_k=K, moe_ffn_hidden_size=FE, seq_length=S,
                                       num_layers=1))


def _layer_bytes(ac: str) -> int:
    """memplan's compiled MoE block: the bytes its layer terms keep under ``ac`` at the measured shape."""
    model = _model()
    inv = training_inventory(model, "torchtitan", "cpu", TrainingSpec(compile=True, recompute=REC[ac]))
    values = model.symbols(b=B, t=1, cp=1, ep=1, etp=1)
    return sum(int(t.bytes(values, 2, 0)) * t.kept(REC[ac]) for t in inv.terms if t.scope == "layer")


@pytest.mark.parametrize("ac", list(REC))
def test_hand_derivation_equals_the_measurement(ac):
    per_token, per_layer = HAND[ac]
    assert per_token * S * B + per_layer == MEASURED[ac]


@pytest.mark.parametrize("ac", list(REC))
def test_compiled_moe_layer_bytes_equal_the_cpu_measurement(ac):
    # fails when a term of compiled_moe.TABLE is taken out (every row is kept in one mode at least) or the eager
    # MoE block's terms are left in
    assert _layer_bytes(ac) == MEASURED[ac]


def test_table_is_the_traced_saved_set():
    # memplan's table, per AC mode, equals the recorded trace (elements, dtype) as a multiset: the CPU generator
    # state excepted (full: not modelled) and the offsets (int32) held as 4-byte fp32
    for ac, rows in RECORDED.items():
        traced = Counter((_canon(el), dt.replace("int32", "float32")) for el, dt in rows if dt != "uint8")
        table = Counter((_canon("10" if el == "E" else el), DTYPES[dt])
                        for _, _, _, el, dt, modes in compiled_moe.TABLE if ac in modes)
        assert table == traced, ac


def test_a_removed_row_fails(monkeypatch):
    for i in range(len(compiled_moe.TABLE)):
        monkeypatch.setattr(compiled_moe, "TABLE", compiled_moe.TABLE[:i] + compiled_moe.TABLE[i + 1:])
        assert any(_layer_bytes(ac) != MEASURED[ac] for ac in REC)
        monkeypatch.undo()


def test_estimate_answers_compiled_and_refuses_ep(run_cli):
    argv = ["estimate", "--model", "qwen3-30b-a3b", "--impl", "torchtitan", "--gpus", "8"]
    code, out, err = run_cli(*argv, "--compile", "--ac", "selective-op")
    assert code == 0, err
    assert "validation/compiled_moe.py" in " ".join(out.split())
    code, out, err = run_cli(*argv, "--compile", "--ep", "2")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "traced at ep 1, tp 1, cp 1" in err


@SLOW
@pytest.mark.parametrize("ac", list(REC))
def test_recorded_trace_and_measurement(ac):
    pytest.importorskip("torchtitan")
    from validation.compiled_moe import trace_moe_block

    r = trace_moe_block(ac)
    positions = ("s b", "int64")  # the dataloader's positions, a batch input (memplan's held positions)
    rows = [(t.elements, t.dtype) for t in r.saved
            if t.kind != "parameter" and not (t.kind == "input" and (t.elements, t.dtype) == positions)]
    assert Counter((_canon(el), dt) for el, dt in rows) == Counter((_canon(el), dt) for el, dt in RECORDED[ac])
    assert (r.s, r.b, r.output_bytes) == (S, B, OUTPUT)
    assert r.after_forward - OUTPUT - (RNG_STATE if ac == "full" else 0) == MEASURED[ac]


def test_search_compiled_moe_plans_agree_with_estimate():
    # search --compile on a Qwen3 MoE: only plans at tp = ep = cp = 1 (the traced layout), each the plan estimate
    # --compile gives the same memory and step time
    base = dict(impl="torchtitan", gpus=8, global_batch=16, gpu="h100-80gb", seq_len=2048)
    found = search("qwen3-30b-a3b", compile=True, **base).result
    assert set(found.evaluated.plans.ep.tolist()) == {1} and set(found.evaluated.plans.t.tolist()) == {1}
    assert found.top
    for x in found.top[:2]:
        row = found.row(x)
        dims = row["torchtitan"]
        assert dims["compile"] and dims["ep"] == 1 and dims["tp"] == 1
        piped = dict(pp=dims["pp"], pipeline_schedule=dims["pipeline_schedule"]) if dims["pp"] > 1 else {}
        est = estimate("qwen3-30b-a3b", **base, compile=True, ac=dims["ac"], dp_replicate=dims["dp_replicate"],
                       micro_batch=dims["pipeline_microbatch_size"] or dims["local_batch"], **piped)
        assert row["memory"]["device_bytes"] == est.device_bytes
        assert row["step_time_s"] == pytest.approx(est.estimate.perf.step_time_s, rel=1e-6)
