"""torchtitan 0.3.0's Llama 3 layer (memplan/inventory/titan.py) against torchtitan's real block run on CPU.

validation/titan.py builds the block from torchtitan's own config code and wraps it with torchtitan's own
FullAC / SelectiveAC; what the block keeps after its forward is measured with real tensors and traced under
FakeTensorMode with symbolic s and b. memplan's terms (written from torchtitan's code) must equal both, term by
term (each term's bytes per token as a multiset), so removing any term fails. Needs torchtitan (the test extra)."""

from collections import Counter

import pytest
import sympy

pytest.importorskip("torchtitan")

from memplan.core.errors import MemplanError  # noqa: E402
from memplan.inventory.titan import AC_MODES, fsdp2_states, layer_bytes, llama3_layer_terms, sharded_numel  # noqa: E402
from validation.titan import Shape, measure_block, trace_block  # noqa: E402

SHAPE = Shape(h=64, a=4, g=2, f=160)  # head dim 16
TERMS = llama3_layer_terms(SHAPE.h, SHAPE.a, SHAPE.g, SHAPE.f)
S, B = sympy.Symbol("s", integer=True, positive=True), sympy.Symbol("b", integer=True, positive=True)


def _inventory(ac):
    """memplan's terms kept under ac, the block input apart (the harness reports it as input_kept)."""
    return Counter(t.bytes_per_token for t in TERMS if ac in t.modes and t.id != "input")


# the trace of every mode is slow (fake mode's first run, ~20 s); the measured test below checks all three
# modes against the same terms in the suite, and selective-op's trace runs there too
@pytest.mark.parametrize("ac", [pytest.param("none", marks=pytest.mark.slow), pytest.param("full", marks=pytest.mark.slow),
                                "selective-op"])
def test_traced_terms_equal_memplan_terms(ac):
    traced = trace_block(SHAPE, ac)
    per_token = Counter()
    for _, _, expr in traced["rows"]:
        coeff = sympy.Poly(expr, S, B).as_dict()
        assert set(coeff) == {(1, 1)}, expr  # every kept storage is c s b: linear in s and in b
        per_token[int(coeff[(1, 1)])] += 1
    assert per_token == _inventory(ac)
    assert traced["input_kept"] == (ac != "none")


@pytest.mark.parametrize("ac,s,b", [("none", 48, 2), ("full", 40, 3), ("selective-op", 24, 3)])
def test_measured_bytes_equal_memplan(ac, s, b):
    measured = measure_block(SHAPE, ac, s, b)
    assert Counter(n // (s * b) for _, _, n in measured["rows"]) == _inventory(ac)
    input_bytes = 2 * SHAPE.h * s * b if measured["input_kept"] else 0
    assert measured["total"] + input_bytes == layer_bytes(TERMS, ac, s, b)


def test_layer_bytes_by_hand():
    # per token, h = 64, a = 4, g = 2, f = 160, d = 16:
    # none: 2 norms x (4h + 4 + 4h + 2h) = 1288; q 2ad = 128, k 2gd = 64, v 64; out 2ad = 128, lse 4a = 16;
    #       SwiGLU 4 x 2f = 1280: 2968
    # full: input 2h = 128
    # selective-op: input 128 + wqkv 2(a + 2g)d = 256 + out 128 + lse 16 + w1 2f = 320 + w2 2h = 128: 976
    assert [layer_bytes(TERMS, ac, 1, 1) for ac in AC_MODES] == [2968, 128, 976]
    with pytest.raises(MemplanError):
        layer_bytes(TERMS, "budget:0.5", 1, 1)


def test_fsdp2_states_by_hand():
    # two ranks; a [5, 4] weight shards as ceil(5 / 2) = 3 rows of 4 per rank (dim 0 padded), a [4] norm as 2
    assert sharded_numel((5, 4), 2) == 12 and sharded_numel((4,), 2) == 2
    st = fsdp2_states([(5, 4), (4,)], layer_params=24, n=2)
    # 14 elements per rank: fp32 params 56, grads 56, AdamW 2 x 56; 2 layers in flight x 24 params x 2 bytes
    assert (st.params, st.grads, st.adam, st.unsharded, st.total) == (56, 56, 112, 96, 320)
