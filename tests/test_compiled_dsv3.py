"""torch.compile on torchtitan's DeepSeek-V3 blocks (`--compile`, memplan/inventory/compiled_dsv3.py) against the
compiled blocks on CPU.

The expected values are measurements of torchtitan 0.3.0's DeepSeek-V3 blocks (``_build_dsv3_layers``: a dense first
layer and an MoE layer, bf16, q latent, yarn ComplexRoPE, the sigmoid router with 8 expert groups of which 4 chosen,
route_norm, 3 shared experts, the router's own top-k; FlexAttention's save set in a stand-in op) compiled by torch
2.13's inductor on CPU as torchtitan's apply_compile compiles them, called with the dataloader's positions
(validation/compiled_dsv3.py SHAPE: h 56, a 5, r_q 34, r_kv 44, d_n 10, d_r 18, d_v 11, f 80, f_e 32, f_s 96, E 24,
k 7; dynamic s, b), recorded in tests/data/compiled_dsv3.json by

    PYTHONPATH=. python -m validation.compiled_dsv3 record tests/data/compiled_dsv3.json   # ~15 min of CPU

(per case: the forward graph's saved tensors, parameters left out, and the bytes alive after the forward at s 20,
b 2 and s 12, b 4: what the block keeps is that less its output; the window makes the block's input, so a kept input
counts; the positions are made before it, a batch input).  The suite checks memplan's tables against the recording;
MEMPLAN_COMPILE_SLOW=1 compiles the blocks again and checks the recording (-k recorded, ~2 min a case).
"""

import json
import os
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pytest

from memplan.api.estimating import estimate
from memplan.api.searching import search
from memplan.core.training import Recompute, TrainingSpec
from memplan.inventory import compiled_dsv3
from memplan.inventory.assemble import training_inventory
from memplan.presets.catalog import load_model

DATA = json.loads((Path(__file__).parent / "data" / "compiled_dsv3.json").read_text())
W = DATA["shape"]
REC = {"none": Recompute.NONE, "selective-op": Recompute.SELECTIVE, "full": Recompute.FULL}
SLOW = pytest.mark.skipif(not os.environ.get("MEMPLAN_COMPILE_SLOW"), reason="set MEMPLAN_COMPILE_SLOW=1 to run")
CASES = {(c["layer"], c["ac"]): c for c in DATA["cases"]}
# the hand derivation (memplan/inventory/compiled_dsv3.py's comment over TABLE): bytes per token, bytes per layer
HAND = {("dense", "none"): (2374, 0), ("moe", "none"): (5740, 4 + 96), ("dense", "selective-op"): (706, 0),
        ("moe", "selective-op"): (808, 4), ("dense", "full"): (112, 0), ("moe", "full"): (126, 4)}
# where the trace names a view and the table its storage (the measurement counts the storage): under AC none the kv
# latent kv_norm takes is a view of wkv_a's whole output, the attention's v of wkv_b's; the RoPE rows are complex64
# d_r / 2 in the graph, fp32 d_r in the table (as many bytes)
VIEWS = {("s b rkv", "bfloat16", "wkv_a.out"): "s b rkvr", ("s b a dv", "bfloat16", "wkv_b.out"): "s b a dkv"}
DTYPES = {"act": "bfloat16", "router": "bfloat16", "fp32": "float32", "int64": "int64"}  # on CPU


def _measured(case, run) -> int:
    """What the block keeps after its forward (its output apart)."""
    return run["after_forward"] - run["output"]


def _model():
    spec = load_model("deepseek-v3").model
    return spec.model_copy(update={
        "hidden_size": W["h"], "num_attention_heads": W["a"], "num_kv_heads": W["a"], "q_lora_rank": W["rq"],
        "kv_lora_rank": W["rkv"], "qk_nope_head_dim": W["dn"], "qk_rope_head_dim": W["dr"], "v_head_dim": W["dv"],
        "ffn_hidden_size": W["f"], "moe_ffn_hidden_size": W["fe"], "moe_shared_ffn_hidden_size": W["ns"] * W["fe"],
        "num_experts": W["E"], "moe_top_k": W["k"], "moe_first_dense_layers": 1, "num_layers": 2, "seq_length": 20,
        "mtp_layers": 0, "vocab_size": 256})


def _layers_bytes(ac: str, s: int, b: int) -> int:
    """memplan's compiled DeepSeek-V3 layers at L = 2 (one dense, one MoE): the bytes their layer terms keep under
    ``ac`` (each layer's terms times L: the dense and MoE terms are weighted 1/2)."""
    model = _model().model_copy(update={"seq_length": s})
    inv = training_inventory(model, "torchtitan", "cpu", TrainingSpec(compile=True, recompute=REC[ac]))
    values = model.symbols(b=b, t=1, cp=1, ep=1, etp=1)
    total = sum(Fraction(t.bytes(values, 2, 0)) * t.kept(REC[ac]) for t in inv.terms if t.scope == "layer")
    return int(total * model.num_layers)


def _part_bytes(layer: str, ac: str, s: int, b: int) -> int:
    """memplan's one compiled block (every layer's terms and the dense or the MoE part's, unweighted)."""
    model = _model().model_copy(update={"seq_length": s})
    parts = compiled_dsv3.compiled_dsv3_parts(model, "cpu")
    values = model.symbols(b=b, t=1, cp=1, ep=1, etp=1)
    return sum(int(t.bytes(values, 2, 0)) * t.kept(REC[ac]) for t in parts["layer"] + parts[layer])


@pytest.mark.parametrize("layer,ac", list(CASES))
def test_hand_derivation_equals_the_measurement(layer, ac):
    per_token, per_layer = HAND[layer, ac]
    for run in CASES[layer, ac]["runs"]:
        assert per_token * run["s"] * run["b"] + per_layer == _measured(CASES[layer, ac], run)


