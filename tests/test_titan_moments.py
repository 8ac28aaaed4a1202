"""torchtitan's dense decoder layer's backward moments (memplan/inventory/titan_moments.py) against torchtitan's real
block run forward and backward on CPU (validation/titan_moments.py: every storage the block made that is alive
after each op of its backward, its bf16 weight gradients included).  memplan's moments, evaluated here from their
definition (the layer's terms kept under the AC mode and not freed, plus the moment's transients), must equal the
measured largest moment of the backward and the one after sdpa's backward, at three Llama 3 shapes (the FFN wide,
wider, narrow: the peak then falls in the RMSNorm's backward) and a dense Qwen3 one, every AC mode; without the moments memplan has no layer
moment and every test here fails.  The symbolic trace (the same step under FakeTensorMode) is opt-in."""

import os

import pytest
import sympy

pytest.importorskip("torchtitan")

from memplan.core.model import ModelSpec  # noqa: E402
from memplan.core.training import Recompute  # noqa: E402
from memplan.inventory.titan import titan_inventory  # noqa: E402
from memplan.presets.catalog import load_model  # noqa: E402
from validation.titan import AC_MODES, Shape  # noqa: E402
from validation.titan_moments import measure_moments, trace_moments  # noqa: E402

MODES = {"none": Recompute.NONE, "full": Recompute.FULL, "selective-op": Recompute.SELECTIVE}
SHAPES = (Shape(h=64, a=4, g=2, f=160), Shape(h=64, a=4, g=1, f=224), Shape(h=128, a=4, g=1, f=96),
          Shape(h=64, a=4, g=2, f=160, qwen3=True))
BYTES = {"act": 2, "fp32": 4, "int64": 8}


def tiny(shape: Shape) -> ModelSpec:
    """The block's sizes as a model (torchtitan's Qwen3 block: q / k norms on the head dim)."""
    qwen3 = dict(qk_norm=True, qk_norm_width="head", head_dim=shape.h // shape.a) if shape.qwen3 else {}
    return ModelSpec(**qwen3,name="tiny-titan", num_layers=1, hidden_size=shape.h, num_attention_heads=shape.a,
                     num_kv_heads=shape.g, ffn_hidden_size=shape.f, seq_length=32, vocab_size=256, norm="rmsnorm",
                     mlp="swiglu", position_embedding="rope", tied_embeddings=False, dropout=False, bias=False,
                     attention="flash")


def _bytes(term, s, b):
    return int(term.elements.evaluate({"s": s, "b": b, "cp": 1, "t": 1})) * BYTES[term.dtype]


def memplan_moments(shape: Shape, ac: str, s: int, b: int) -> dict[str, int]:
    """Each layer moment's bytes on one GPU without TP: the layer's terms kept under ``ac`` that the moment has not
    freed (a recomputed layer holds what none keeps besides its own), plus its transients; the
    FSDP2-only moment and the previous layer's held reduce-scatter input (nothing is reduce-scattered without
    FSDP2: tests/test_titan_step.py measures them in a whole step) left out."""
    inv = titan_inventory(tiny(shape), "cpu")
    layer = [t for t in inv.terms if t.scope == "layer" and not t.needs_tp and not t.needs_cp]
    out = {}
    for m in inv.moments:
        if m.scope != "layer" or m.id == "fsdp_reduce_scatter":
            continue
        kept = [t for t in layer if t.id not in m.freed
                and (t.kept(MODES[ac]) or t.kept(Recompute.NONE))]
        out[m.id] = sum(_bytes(t, s, b) for t in kept) + sum(_bytes(t, s, b) for t in m.transients
                                                             if not t.id.startswith("rs_held"))
    return out


@pytest.mark.parametrize("shape", SHAPES, ids=["f2.5h", "f3.5h", "f0.75h", "qwen3"])
@pytest.mark.parametrize("ac", AC_MODES)
def test_measured_backward_peak_equals_memplan(shape, ac):
    s, b = 32, 2
    measured = measure_moments(shape, ac, s, b)
    ours = memplan_moments(shape, ac, s, b)
    assert max(ours.values()) == measured["bytes"], (ours, measured["at"])
    sdpa = [n for _, op, n in measured["samples"] if op == "_scaled_dot_product_flash_attention_for_cpu_backward"]
    assert ours["attention_backward"] == sdpa[0]


def test_swiglu_moment_by_hand():
    # h 64, a 4, g 2, f 160, d 16, AC none, per token: the layer keeps 3032 B (tests/test_titan.py; the RoPE rows
    # gathered at the positions among them), less the product's 2f = 320 freed; the output's gradient 2h = 128, w2's
    # input gradient 2f = 320, silu's and w3's gradients 2 x 2f = 640: 3800 B per token; w2's weight gradient h f x
    # 2 B = 20,480 B
    assert memplan_moments(SHAPES[0], "none", 32, 2)["swiglu_backward"] == 3800 * 64 + 20480 == 263680


def test_llama3_8b_moments_on_cuda():
    # no composite RMSNorm backward on CUDA; FlexAttention's fp32 delta (4a per token) in the attention moment
    inv = titan_inventory(load_model("llama3-8b").model, "cuda")
    ids = [m.id for m in inv.moments if m.scope == "layer"]
    assert ids == ["swiglu_backward", "attention_backward", "fsdp_reduce_scatter"]
    delta = next(t for m in inv.moments if m.id == "attention_backward" for t in m.transients if t.id == "flex_delta")
    assert _bytes(delta, 1, 1) == 4 * 32
    # FSDP2's reduce-scatter: 6 B per parameter of the layer (bf16 gradients + their fp32 copy): 218,112,000
    # parameters (4096 x (4096 + 2 x 1024 + 4096) + 3 x 4096 x 14336 + 2 x 4096), the input's gradient 2h per token
    rs = next(m for m in inv.moments if m.id == "fsdp_reduce_scatter")
    assert sum(_bytes(t, 1, 1) for t in rs.transients) == 6 * 218_112_000 + 2 * 4096


SLOW = pytest.mark.skipif(not os.environ.get("MEMPLAN_TITAN_SLOW"), reason="set MEMPLAN_TITAN_SLOW=1 to run")


@pytest.mark.slow
@SLOW
@pytest.mark.parametrize("ac", AC_MODES)
def test_traced_front_holds_memplan_moments(ac):
    # the symbolic trace's candidates (every s, b): memplan's SwiGLU, ffn_norm and attention moments are among them
    shape = SHAPES[0]
    s_, b_ = sympy.Symbol("s", integer=True, positive=True), sympy.Symbol("b", integer=True, positive=True)
    front = [sum(r["bytes"].values()) + 2 * r["grad_elements"] for r in trace_moments(shape, ac)]
    at = [(32, 2), (48, 3)]
    candidates = [tuple(int(e.subs({s_: s, b_: b})) for s, b in at) for e in front]
    ours = [memplan_moments(shape, ac, s, b) for s, b in at]
    for id in ours[0]:
        assert tuple(o[id] for o in ours) in candidates, id
