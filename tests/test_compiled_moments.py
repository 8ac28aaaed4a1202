"""torchtitan's compiled block's backward moments (memplan/inventory/compiled_moments.py) against Inductor's generated
backward run on CPU.

The expected values are tests/data/titan_compiled_backward.json, measured by

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m validation.compiled_backward tests/data/titan_compiled_backward.json

(torchtitan 0.3.0's Llama 3 block at h 48, a 6, g 2, f 154 and at h 64, a 4, g 1, f 224, compiled by torch 2.13's
Inductor on CPU as apply_compile compiles it after the AC wrapper and called with the dataloader's positions as
torchtitan's Trainer calls it, ~5 min of CPU for the three AC modes at both): per mode ``measured`` the bytes alive at
the compiled backward's peak on real tensors at s 32, b 2 and s 64, b 3 (torch.profiler's allocation events; the CPU
kernels' own scratch, freed inside one aten op, left out: ``peak_scratch`` with it) and ``front`` the non-dominated
moments of the generated backward replayed with s, b symbolic, a s b + d s + c bytes each.  memplan's moments,
evaluated as the step timeline counts a layer's moment (memplan/memory/timeline.py ``_alive_sums``: the layer's terms
kept under the mode and not freed, plus the moment's transients; FSDP2's reduce-scatter and the held reduce-scatter
input left out: no FSDP2 on the CPU block), must give that front exactly and the measured peak at both shapes; without
them every test here fails.  The inductor runs are opt-in (MEMPLAN_COMPILE_SLOW=1, ~5 min)."""

import json
import os
from pathlib import Path

import pytest

from memplan.core.model import ModelSpec
from memplan.core.training import Recompute, TrainingSpec
from memplan.inventory.assemble import training_inventory

DATA = json.loads((Path(__file__).parent / "data" / "titan_compiled_backward.json").read_text())
MODES = {"none": Recompute.NONE, "full": Recompute.FULL, "selective-op": Recompute.SELECTIVE}
SMALL = dict(h=48, a=6, g=2, f=154)  # the first widths (validation/compiled.py WIDTHS["torchtitan"])


def tiny(s: int, w: dict) -> ModelSpec:
    return ModelSpec(name="tiny-titan", num_layers=1, hidden_size=w["h"], num_attention_heads=w["a"],
                     num_kv_heads=w["g"], ffn_hidden_size=w["f"], seq_length=s, vocab_size=256, norm="rmsnorm",
                     mlp="swiglu", position_embedding="rope", tied_embeddings=False, dropout=False, bias=False,
                     attention="flash")


def memplan_moments(ac: str, s: int, b: int, w: dict = SMALL, make=tiny) -> dict[str, int]:
    """Each compiled layer moment's bytes at s, b (tp 1) in a layer of mode ``ac`` (every layer recomputed under full
    and selective-op), as the timeline's ``_alive_sums`` and ``applies`` count it; ``make(s, w)`` the model (tests/
    test_compiled_qwen3.py: a dense Qwen3)."""
    rec = MODES[ac]
    model = make(s, w)
    inv = training_inventory(model, "torchtitan", "cpu", TrainingSpec(compile=True, recompute=rec))
    values = model.symbols(b=b, t=1, cp=1)
    layer = [t for t in inv.terms if t.scope == "layer" and not t.needs_tp and not t.needs_cp]
    on = {"any": True, "plain": rec != Recompute.FULL, "recomputed": rec == Recompute.FULL,
          "rerun": rec != Recompute.NONE}
    out = {}
    for m in inv.moments:
        if m.scope != "layer" or m.id == "fsdp_reduce_scatter" or not on[m.applies]:
            continue
        alive = [t for t in layer if t.id not in m.freed and (
            t.kept(Recompute.NONE) if rec == Recompute.NONE else t.kept(Recompute.NONE) or t.kept(Recompute.FULL)
            if rec == Recompute.FULL else t.kept(Recompute.SELECTIVE) or (t.kept(Recompute.NONE) and m.recomputed))]
        out[m.id] = sum(t.bytes(values, 2, 0) for t in alive) + sum(
            t.bytes(values, 2, 0) for t in m.transients if not t.id.startswith("rs_held"))
    return out