@pytest.mark.parametrize("layer,ac", list(CASES))
def test_each_compiled_block_equals_the_cpu_measurement(layer, ac):
    for run in CASES[layer, ac]["runs"]:
        assert _part_bytes(layer, ac, run["s"], run["b"]) == _measured(CASES[layer, ac], run)


@pytest.mark.parametrize("ac", list(REC))
def test_compiled_dsv3_layers_equal_the_cpu_measurement(ac):
    # through training_inventory (the wiring): fails when a row of compiled_dsv3.TABLE is taken out or the eager
    # blocks' terms are left in
    for i, (s, b) in enumerate((r["s"], r["b"]) for r in CASES["dense", ac]["runs"]):
        want = sum(_measured(CASES[layer, ac], CASES[layer, ac]["runs"][i]) for layer in ("dense", "moe"))
        assert _layers_bytes(ac, s, b) == want


def test_table_is_the_traced_saved_set():
    # memplan's table, per layer and AC mode, equals the recorded trace (elements, dtype) as a multiset: the
    # positions (an int64 batch input) and the CPU generator state (uint8) excepted, views as their storage (VIEWS),
    # the offsets (int32, a constant: its value count E) held as 4-byte fp32
    for (layer, ac), case in CASES.items():
        traced = Counter()
        for kind, el, dt in case["saved"]:
            if (kind == "input" and dt == "int64") or dt == "uint8":
                continue
            el, dt = {"complex64": ("s b dr", "float32"), "int32": (el, "float32")}.get(dt, (el, dt))
            traced[el, dt] += 1
        for (el, dt, id), storage in VIEWS.items():
            if ac == "none":  # the view in the trace, its storage in the table
                traced[el, dt] -= 1
                traced[storage, dt] += 1
        table = Counter((str(W["E"]) if el == "E" else el, DTYPES[dt]) for _, _, part, _, el, dt, modes in compiled_dsv3.TABLE
                        if part in ("layer", layer) and ac in modes)
        assert +table == +traced, (layer, ac)


def test_a_removed_row_fails(monkeypatch):
    for i in range(len(compiled_dsv3.TABLE)):
        monkeypatch.setattr(compiled_dsv3, "TABLE", compiled_dsv3.TABLE[:i] + compiled_dsv3.TABLE[i + 1:])
        assert any(_layers_bytes(ac, 20, 2) != sum(_measured(CASES[k, ac], CASES[k, ac]["runs"][0])
                                                   for k in ("dense", "moe")) for ac in REC)
        monkeypatch.undo()


def test_estimate_answers_compiled_and_refuses_ep(run_cli):
    argv = ["estimate", "--model", "deepseek-v3", "--impl", "torchtitan", "--gpus", "512", "--gpu", "h100-80gb",
            "--global-batch", "512"]
    code, out, err = run_cli(*argv, "--compile", "--ac", "selective-op")
    assert code == 0, err
    text = " ".join(out.split())
    assert "validation/compiled_dsv3.py" in text and "FlexAttention's save set (q, k, v, out, lse) derived" in text
    code, out, err = run_cli(*argv, "--compile", "--ep", "8")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "traced at ep 1, tp 1, cp 1" in err


def test_compile_changes_the_deepseek_v3_estimate():
    # the compiled blocks' terms replace the eager ones: no eager router-group topk term is left, and under
    # selective-op the compiled layers keep less than the eager ones (eager SAC keeps those topk outputs and more)
    model = load_model("deepseek-v3").model
    inv = training_inventory(model, "torchtitan", "cuda", TrainingSpec(compile=True, recompute=Recompute.SELECTIVE))
    assert inv.name.endswith("/compiled") and not any(t.id.startswith("moe.group_") for t in inv.terms)
    base = dict(impl="torchtitan", gpus=512, gpu="h100-80gb", ac="selective-op", global_batch=512, seq_len=4096)
    assert estimate("deepseek-v3", compile=True, **base).device_bytes < estimate("deepseek-v3", **base).device_bytes


def test_search_compiled_dsv3_plans_agree_with_estimate():
    # on H200s: at ep 1 a layer's 23 GB of unsharded experts leave no compiled plan room on an 80 GB H100
    base = dict(impl="torchtitan", gpus=512, global_batch=512, gpu="h200", seq_len=4096)
    found = search("deepseek-v3", compile=True, **base).result
    assert set(found.evaluated.plans.ep.tolist()) == {1} and set(found.evaluated.plans.t.tolist()) == {1}
    assert found.top
    row = found.row(found.top[0])
    dims = row["torchtitan"]
    assert dims["compile"] and dims["ep"] == 1 and dims["tp"] == 1 and dims["pp"] == 1
    est = estimate("deepseek-v3", **base, compile=True, ac=dims["ac"], dp_replicate=dims["dp_replicate"],
                   micro_batch=dims["local_batch"])
    assert row["memory"]["device_bytes"] == est.device_bytes


@SLOW
@pytest.mark.parametrize("layer,ac", list(CASES))
def test_recorded_trace_and_measurement(layer, ac):
    pytest.importorskip("torchtitan")
    from validation.compiled_dsv3 import SHAPES, trace_dsv3_block

    case = CASES[layer, ac]
    for (s, b), run in zip(SHAPES, case["runs"]):
        r = trace_dsv3_block(layer == "moe", ac, s=s, b=b)
        rows = [[t.kind, t.elements, t.dtype] for t in r.saved if t.kind != "parameter"]
        assert Counter(map(tuple, rows)) == Counter(map(tuple, case["saved"]))
        assert (r.s, r.b, r.after_forward, r.output_bytes) == (s, b, run["after_forward"], run["output"])
