"""Traced inventories (memplan/inventory/traced.py) against the hand-written, measured ones.

validation/trace.py traces transformers' real Llama code under FakeTensorMode; memplan reads the
file like any inventory. For Llama the hand-written inventory of terms_hf.py is measured exactly
(tests/test_validate_hf.py, step peaks in tests/test_validate_peak.py), so a traced Llama must give
the same retained bytes through estimate, and a step peak (from the traced transients) within 0.05 %
of the hand inventory's, with and without gradient checkpointing. Needs torch and transformers (the test extra)."""

import json

import pytest
import yaml

pytest.importorskip("transformers")

from memplan.core.errors import MemplanError  # noqa: E402
from memplan.plan.estimate import estimate  # noqa: E402
from memplan.presets.batch import make_config  # noqa: E402
from memplan.presets.files import ModelPreset  # noqa: E402
from memplan.presets.hf_config import read_hf_config  # noqa: E402
from memplan.inventory.traced_file import file_name, read_traced  # noqa: E402
from validation.trace import trace_hf_config  # noqa: E402

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
         "intermediate_size": 688, "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 2,
         "vocab_size": 1000, "max_position_embeddings": 4096, "hidden_act": "silu", "rms_norm_eps": 1e-5,
         "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def traced_llama(tmp_path_factory):
    """A directory with the config and its traced sdpa and eager inventories (CPU kernels)."""
    d = tmp_path_factory.mktemp("traced-llama")
    (d / "config.json").write_text(json.dumps(LLAMA))
    for impl in ("hf-sdpa", "hf-eager"):
        data = trace_hf_config(LLAMA, impl=impl, kernels="cpu")
        (d / file_name(impl, "cpu")).write_text(yaml.safe_dump(data, sort_keys=False))
    return d


def _config(model, s, b, recompute):
    # bf16 weights, gradients and AdamW states: the training loop validation/step.py measures transformers in
    return make_config(ModelPreset(model), training=dict(micro_batch=b, recompute=recompute, precision="bf16-true"),
                       model=dict(seq_length=s))


@pytest.mark.parametrize("impl", ["hf-sdpa", "hf-eager"])
@pytest.mark.parametrize("s, b, recompute", [(64, 2, "none"), (128, 3, "none"), (128, 2, "full")])
def test_traced_llama_equals_the_measured_inventory(traced_llama, impl, s, b, recompute):
    hand = read_hf_config(str(traced_llama / "config.json")).model
    assert hand.inventory is None  # Llama keeps its hand-written inventory
    traced = hand.model_copy(update={"inventory": str(traced_llama)})
    want = estimate(_config(hand, s, b, recompute), impl=impl, device="cpu")
    got = estimate(_config(traced, s, b, recompute), impl=impl, device="cpu")
    assert got.inventory.origin.startswith("traced from transformers")
    assert got.stages[0].activations == want.stages[0].activations
    # the traced file's transients (validation/transients.py) against the hand inventory's measured moments
    # (tests/test_validate_peak.py: within 0.1 % of real steps): the same phase, bytes within 0.05 %
    assert "transients traced" in got.inventory.origin
    assert abs(got.step.peak_bytes - want.step.peak_bytes) <= 5e-4 * want.step.peak_bytes
    assert got.step.peak_event.phase == want.step.peak_event.phase


def test_traced_file_errors_name_the_file_and_field(traced_llama, tmp_path):
    data = yaml.safe_load((traced_llama / file_name("hf-sdpa", "cpu")).read_text())
    data["layer_groups"][0]["terms"][0]["bytess"] = "1 s b"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(MemplanError, match=r"bad\.yaml.*bytess"):
        read_traced(bad)
    data = yaml.safe_load((traced_llama / file_name("hf-sdpa", "cpu")).read_text())
    data["outside"][0]["elements"] = "3 s h"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(MemplanError, match="only s and b"):
        read_traced(bad)


@pytest.mark.slow
@pytest.mark.parametrize("name, impl, moments", [("qwen2.5-7b", "hf-sdpa", True), ("gemma2-9b", "hf-eager", False),
                                                 ("mixtral-8x7b", "hf-sdpa", False)])
def test_shipped_traces_match_the_code(name, impl, moments):
    """A shipped traced inventory is what transformers' code saves today: re-traced, it is the same
    file (python -m validation.traced_presets regenerates them all when the code changes). Every shipped
    file holds the step's transients (format /2); one is re-traced with them (about a minute), the others
    for their saved tensors only (the file without its `moments` and `checkpoint` sections)."""
    from validation.traced_presets import ROOT, same_trace, trace_one

    shipped = ROOT / name / file_name(impl, "cpu")
    assert shipped.is_file(), f"{shipped} is not shipped"
    data = yaml.safe_load(shipped.read_text())
    assert "moments" in data and "checkpoint" in data
    if not moments:
        data = {k: v for k, v in data.items() if k not in ("moments", "checkpoint")}
    assert same_trace(data, yaml.safe_load(trace_one(ROOT / name, impl, "cpu", moments=moments)))


