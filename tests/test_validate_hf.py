"""transformers' own GPT-2 and Llama code (eager and sdpa), built from a config with no weights,
measured with the saved-tensor ledger and compared per layer with memplan's hf-* inventories.
Tolerance 1 % per layer (the predictions are in fact exact)."""

import dataclasses

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from memplan.inventory import assemble as inventory  # noqa: E402
from memplan.check.cases import hf_grid  # noqa: E402
from memplan.check.validate import predict, run  # noqa: E402


@pytest.fixture(scope="module")
def hf_results(announce):
    cases = hf_grid(fake=True)
    with announce(f"measuring {len(cases)} transformers layers and models"):
        return run(cases, "cpu")


def test_hf_models_match_memplan(hf_results):
    failed = [(r.case, r.mismatched, r.error) for r in hf_results if not r.passed]
    assert not failed, failed
    kinds = {(r.case.impl, r.case.arch, r.case.scope) for r in hf_results}
    for impl in ("hf-eager", "hf-sdpa"):
        for arch in ("gpt2", "llama"):
            assert {(impl, arch, "layer"), (impl, arch, "model")} <= kinds


def test_llama3_8b_layer_eager_vs_sdpa(hf_results):
    # One llama3-8b layer at s = 4096, b = 1 (h = 4096, a = 32, g = 8, f = 14336), measured under
    # FakeTensorMode. Eager keeps the fp32 softmax (4as^2b = 2 GiB) and its bf16 copy (2as^2b), sdpa
    # neither: by hand, eager - sdpa = 6as^2b - 4asb + (2sbh - 2sbh g/a) * 2 (K, V repeated to a heads)
    s, h, a, g = 4096, 4096, 32, 8
    eager = next(r for r in hf_results if r.case.name.startswith("llama3-8b") and r.case.impl == "hf-eager")
    sdpa = next(r for r in hf_results if r.case.name.startswith("llama3-8b") and r.case.impl == "hf-sdpa")
    assert eager.measured_total - sdpa.measured_total == 6 * a * s * s - 4 * a * s + 2 * (2 * s * h - 2 * s * h * g // a)


@pytest.mark.parametrize("term_id", ["up_out", "gelu_tanh_out", "ln1_fp32_input"])
def test_removing_a_term_fails(hf_results, monkeypatch, term_id):
    original = inventory.inventory_for

    def without(model, impl="megatron", device="cuda"):
        inv = original(model, impl, device)
        return dataclasses.replace(inv, terms=tuple(t for t in inv.terms if t.id != term_id))

    monkeypatch.setattr(inventory, "inventory_for", without)
    # what `run(cases, "cpu")` gives without the term: memplan's prediction now against the grid's measurement of
    # the same (deterministic) layer, not measured again
    measured = {r.case: r for r in hf_results}
    cases = [c for c in hf_grid(fake=False) if c.scope == "layer"]
    assert cases and all(c in measured for c in cases)
    results = [dataclasses.replace(measured[c], predicted=predict(c, "cpu")) for c in cases]
    failed = [r for r in results if not r.passed]
    assert failed and all(any(label == term_id for label, _, _ in r.mismatched) for r in failed)
