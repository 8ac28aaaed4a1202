"""Traced transients (validation/transients.py, format memplan-traced-inventory/2): the moments of a
shipped traced inventory in the step timeline (no torch needed), the file checks, and the pruning rule
of the tracer. Whole steps against real CPU runs: tests/test_validate_peak.py (the traced families)."""

from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.core.errors import MemplanError
from memplan.memory.stage import stage_memory
from memplan.memory.term_bytes import PlanValues
from memplan.presets.batch import make_config
from memplan.presets.catalog import load_model
from memplan.presets.files import configs_dir
from memplan.inventory.assemble import inventory_for
from memplan.memory.timeline import step_events
from memplan.inventory.traced_file import file_name, read_traced

TRACED = configs_dir() / "traced"
# presets whose shipped files have the traced transients (format /2): Gemma 3's two kinds of layers
WITH_MOMENTS = ("gemma3-1b", "qwen2.5-7b")


def test_shipped_files_with_transients():
    for name in WITH_MOMENTS:
        for impl in ("hf-sdpa", "hf-eager"):
            traced = read_traced(TRACED / name / file_name(impl, "cpu"))
            assert traced.format.endswith("/2") and traced.moments and traced.checkpoint is not None
            # moments of the layers without recompute and of recomputed layers, of every layer group, and of the head
            for k, group in enumerate(traced.layer_groups):
                for recompute in ("none", "full"):
                    covered = {i for m in traced.moments if m.group == k and m.recompute == recompute for i in m.layers}
                    assert covered == set(group.layers), (name, impl, k, recompute)
            assert any(m.scope == "last" for m in traced.moments)


@st.composite
def plans(draw):
    name = draw(st.sampled_from(WITH_MOMENTS))
    model = load_model(name).model
    recompute = draw(st.sampled_from(["none", "full"]))
    k = draw(st.integers(1, model.num_layers)) if recompute == "full" else None
    b, M, d = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.sampled_from([1, 2]))
    config = make_config(load_model(name), training=dict(micro_batch=b, global_batch=b * M * d, recompute=recompute,
                                             recompute_num_layers=k,
                                             precision=draw(st.sampled_from(["bf16-true", "bf16-mixed"]))),
                         model=dict(seq_length=draw(st.sampled_from([512, 4096, 32768]))),
                         parallel=dict(dp=d, zero=draw(st.integers(0, 3)) if d > 1 else 0))
    return config, draw(st.sampled_from(["hf-sdpa", "hf-eager"]))


@settings(max_examples=40, deadline=None)
@given(plans())
def test_critical_moments_equal_the_walk_with_layer_groups(case):
    """A traced moment happens in its layers only (Gemma 3: sliding and global layers apart): the planner's
    critical positions (the first and last layer of each group in and outside the recomputed block) give the
    walk's maximum over every layer."""
    config, impl = case
    inv = inventory_for(config.model, impl, "cpu")
    assert "transients traced" in inv.origin
    plan = PlanValues.from_config(config)
    mem = stage_memory(config.model, inv.terms, config.training, plan, 0, granularity=inv.granularity)
    walk = step_events(config.model, inv, config.training, plan, mem, 0)
    critical = step_events(config.model, inv, config.training, plan, mem, 0, critical=True)
    assert critical.peak_bytes == walk.peak_bytes == max(e.bytes for e in walk.events)


def test_a_layer_moment_happens_in_its_layers_only():
    """Gemma 3 1B's sliding and global layers trace apart (two layer groups, global every sixth layer): with
    every layer recomputed, the walk's backward of each layer has the events of its own group's moments."""
    config = make_config(load_model("gemma3-1b"), training=dict(micro_batch=1, recompute="full", precision="bf16-true"),
                         model=dict(seq_length=4096))
    inv = inventory_for(config.model, "hf-sdpa", "cpu")
    traced = read_traced(Path(config.model.inventory) / file_name("hf-sdpa", "cpu"))
    groups = {i: k for k, g in enumerate(traced.layer_groups) for i in g.layers}
    assert len(set(groups.values())) == 2
    plan = PlanValues.from_config(config)
    mem = stage_memory(config.model, inv.terms, config.training, plan, 0, granularity=inv.granularity)
    walk = step_events(config.model, inv, config.training, plan, mem, 0)
    # each layer's backward events are its group's moments only, and the groups' moments differ
    assert any(m.layers and set(m.layers) != set(groups) for m in inv.moments if m.scope == "layer")
    per_layer = {}
    for e in walk.events:
        if e.phase == "backward" and e.layer is not None:
            per_layer.setdefault(e.layer, 0)
            per_layer[e.layer] += 1
    moments_of = {i: sum(1 for m in inv.moments if m.scope == "layer" and m.applies == "recomputed"
                         and (not m.layers or i in m.layers)) for i in groups}
    assert all(per_layer[i + 1] == moments_of[i] for i in groups)


