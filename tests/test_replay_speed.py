"""The replay's speed-ups are the same replay (issue 20 item 4): a dying run's event found without expanding the
stream's copied layers (`AllocationStream.event_at`); a plan's stream at other lengths evaluated from its sizes'
polynomials (memplan/memory/stream_lengths.py) is the stream made at those lengths, and where a stream moves with s
otherwise, it is made at every length. (The written-out replay, which reuses merged-away blocks, is checked against
the rules' replay in tests/test_allocator.py.)"""

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_stream import plans

from memplan.core.symbolic import Poly
from memplan.inventory.assemble import training_inventory
from memplan.memory.reserved import allocation_stream
from memplan.memory.stream import stream_for
from memplan.memory.stream_events import Alloc, AllocationStream, Free, Stamp
from memplan.memory.stream_lengths import StreamLengths, ceil_at
from memplan.memory.term_bytes import PlanValues
from memplan.plan.limits import seq_step
from memplan.presets.batch import make_config
from memplan.presets.catalog import load_model


def _streams():
    """A 4-layer Megatron-LM stage made with its layers' templates (copies stand as `Stamp`s) and afresh."""
    config = make_config(load_model("llama3-8b"), parallel=dict(tp=2, pp=1, dp=1, sp=True),
                         training=dict(micro_batch=1, global_batch=2), model=dict(num_layers=4))
    inventory = training_inventory(config.model, "megatron", "cuda", config.training)
    plan = PlanValues.from_config(config)
    return [stream_for(config.model, inventory, config.training, plan, 0, repeat=repeat) for repeat in (True, False)]


def test_event_at_is_the_event():
    # every position, inside a copy (its first, middle and last events) and outside, names the event made afresh there;
    # the copied stream is left unexpanded
    copied, afresh = _streams()
    assert sum(type(e) is Stamp for e in copied.raw) > len(copied.raw) // 2
    assert [copied.event_at(i) for i in range(len(copied))] == afresh.events
    assert "events" not in copied.__dict__
    assert copied.events and copied.event_at(len(copied) - 1) == afresh.events[-1]  # once expanded, read from there


# (preset, impl, parallel, training, model overrides): single-GPU transformers with full recompute (the --max-seq
# plan of issue 20), Megatron-LM with t = 2 and sequence parallelism over 2 stages, a MoE, ZeRO-3 with LoRA
PLANS = [
    ("llama3-8b", "hf-sdpa", dict(tp=1, pp=1, dp=1), dict(micro_batch=1, global_batch=1, recompute="full",
                                                        optimizer_impl="fused", precision="bf16-true"),
     dict(num_layers=2)),
    ("llama3-8b", "megatron", dict(tp=2, pp=2, dp=1, sp=True), dict(micro_batch=2, global_batch=4,
                                                                  recompute="selective"), dict(num_layers=4)),
    ("mixtral-8x22b", "megatron", dict(tp=2, pp=1, dp=2, ep=2, sp=True, zero=1), dict(micro_batch=1, global_batch=2),
     dict(num_layers=2)),
    ("llama3-8b", "hf-sdpa", dict(tp=1, pp=1, dp=2, zero=3), dict(micro_batch=1, global_batch=2, lora_rank=16,
                                                                dp_stack="fsdp2"), dict(num_layers=2)),
]
LENGTHS = (1024, 1536, 512, 2048, 1282, 770)  # the first two made, the rest evaluated (multiples of t = 2)


def _lengths(case, first_step_seq_len=None):
    """StreamLengths of the plan fed its streams at the first two LENGTHS; a function making the stream at s."""
    preset, impl, par, tr, model = case

    def make(s):
        config = make_config(load_model(preset), parallel=par, training=tr, model=dict(model, seq_length=s),
                             whole_model_per_rank=impl.startswith("hf-"))
        return allocation_stream(config, impl, stage=0, first_step_seq_len=first_step_seq_len)

    lengths = StreamLengths(tr["micro_batch"])
    for s in LENGTHS[:2]:
        stream, ops = lengths.get(0, s, lambda: make(s))
        assert ops == stream.ops()
    return lengths, make


