"""CI: the megatron-local inventory against megatron-core 0.16.1's own local-spec code, run on CPU.

validation/mcore.py builds megatron-core's TransformerBlock / GPTModel from get_gpt_layer_local_spec (GPT:
LayerNorm, GeLU, learned positions, dropout 0.1; Llama-like: RMSNorm, SwiGLU, RoPE, 4 heads in 2 KV groups,
no dropout), labels every tensor autograd saves and compares with memplan per term (0.01 %: the measurement is exact). A small subset
runs here (one spawned process for t = 1, two gloo processes for t = 2); `memplan validate --mcore` runs
the whole grid (t = 1, 2, SP on / off, recompute none / selective / full, layer and model: 42 cases).
"""

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from mcore_checks import assert_exact, term_ids, unchecked_terms  # noqa: E402
from memplan.check.cases import mcore_case  # noqa: E402
from memplan.check.validate import case_model, predict, run  # noqa: E402
from memplan.inventory.assemble import inventory_for  # noqa: E402

T1 = [mcore_case("gpt", recompute=r) for r in ("none", "selective", "full")] + [
    mcore_case("gpt", scope="model", backend="live"),
    *(mcore_case("llama", recompute=r) for r in ("none", "selective", "full")),
    mcore_case("llama", scope="model", recompute="full"),
]
T2 = [mcore_case("gpt", 2, True, "selective", "model"), mcore_case("gpt", 2, False, "none"),
      mcore_case("llama", 2, True, "none"), mcore_case("llama", 2, True, "full", "model")]


@pytest.fixture(scope="module")
def t1_results(announce):
    with announce(f"measuring {len(T1)} megatron-core cases (one process)"):
        return run(T1, "cpu")


@pytest.fixture(scope="module")
def t2_results(announce):
    with announce(f"measuring {len(T2)} megatron-core cases (two gloo processes)"):
        return run(T2, "cpu")


def _check(results):
    assert_exact(results)
    assert all(r.measured_total > 0 for r in results)


def test_t1_matches_megatron_core(t1_results):
    _check(t1_results)
    live = [r for r in t1_results if r.case.backend == "live"]
    assert live and all(r.retained_after_forward == r.predicted_total for r in live)


@pytest.mark.slow
def test_t2_matches_megatron_core(t2_results):
    _check(t2_results)


def test_gpt_layer_by_hand(t1_results):
    # s = 32, b = 2, h = 64, a = 4, f = 4h, bf16 on CPU, no recompute; hand derivation of what megatron-core keeps:
    # K22's 34sbh + 5as^2b = 34 * 4096 + 5 * 4 * 32^2 * 2 = 180,224 with 1-byte masks; on CPU F.dropout's masks are
    # bf16: + 2sbh (two hidden-dropout masks, +1 byte per element each) + as^2b (softmax-dropout mask) = 8,192 + 8,192;
    # LayerNorm mean / rstd bf16: 2 norms * 2 * sb * 2 B = 512; the causal mask s^2 bool = 1,024
    r = next(r for r in t1_results if r.case.arch == "gpt" and r.case.scope == "layer" and r.case.recompute == "none")
    assert r.measured_total == 180_224 + 8_192 + 8_192 + 512 + 1_024


@pytest.mark.slow
def test_every_term_is_checked(monkeypatch, t1_results, t2_results):
    """Each term of the megatron-local inventory (CPU) that the measured cases hold, removed, makes a case fail."""
    results = t1_results + t2_results
    unchecked = unchecked_terms(monkeypatch, results, term_ids(results))
    # attn_mask_type is 4 bytes per layer: within 0.01 % of any case
    assert set(unchecked) <= {"attn_mask_type"}, unchecked



def test_unfused_cuda_terms_are_what_megatron_core_keeps(t1_results):
    # The tensors Megatron-LM's --no-masked-softmax-fusion / --no-bias-swiglu-fusion / --no-rope-fusion keep on
    # CUDA are the unfused code's, which megatron-core runs on CPU here: in the CUDA inventory with every fusion off
    # (validate's prediction for megatron-local on CUDA) each must have the measured bytes of the Llama-like layer;
    # removing any of them from memplan/inventory/fusions.py fails here. The fused default has none of them.
    # Selective and full recompute likewise (full keeps only the chunk's causal mask of them).
    unfused = ("causal_mask", "swiglu_up", "swiglu_silu_out", "rope_cos_sin")
    kept = {"none": set(unfused), "selective": set(unfused), "full": {"causal_mask"}}
    cases = [r for r in t1_results if r.case.arch == "llama" and r.case.scope == "layer"]
    assert sorted(r.case.recompute for r in cases) == ["full", "none", "selective"]
    for r in cases:
        cuda = predict(r.case, "cuda")
        fused = {t.id for t in inventory_for(case_model(r.case), "megatron-local", "cuda").terms}
        assert {k for k in unfused if r.measured.get(k, 0) > 0} == kept[r.case.recompute], r.case.name
        for term_id in unfused:
            assert cuda.get(term_id, 0) == r.measured.get(term_id, 0), (r.case.recompute, term_id)
            assert term_id not in fused, term_id