def test_a_moment_naming_an_unknown_save_is_refused(tmp_path):
    data = yaml.safe_load((TRACED / "qwen2.5-7b" / file_name("hf-sdpa", "cpu")).read_text())
    layer = next(m for m in data["moments"] if m["scope"] == "layer" and m["alive"])
    layer["alive"][0] = "self_attn.no_such_op.0"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(MemplanError, match=r"bad\.yaml.*no_such_op"):
        read_traced(bad)
    data["moments"] = [dict(layer, group=7, alive=[])]
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(MemplanError, match="group"):
        read_traced(bad)


def test_pruning_keeps_what_can_be_the_peak():
    """A candidate is dropped only when another has at least its bytes for every s, b >= 2, activations of 2
    or 4 bytes, with or without its gradients (coefficients of p(2 + x, 2 + y)): hand-made vectors."""
    transients = pytest.importorskip("validation.transients")
    from fractions import Fraction

    def vec(act: dict, grad: int = 0) -> dict:  # act: {(i, j): coefficient of s^i b^j} in bytes, shifted here
        out = {}
        for (p, q), c in act.items():
            for i in range(p + 1):
                for j in range(q + 1):
                    from math import comb
                    out[("act", i, j)] = out.get(("act", i, j), 0) + Fraction(c) * comb(p, i) * 2 ** (p - i) \
                        * comb(q, j) * 2 ** (q - j)
        out[("grad",)] = Fraction(grad)
        return out

    # 100 s b >= 99 s b + 1 for s b >= 4, though not coefficient by coefficient in s, b
    assert transients.dominates(vec({(1, 1): 100}), vec({(1, 1): 99, (0, 0): 1}))
    # s^2 b and 64 s b cross at s = 64: neither can be dropped
    assert not transients.dominates(vec({(2, 1): 1}), vec({(1, 1): 64}))
    assert not transients.dominates(vec({(1, 1): 64}), vec({(2, 1): 1}))
    # more bytes but fewer gradients: both kept (with gradient accumulation the gradients exist anyway)
    assert not transients.dominates(vec({(1, 1): 10}), vec({(1, 1): 9}, grad=100))
    front = transients.Front()
    for v in (vec({(1, 1): 9}), vec({(1, 1): 10}), vec({(2, 1): 1}), vec({(1, 1): 8})):
        front.offer(v, lambda v=v: v)
    assert [v for v, _ in front.items] == [vec({(1, 1): 10}), vec({(2, 1): 1})]


_COEF = st.one_of(st.integers(-50, 50), st.fractions(min_value=-50, max_value=50, max_denominator=64))
_VECTOR = st.dictionaries(st.tuples(st.sampled_from(("act", "other")), st.integers(0, 2), st.integers(0, 2)),
                          _COEF, max_size=6).flatmap(
    lambda v: st.integers(0, 100).map(lambda g: {**v, ("grad",): g}))


@settings(max_examples=100, deadline=None)
@given(_VECTOR, _VECTOR)
def test_dominance_is_every_case_of_its_rule(a, b):
    """The one-pass test equals its rule written case by case: a - b has no negative shifted coefficient
    for activations of 2 or 4 bytes (scale 1 or 2) and gradients of 0 or 4 bytes each (ints and fractions,
    as the tracer's sums of sizes mix them)."""
    transients = pytest.importorskip("validation.transients")
    keys = {k[1:] for k in a.keys() | b.keys() if k[0] != "grad"} | {(0, 0)}

    def diff(k, scale, grad_bytes):
        d = scale * (a.get(("act", *k), 0) - b.get(("act", *k), 0)) + a.get(("other", *k), 0) \
            - b.get(("other", *k), 0)
        return d + (grad_bytes * (a[("grad",)] - b[("grad",)]) if k == (0, 0) else 0)

    rule = all(diff(k, scale, g) >= 0 for scale in (1, 2) for g in (0, 4) for k in keys)
    assert transients.dominates(a, b) == rule
