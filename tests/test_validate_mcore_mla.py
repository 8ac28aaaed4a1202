"""CI: multi-head latent attention (memplan/inventory/mla.py) against megatron-core 0.16.1's own MLASelfAttention, on CPU.

validation/mcore.py builds the Llama-like local-spec layer with megatron-core's MLASelfAttention and its latent norms
(a = 4 heads, d_n = 32, d_r = 16, d_v = 24, r_kv = 48, r_q = 40 or the direct q projection), labels every saved tensor
and compares with memplan per term (0.01 %: the measurement is exact). t = 1 in one process: with and without the
q latent, recompute none / selective / full, and with megatron-core's MoELayer as the MLP (DeepSeek-V3's layer);
t = 2 with and without SP (two gloo processes, slow).
"""

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from mcore_checks import assert_exact, term_ids, unchecked_terms  # noqa: E402
from memplan.check.cases import mcore_mla_case  # noqa: E402
from memplan.check.validate import run  # noqa: E402

T1 = [mcore_mla_case(), mcore_mla_case(None), mcore_mla_case(recompute="selective"),
      mcore_mla_case(recompute="full"), mcore_mla_case(experts=4)]
T2 = [mcore_mla_case(t=2), mcore_mla_case(t=2, sp=True), mcore_mla_case(t=2, sp=True, recompute="selective")]


@pytest.fixture(scope="module")
def t1_results(announce):
    with announce(f"measuring {len(T1)} megatron-core MLA cases (one process)"):
        return run(T1, "cpu")


def _check(results):
    assert_exact(results)
    for r in results:
        assert r.case.recompute == "full" or any(k.startswith("mla_") for k in r.measured), r.case.name


def test_mla_layer_matches_megatron_core(t1_results):
    _check(t1_results)


@pytest.mark.slow
def test_mla_layer_t2_matches_megatron_core(announce):
    with announce(f"measuring {len(T2)} megatron-core MLA cases at t = 2 (two gloo processes)"):
        _check(run(T2, "cpu"))


def test_mla_terms_by_hand(t1_results):
    # s = 32, b = 2 (64 tokens), h = 64, a = 4, d_n = 32, d_r = 16, d_v = 24, r_q = 40, r_kv = 48, bf16 activations:
    # attention input 64 x 64 x 2 = 8,192; q latent norm on CPU (F.rms_norm composite): fp32 copy 64 x 40 x 4 = 10,240,
    # rstd 64 x 4 = 256, fp32 normalised 10,240, the up projection's bf16 input 64 x 40 x 2 = 5,120; kv latent (48):
    # 12,288, 256, 12,288 and 6,144; RoPE cos and sin for Q and K: 4 x 32 x 16 x 2 = 4,096; Q and K 64 x 4 x 48 x 2 =
    # 24,576 each and V 64 x 4 x 24 x 2 = 12,288 (measured as one label, 61,440); the output projection's input
    # 64 x 96 x 2 = 12,288; the softmax 2 x 4 x 32 x 32 x 2 = 16,384
    r = t1_results[0]
    expected = {"qkv_input": 8_192, "mla_q_fp32_latent": 10_240, "mla_q_norm_stats": 256, "mla_q_normed": 10_240,
                "mla_q_up_input": 5_120, "mla_kv_fp32_latent": 12_288, "mla_kv_norm_stats": 256,
                "mla_kv_normed": 12_288, "mla_kv_up_input": 6_144, "rope_cos_sin": 4_096, "qkv": 61_440,
                "proj_input": 12_288, "softmax_out": 16_384}
    assert {k: r.measured[k] for k in expected} == expected
    # without the q latent (linear_q_proj from h) no q norm or q up projection is kept
    assert not any(k.startswith("mla_q_") for k in t1_results[1].measured)


def test_every_mla_term_is_checked(monkeypatch, t1_results):
    """Each latent-attention term of the megatron-local inventory (CPU), removed, makes a case fail."""
    ids = term_ids(t1_results, lambda t: t.block == "latent attention")
    assert {"mla_q_up_input", "mla_kv_up_input", "qk", "v", "proj_input", "rope_cos_sin"} <= ids
    unchecked = unchecked_terms(monkeypatch, t1_results, ids)
    assert unchecked == []
