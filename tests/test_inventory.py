"""The inventory against K22 Table 2's closed forms, over a grid of shapes and t.

The closed forms are written here, and only here, exactly as K22 Table 2 prints them
(bytes per layer; s, b, h, a, t as in K22 Table 1).
"""

from fractions import Fraction

from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.inventory.activations import layer_bytes, layer_poly
from memplan.core.model import ModelSpec
from memplan.core.training import Recompute
from memplan.core.symbolic import Poly
from memplan.inventory.assemble import inventory_for
from memplan.inventory.types import display_poly


def k22_table2(s, b, h, a, t, sp, recompute):
    sbh = Fraction(s * b * h)
    if recompute == Recompute.FULL:
        return 2 * sbh if not sp else 2 * sbh / t  # K22 4.1; with SP the layer input is split (K22 note)
    attn = Fraction(5 * a * s, h * t)  # 5as/(ht)
    if recompute == Recompute.SELECTIVE:
        attn = 0
    if t == 1:
        return sbh * (34 + attn)
    if sp:
        return sbh * (Fraction(34, t) + attn)
    return sbh * (10 + Fraction(24, t) + attn)


shapes = st.tuples(
    st.sampled_from([1, 2, 4, 8, 16]),  # t
    st.integers(1, 8),  # heads per t
    st.sampled_from([16, 64, 128]),  # head dim
    st.sampled_from([128, 512, 2048, 4096]),  # s
    st.integers(1, 8),  # b
)


@settings(max_examples=300, deadline=None)
@given(shapes, st.booleans(), st.sampled_from(list(Recompute)))
def test_inventory_equals_table2(shape, sp, recompute):
    t, heads_per_t, head_dim, s, b = shape
    a = heads_per_t * t
    h = a * head_dim
    sp = sp and t > 1
    model = ModelSpec(num_layers=2, hidden_size=h, num_attention_heads=a, seq_length=s, vocab_size=1000)
    terms = [term for term in inventory_for(model).terms if term.scope == "layer" and term.in_k22]
    values = dict(s=s, b=b, h=h, a=a, f=4 * h, g=a, q=h, v=1000, t=t)
    got = layer_bytes(terms, values, 2, int(sp), recompute)
    assert got == k22_table2(s, b, h, a, t, sp, recompute)
    # the symbolic sum evaluates to the same number
    assert layer_poly(terms, 2, sp, recompute).evaluate(values) == got


def test_blocks_match_k22_section_41():
    # K22 4.1: attention 11sbh + 5as^2b, MLP 19sbh, layer norms 4sbh.
    model = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=100)
    by_block = {}
    for term in inventory_for(model).terms:
        if term.scope == "layer" and term.in_k22:
            size = display_poly(term.size(2), model)  # f = 4h, g = a, q = h
            by_block[term.block] = by_block.get(term.block, Poly(())) + size
    assert by_block["attention"].text() == "11sbh + 5as^2b"
    assert by_block["MLP"].text() == "19sbh"
    assert by_block["layer norms"].text() == "4sbh"


def test_mlp_width_f_megatron_form():
    # With an MLP of width f the layer is sbh(18 + 4f/h) + 5as^2b (formulas.md section 2).
    model = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=100,
                      ffn_hidden_size=96)
    total = Poly(())
    for term in inventory_for(model).terms:
        if term.scope == "layer" and term.in_k22:
            total = total + display_poly(term.size(2), model)  # g = a, q = h
    assert total.factored() == "sbh(18 + 4f/h + 5as/h)"


def test_every_term_cites_a_source():
    model = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=100)
    for term in inventory_for(model).terms:
        assert term.source, term.id