def test_every_shipped_config_has_its_traces():
    """Each configs/traced/<name>/ holds the traces of every implementation transformers offers for
    it (Gemma 2 has no sdpa attention in transformers 5.x: eager only), and the estimate of each
    shipped preset reads them (no torch needed)."""
    from memplan.presets.catalog import load_model
    from memplan.presets.files import configs_dir

    root = configs_dir() / "traced"
    for d in sorted(p.parent for p in root.glob("*/config.json")):
        files = {p.name for p in d.glob("hf-*.yaml")}  # beside them a preset may have its plan.yaml
        assert file_name("hf-eager", "cpu") in files, d
        assert file_name("hf-sdpa", "cpu") in files or d.name.startswith("gemma2"), d
        for f in files:
            read_traced(d / f)
        preset = load_model(d.name)
        assert preset.model.inventory == str(d)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "gemma3", "phi3"])
def test_a_trace_holds_at_micro_batch_one(family):
    """Traces hold for b >= 2 (torch's symbolic shapes treat size 1 apart), and estimate uses them at
    b = 1, the commonest micro-batch, saying so. Real CPU runs at b = 1 keep exactly 8 bytes more
    than the polynomials give (cross_entropy keeps one more int64 label id), whatever s is."""
    from validation.trace_config import FAMILIES
    from validation.trace_measure import measure_hf_config, predicted_bytes

    config, _ = FAMILIES[family]
    inventory = trace_hf_config(config, impl="hf-sdpa", kernels="cpu", moments=False)
    assert "b >= 2" in inventory["conditions"]
    for s in (16, 40):
        measured = measure_hf_config(config, s, 1, impl="hf-sdpa")["total"]
        assert measured - predicted_bytes(inventory, s, 1)["total"] == 8


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3", "qwen2"])
def test_traced_estimate_equals_a_real_run(family, tmp_path):
    """estimate's retained activations for a traced model are what the real model saves on CPU
    (every saved storage once, measured with saved_tensors_hooks). Gemma 3 has two kinds of layer
    (sliding-window and global attention, each with its own rope tables): two layer groups, each
    weighted by its share of the layers, must still add up exactly."""
    from validation.trace_config import FAMILIES
    from validation.trace_measure import measure_hf_config

    config, _ = FAMILIES[family]
    arch = {"gemma3": "Gemma3ForCausalLM", "qwen2": "Qwen2ForCausalLM"}[family]
    config = {**config, "architectures": [arch]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    data = trace_hf_config(config, impl="hf-sdpa", kernels="cpu")
    assert (len(data["layer_groups"]) > 1) == (family == "gemma3")
    (tmp_path / file_name("hf-sdpa", "cpu")).write_text(yaml.safe_dump(data, sort_keys=False))
    model = read_hf_config(str(tmp_path / "config.json")).model.model_copy(update={"inventory": str(tmp_path)})
    for s, b in ((32, 2), (48, 3)):
        est = estimate(_config(model, s, b, "none"), impl="hf-sdpa", device="cpu")
        assert est.stages[0].activations == measure_hf_config(config, s, b, impl="hf-sdpa")["total"], (s, b)
    # the timeline and the report key terms by id: the groups' terms must not collide
    ids = [t.id for t in est.inventory.terms]
    assert len(set(ids)) == len(ids)


@pytest.mark.slow
def test_validate_covers_the_traced_families_and_fails_without_a_term():
    """memplan validate --hf checks every traced family's inventory, as memplan reads it, against a real
    run per decoder layer (all 22 cases pass exactly: `memplan validate --hf`); here Qwen2 and Gemma 3 at
    one shape, and the same Gemma 3 case with one saved tensor of its first layer group removed fails."""
    from memplan.check.cases import traced_grid
    from memplan.check.validate import compare_traced, run_traced
    from validation.trace_config import FAMILIES
    from validation.trace_measure import measure_hf_config

    grid = traced_grid()
    assert {c.arch for c in grid} == set(FAMILIES)
    cases = [c for c in grid if c.arch in ("qwen2", "gemma3") and c.s == 16]
    results = run_traced(cases)
    assert len(results) == 2 and all(r.passed and r.error == 0 for r in results)
    case = cases[1]
    cfg, impl = FAMILIES["gemma3"]
    data = trace_hf_config(cfg, impl=impl, kernels="cpu", moments=False)
    data["layer_groups"][0]["terms"].pop(3)
    broken = compare_traced(case, data, measure_hf_config(cfg, case.s, case.b, impl=impl))
    assert not broken.passed and broken.mismatched
