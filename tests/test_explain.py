"""`memplan explain`: the formulas with the values substituted, step by step."""

import json

from memplan.core.symbolic import Poly
from memplan.report.explain import substituted

# two micro-batches per step: the hand-written inventory (one would get llama3-8b's shipped trace: plan/estimate.py
# traced_default)
LLAMA_8B = ("--model", "llama3-8b", "--impl", "hf-sdpa", "--tp", "1", "--pp", "1", "--no-sp", "--dp", "1",
            "--global-batch", "2", "--seq-len", "4096", "--recompute", "full", "--precision", "bf16-true",
            "--optimizer-impl", "fused", "--gpu", "h100-80gb")


def test_530b_table2_row(run_cli):
    code, out, err = run_cli("explain", "--model", "gpt3-530b")
    assert code == 0 and err == ""
    # K22's 530B plan (Table 3: t=8, SP, selective recompute): Table 2's row 34sbh/t, with s=2048, b=1,
    # h=20480: 34 x 2048 x 1 x 20480 / 8 = 34 x 5,242,880 = 178,257,920 B
    assert "(K22 Table 2 row: TP + SP + selective recompute): 34sbh/t = 34 x 2048 x 1 x 20480 / 8 = 178,257,920 B" in out
    # the GeLU input, 8sbh/t = 8 x 2048 x 20480 / 8 = 41,943,040 B, with its source
    assert "GeLU input: 8sbh/t = 8 x 2048 x 1 x 20480 / 8 = 41,943,040 B  [K22 section 4.1" in out
    # selective recompute drops 5as^2b/t = 5 x 128 x 2048^2 / 8 = 640 x 524,288 = 335,544,320 B
    assert "5as^2b/t = 5 x 128 x 2048^2 x 1 / 8 = 335,544,320 B" in out
    # interleaved 1F1B on stage 0, p=35, m=3, M=280: min(2 x 34 + 2 x 35 + 1, 840) = 139 chunks
    assert "= 139 chunks" in out
    for section in ("saved activations of one layer", "pipeline", "weights, gradients and optimizer states",
                    "the step peak and what the device needs"):
        assert section in out


def test_steps_add_up(run_cli):
    code, out, _ = run_cli("explain", "--model", "gpt3-530b", "--json")
    assert code == 0
    steps = {s["label"].split(",")[0].split(" (")[0]: s for s in json.loads(out)}
    params = steps["parameters on one GPU of stage 0"]["value"]
    # bf16-mixed: 2 B of weights, 4 B of gradients, 4 + 2 x 4 = 12 B of optimizer states per parameter
    assert steps["weights"]["value"] == 2 * params
    assert steps["gradients"]["value"] == 4 * params
    assert steps["optimizer states"]["value"] == 12 * params
    peak = next(s for s in json.loads(out) if s["label"].startswith("step peak"))
    assert peak["value"] == sum(int(x.replace(",", "")) for x in peak["substituted"].split(" + "))
    device = steps["device memory needed"]
    assert device["value"] == sum(int(x.replace(",", "")) for x in device["substituted"].split(" + "))
    assert all(s["unit"] for s in json.loads(out) if s["value"] is not None)


def test_no_tensor_parallelism_has_no_t(run_cli):
    code, out, _ = run_cli("explain", *LLAMA_8B)
    assert code == 0
    layer = out.split("== saved activations")[1].split("==")[1]
    assert "/t" not in layer
    _, est, _ = run_cli("estimate", *LLAMA_8B, "--json")
    # full recompute keeps only the layer input: 2sbh = 2 x 4096 x 1 x 4096 = 33,554,432 B
    assert json.loads(est)["activations"]["per_layer_bytes"] == 2 * 4096 * 4096
    assert "2sbh = 2 x 4096 x 1 x 4096 = 33,554,432 B" in out


def test_substituted_text():
    values = dict(a=128, s=2048, b=1, h=20480, t=8)
    assert substituted(Poly.parse_sum("34 s b h /t + 5 a s^2 b /t"), values) == (
        "34 x 2048 x 1 x 20480 / 8 + 5 x 128 x 2048^2 x 1 / 8")
    assert substituted(Poly.parse("1/2 s b /h /t"), values) == "2048 x 1 / (2 x 20480 x 8)"


def test_explain_needs_a_model(run_cli):
    code, _, err = run_cli("explain")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--model is required" in err


def test_a_replayed_fragmentation_is_explained_as_the_replay(run_cli):
    # llama3-8b, transformers sdpa, bf16 states on one H100, --frag-margin 0: the caching allocator's replay reserves
    # more than the (zero) margin, so the fragmentation is reserved peak - allocated peak; before, the step printed
    # ceil(0 x allocated peak) beside a non-zero value
    code, out, _ = run_cli("explain", "--model", "llama3-8b", "--impl", "hf-sdpa", "--precision", "bf16-true", "--gpus",
                           "1", "--recompute", "full", "--micro-batch", "1", "--global-batch", "2", "--gpu", "h100-80gb",
                           "--frag-margin", "0", "--json")
    assert code == 0
    frag = next(s for s in json.loads(out) if s["label"].startswith("fragmentation"))
    assert frag["value"] > 0 and "replay" in frag["label"]
    reserved, allocated = (int(x.replace(",", "")) for x in frag["substituted"].split(" - "))
    assert frag["value"] == reserved - allocated