@pytest.mark.parametrize("case", PLANS, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}")
def test_evaluated_lengths_are_the_streams_made_there(case):
    # after two lengths made, the compact stream the replay reads at any other length comes from the sizes'
    # polynomials, and it is the one made at that length, event for event (and so is the replay's verdict)
    lengths, make = _lengths(case)
    assert lengths.made == 2
    for s in LENGTHS[2:]:
        stream, ops = lengths.get(0, s, lambda: pytest.fail("made again"))
        made = make(s)
        assert ops == made.ops() and len(stream) == len(made)
    assert lengths.made == 2


def test_streams_that_move_otherwise_are_made_at_every_length():
    # a size that moves with s without a polynomial (GPT-3's learned position embedding, a parameter of s x h), a
    # first step at another length (its sizes are not the polynomials' at s), context parallelism (each rank's s / cp
    # tokens, which the polynomials leave out): every length's stream is made
    gpt = ("gpt3-175b", "torch", dict(tp=1, pp=1, dp=1), dict(micro_batch=1, global_batch=1),
           dict(num_layers=2, hidden_size=512, num_attention_heads=8))
    cp = ("llama3-8b", "megatron", dict(tp=1, pp=1, dp=1, cp=2), dict(micro_batch=1, global_batch=1),
          dict(num_layers=2))
    for case, first in ((gpt, None), (PLANS[0], 256), (cp, None)):
        lengths, make = _lengths(case, first)
        assert lengths.shapes == {0: None}
        stream, ops = lengths.get(0, LENGTHS[2], lambda: make(LENGTHS[2]))
        assert lengths.made == 3 and ops == stream.ops()


def test_ceil_at():
    # 5/2 s b + 3 at s = 3, b = 1: 10.5 -> 11; an integral value stays; another symbol: no value
    assert ceil_at(Poly.parse("5/2 s b") + Poly.parse("3"), 3, 1) == 11
    assert ceil_at(Poly.parse("2 s b"), 3, 2) == 12
    assert ceil_at(Poly.parse("s h"), 3, 1) is None


@settings(max_examples=20, deadline=None)
@given(plans(), st.integers(1, 40))
def test_random_plans_evaluated_at_another_length(case, k):
    # random small plans (tests/test_stream.py's): where the streams made at two lengths agree, the one evaluated at a
    # third length (k steps of the plan's length multiple past the first) is the one made there
    config, impl, device = case
    s0, step = config.model.seq_length, seq_step(config)

    def make(s):
        return stream_for(config.model.model_copy(update={"seq_length": s}), inventory, config.training,
                          PlanValues.from_config(config), 0)

    inventory = training_inventory(config.model, impl, device, config.training)
    lengths = StreamLengths(config.training.micro_batch)
    for s in (s0, 2 * s0):
        lengths.get(0, s, lambda: make(s))
    s = s0 + k * step
    stream, ops = lengths.get(0, s, lambda: make(s))
    assert ops == make(s).ops()


def test_a_size_under_one_byte_is_made():
    # two hand-made runs of one allocation of s - 100 bytes (a polynomial with a negative coefficient) at s = 300 and
    # 200: evaluated at s = 150 (50 bytes); at s = 100 and 60 (0 and less: a stream would hold no such allocation)
    # the stream is made there
    size = Poly(((((("s", 1),), Fraction(1)), ((), Fraction(-100)))))

    def make(s):
        n = s - 100
        events = [Alloc(0, n, 0, "transient", "x", size, n), Free(0)] if n > 0 else []
        return AllocationStream(events, [], [], None, 0)

    lengths = StreamLengths(1)
    for s in (300, 200):
        lengths.get(0, s, lambda: make(s))
    assert lengths.get(0, 150, lambda: pytest.fail("made again"))[1] == [50, ~0]
    for s in (100, 60):
        stream, ops = lengths.get(0, s, lambda: make(s))
        assert ops == [] and len(stream) == 0
    assert lengths.made == 4