def _coefficients(ac: str, w: dict, make=tiny) -> dict[str, tuple[int, int, int]]:
    """Each moment as (a, d, c): bytes = a s b + d s + c (read off three points)."""
    at = {k: memplan_moments(ac, *k, w, make) for k in ((1, 1), (2, 1), (1, 2))}
    return {id: (at[(1, 2)][id] - at[(1, 1)][id], at[(2, 1)][id] - at[(1, 2)][id],
                 2 * at[(1, 1)][id] - at[(2, 1)][id]) for id in at[(1, 1)]}


def _front(points: set) -> set:
    return {p for p in points if not any(o != p and all(x >= y for x, y in zip(o, p)) for o in points)}


CASES = DATA["cases"]  # every AC mode at two widths
IDS = [f"{c['ac']}-h{c['widths']['h']}" for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_moments_are_the_replayed_front(case):
    ours = _coefficients(case["ac"], case["widths"])
    assert all(id.startswith("compiled_") for id in ours), ours  # the eager block's moments are left out
    recorded = {(r["a"], r["d"], r["c"]) for r in case["front"]}
    assert _front(set(ours.values())) == recorded


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_measured_peak_is_memplan_largest_moment(case):
    for row in case["measured"]:
        assert max(memplan_moments(case["ac"], row["s"], row["b"], case["widths"]).values()) == row["peak"], row


def test_swiglu_moment_by_hand():
    # AC none, h 48, a 6, g 2, f 154, d 8, per token: the compiled block called with the dataloader's positions keeps
    # 1,628 B (tests/test_compile.py; the RoPE rows gathered at them, 4d = 32 B, among them: their last use is RoPE's
    # backward, after this moment), SwiGLU's product (2f = 308) freed; the incoming gradient 2h = 96, w2's input
    # gradient 2f = 308 and silu(w1)'s 2f = 308 (w3's written into w3's output's storage): 2,032 B per token; w2's
    # weight gradient h f x 2 B = 14,784 B. s 32, b 2: the measured peak (tests/data/titan_compiled_backward.json)
    assert memplan_moments("none", 32, 2)["compiled_swiglu"] == 2032 * 64 + 14784 == 144832


def test_llama3_8b_estimate_has_the_compiled_moments():
    # `memplan estimate --model llama3-8b --impl torchtitan --gpus 8 --ac selective-op --compile`: a compiled layer
    # moment in the inventory, no "lower bound" note
    from memplan.api.estimating import estimate

    result = estimate("llama3-8b", impl="torchtitan", gpus=8, ac="selective-op", compile=True)
    notes = " ".join(result.estimate.notes)
    assert "lower bound" not in notes
    assert "compiled blocks' backward moments measured on CPU" in notes


SLOW = pytest.mark.skipif(not os.environ.get("MEMPLAN_COMPILE_SLOW"), reason="set MEMPLAN_COMPILE_SLOW=1 to run")


@pytest.mark.slow
@SLOW
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_inductor_run_gives_the_recorded_figures(case):
    pytest.importorskip("torchtitan")
    from validation.compiled_backward import RERUN_KEYS, rerun

    measured, fronts = rerun(case)
    assert measured == [{k: row[k] for k in RERUN_KEYS} for row in case["measured"]]
    assert fronts == {(r["a"], r["d"], r["c"]) for r in case["front"]}


def test_selective_layer_takes_none_moments_in_whole_layers():
    # --ac selective-layer:N (full AC on N layers of each chunk): the layers kept whole run the AC-none compiled
    # backward, the checkpointed ones full's; AC none's moments (measured above) with applies "plain"
    def moments(**kw):
        inv = training_inventory(tiny(64, SMALL), "torchtitan", "cpu", TrainingSpec(compile=True, **kw))
        return {m.id: m for m in inv.moments if m.id.startswith("compiled_")}

    none, full, layered = moments(), moments(recompute=Recompute.FULL), moments(recompute=Recompute.FULL,
                                                                                 recompute_num_layers=1)
    assert {m.applies for m in full.values()} == {"recomputed"}
    assert {id: (m.transients, m.freed) for id, m in layered.items() if id.endswith("_whole")} == {
        f"{id}_whole": (m.transients, m.freed) for id, m in none.items()}
    assert {id: m for id, m in layered.items() if not id.endswith("_whole")} == full
