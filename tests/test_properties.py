"""Property tests of the whole-model estimate over random models and plans."""

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from memplan.plan.estimate import estimate
from memplan.memory.pipeline import interleaving_factor
from memplan.core.model import ModelSpec
from memplan.core.specs import Config, ParallelSpec
from memplan.core.training import TrainingSpec


@st.composite
def configs(draw):
    t = draw(st.sampled_from([1, 2, 4, 8]))
    a = t * draw(st.integers(1, 4))
    h = a * draw(st.sampled_from([32, 64, 128]))
    p = draw(st.sampled_from([1, 2, 4]))
    m = draw(st.sampled_from([1, 2])) if p > 1 else 1
    L = p * m * draw(st.integers(1, 3))
    s = t * draw(st.sampled_from([16, 64, 256]))
    b = draw(st.integers(1, 4))
    d = draw(st.sampled_from([1, 2, 4]))
    mb = draw(st.integers(1, 12))
    model = ModelSpec(num_layers=L, hidden_size=h, num_attention_heads=a, seq_length=s,
                      vocab_size=draw(st.sampled_from([1000, 50304])), dropout=draw(st.booleans()))
    par = ParallelSpec(tp=t, pp=p, dp=d, vpp=m, sp=draw(st.booleans()) and t > 1, zero=draw(st.integers(0, 3)))
    tr = TrainingSpec(micro_batch=b, global_batch=b * d * mb, recompute=draw(st.sampled_from(["none", "selective", "full"])))
    return Config(model=model, parallel=par, training=tr)


def peak(config):
    """The allocated peak of a training step on the most loaded GPU."""
    return estimate(config).step.peak_bytes


def activations(config):
    """Activation bytes of every stage (the most loaded stage can change between plans)."""
    return [s.activations for s in estimate(config).stages]


def grows(before, after):
    return all(x < y for x, y in zip(before, after))


def not_above(before, after):
    return all(y <= x for x, y in zip(before, after))


def with_(config, section, **kw):
    data = config.model_dump()
    data[section] = {**data[section], **kw}
    if section == "training" and "micro_batch" in kw:
        data["training"]["global_batch"] = config.num_microbatches * kw["micro_batch"] * config.parallel.dp
    return Config.model_validate(data)


@settings(max_examples=150, deadline=None)
@given(configs())
def test_memory_grows_with_s_and_b(config):
    t = config.parallel.tp
    longer = with_(config, "model", seq_length=config.model.seq_length + t * 16)
    assert grows(activations(config), activations(longer))
    assert peak(longer) > peak(config)
    bigger = with_(config, "training", micro_batch=config.training.micro_batch + 1)
    assert grows(activations(config), activations(bigger))
    assert peak(bigger) > peak(config)


@settings(max_examples=150, deadline=None)
@given(configs())
def test_memory_does_not_grow_with_t(config):
    t = config.parallel.tp
    assume(config.model.num_attention_heads % (2 * t) == 0 and config.model.seq_length % (2 * t) == 0)
    wider = with_(config, "parallel", tp=2 * t)
    assert not_above(activations(config), activations(wider))
    assert peak(wider) <= peak(config)


@settings(max_examples=150, deadline=None)
@given(configs())
def test_none_ge_selective_ge_full(config):
    plans = [with_(config, "training", recompute=r) for r in ("none", "selective", "full")]
    none, sel, full = (activations(c) for c in plans)
    assert not_above(none, sel) and not_above(sel, full)
    assert peak(plans[0]) >= peak(plans[1])
    # Full recompute re-creates a layer's tensors in its backward, with the re-run layer's output
    # beside them (Megatron-LM's CheckpointFunction): with one layer per model chunk it saves
    # nothing and its peak is one output above selective's; from two layers on it is not above.
    if config.layers_per_chunk >= 2:
        assert peak(plans[1]) >= peak(plans[2])


@settings(max_examples=150, deadline=None)
@given(configs())
def test_sequence_parallelism_never_adds_memory(config):
    assume(config.parallel.tp > 1)
    on, off = with_(config, "parallel", sp=True), with_(config, "parallel", sp=False)
    assert not_above(activations(off), activations(on))
    assert peak(on) <= peak(off)


@given(st.integers(1, 128), st.integers(1, 16))
def test_interleaving_factor_at_least_one(p, m):
    assert interleaving_factor(p, m) >= 1
    if m == 1:
        assert interleaving_factor(p, m) == 1


@settings(max_examples=100, deadline=None)
@given(configs())
def test_most_loaded_is_max_over_stages(config):
    est = estimate(config)
    assert est.step.peak_bytes == max(s.peak_bytes for s in est.steps)
    # the first stage never holds fewer activations than any later stage's layers (1F1B / interleaved)
    layer_ids = {t.id for t in est.inventory.terms if t.scope == "layer"}
    per_stage = [sum(v for k, v in s.term_bytes.items() if k in layer_ids) for s in est.stages]
    assert per_stage == sorted(per_stage, reverse=True)
