"""CI: the Megatron MoE inventory (memplan/inventory/moe.py) against megatron-core 0.16.1's own MoELayer, on CPU.

validation/mcore.py builds the Llama-like local-spec layer with megatron-core's MoELayer as its MLP (4
SequentialMLP experts, f_e = 96, top-2, aux loss 0.01), routing forced to be exactly balanced (token i to experts
(2i + j) mod 4: the routed-token counts are known, not data-dependent; Megatron-LM's router options: no aux loss,
z-loss, fp32 router, pre-softmax at k = 1, GeLU experts), labels every saved tensor and compares with
memplan per term (0.01 %: the measurement is exact). t = 1: alltoall and allgather dispatchers, capacity factor with
and without padding, shared experts (one process); ep = 2, and t = 2 with SP and etp = 2 / 1, with both dispatchers
(two gloo processes, slow).
"""

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from mcore_checks import assert_exact, term_ids, unchecked_terms  # noqa: E402
from memplan.check.cases import mcore_moe_cases  # noqa: E402
from memplan.check.validate import CaseResult, predict, run  # noqa: E402
from memplan.inventory import moe  # noqa: E402

# the cases of `validate --mcore`: dispatchers, capacity, shared experts, Megatron-LM's router options (one process);
# two processes: ep = 2, or t = 2 with SP and expert tensor parallelism etp = 2 (the experts' MLPs split) or 1
T1, EP2 = mcore_moe_cases(), mcore_moe_cases(two=True)


@pytest.fixture(scope="module")
def t1_results(announce):
    with announce(f"measuring {len(T1)} megatron-core MoE cases (one process)"):
        return run(T1, "cpu")


@pytest.fixture(scope="module")
def ep2_results(announce):
    with announce(f"measuring {len(EP2)} megatron-core MoE cases at ep = 2 or t = 2 (two gloo processes)"):
        return run(EP2, "cpu")


def _check(results):
    assert_exact(results)
    for r in results:
        assert any(k.startswith("moe_") for k in r.measured), r.case


def test_moe_layer_matches_megatron_core(t1_results):
    _check(t1_results)


@pytest.mark.slow
def test_moe_layer_ep2_t2_matches_megatron_core(ep2_results):
    _check(ep2_results)


def test_moe_terms_by_hand(t1_results):
    # s = 32, b = 2 (64 tokens), h = 64, E = 4, k = 2, f_e = 96, bf16, balanced: 128 routed copies, 32 per expert.
    # router: top-k indices 64 x 2 int64 = 1,024; softmax of the k logits 64 x 2 fp32 = 512; aux loss: scores
    # 64 x 4 fp32 = 1,024, tokens per expert 4 int64 = 32, the loss 4; routing map 4 x 64 bool = 256; probabilities
    # scattered 4 x 64 bf16 = 512; permutation index 128 int64 = 1,024; routed tokens 128 x 64 bf16 = 16,384, their
    # probabilities 128 bf16 = 256; experts (unfused SwiGLU on CPU): fc1 output 128 x 192 bf16 = 49,152, then four
    # 128 x 96 bf16 tensors (up, SiLU, product, fc2 input) = 4 x 24,576
    r = next(r for r in t1_results if r.case.dispatcher == "alltoall" and r.case.capacity is None and not r.case.fs)
    moe = {k: v for k, v in r.measured.items() if k.startswith("moe_")}
    assert moe == {"moe_topk_indices": 1_024, "moe_topk_probs": 512, "moe_aux_scores": 1_024, "moe_aux_counts": 32,
                   "moe_aux_loss": 4, "moe_routing_map": 256, "moe_probs_dense": 512, "moe_permute_index": 1_024,
                   "moe_permuted_tokens": 16_384, "moe_permuted_probs": 256, "moe_fc1_output": 49_152,
                   "moe_swiglu_up": 24_576, "moe_silu_out": 24_576, "moe_act_out": 24_576, "moe_fc2_input": 24_576}
    # capacity factor 0.5, no padding: each expert keeps 16 of its 32 tokens (routed terms halved), and the token
    # dropping keeps a second routing map
    half = next(r for r in t1_results if r.case.capacity == 0.5)
    assert half.measured["moe_permuted_tokens"] == 16_384 // 2 and half.measured["moe_routing_map"] == 2 * 256


def test_router_options_by_hand(t1_results):
    # the same layer (64 tokens, E = 4, k = 2, bf16); what Megatron-LM's router options change, from the code
    # (megatron-core 0.16.1 router.py / moe_utils.py) and measured here
    def moe(**kw):
        r = next(r for r in t1_results if all(getattr(r.case, k) == v for k, v in kw.items()) and not r.case.fs)
        return {k: v for k, v in r.measured.items() if k.startswith("moe_")}

    # --moe-aux-loss-coeff 0 (Megatron-LM's default): none of the aux loss's tensors
    assert not {k for k in moe(aux_loss=0.0, topk=2) if k.startswith("moe_aux")}
    # --moe-z-loss-coeff: logsumexp keeps the logits 64 x 4 and its output 64, here in fp32 (--moe-router-dtype
    # fp32): 1,024 + 256 B, and the loss 4 B; the probabilities in fp32: scattered 4 x 64 x 4 B = 1,024, the routed
    # copies' 128 x 4 B = 512 (bf16: 512 and 256)
    z = moe(z_loss=1e-3)
    assert (z["moe_z_logits"], z["moe_z_lse"], z["moe_z_loss"]) == (1_024, 256, 4)
    assert (z["moe_probs_dense"], z["moe_permuted_probs"]) == (1_024, 512)
    # --moe-router-pre-softmax at k = 1: the fp32 softmax of all 4 logits, 64 x 4 x 4 B = 1,024 (not the k = 1
    # chosen: 256); 64 routed copies: tokens 64 x 64 x 2 B = 8,192
    pre = moe(pre_softmax=True)
    assert (pre["moe_topk_probs"], pre["moe_topk_indices"], pre["moe_permuted_tokens"]) == (1_024, 512, 8_192)
    # GeLU experts: fc1's output 128 x 96 bf16 = 24,576 (not 2 f_e wide), the GeLU output kept by the
    # probabilities' multiply 24,576, fc2's input 24,576; no SwiGLU intermediates
    r = next(r for r in t1_results if r.case.gelu)
    g = {k: v for k, v in r.measured.items() if k.startswith(("moe_", "shared_"))}
    assert (g["moe_fc1_output"], g["moe_act_out"], g["moe_fc2_input"]) == (24_576,) * 3
    assert "moe_swiglu_up" not in g and "moe_silu_out" not in g and "shared_swiglu_up" not in g


def test_every_moe_term_is_checked(monkeypatch, t1_results):
    """Each MoE term of the megatron-local inventory (CPU) the cases hold, removed, makes a case fail."""
    ids = term_ids(t1_results, lambda t: t.block.startswith("MoE"))
    assert {"moe_permuted_tokens", "moe_fc1_output", "moe_fc2_input", "shared_fc1_output", "moe_z_logits",
            "moe_z_lse", "moe_aux_scores"} <= ids
    unchecked = unchecked_terms(monkeypatch, t1_results, ids)
    # the aux loss and z-loss values are one scalar per layer: 4 bytes, within 0.01 % of any case
    assert set(unchecked) <= {"moe_aux_loss", "moe_z_loss"}, unchecked


def test_capacity_drops_per_expert(monkeypatch, t1_results):
    # uneven routing (validation/mcore_cpu.py LOADS): of the 64 tokens x top-2 = 128 copies, experts 0-3 receive 56, 40,
    # 16, 16 (1.75, 1.25, 0.5, 0.5 x the average 32). Capacity factor 1: megatron-core 0.16.1's
    # apply_router_token_dropping keeps ceil(128 / 4 x 1) = 32 per expert: 32 + 32 + 16 + 16 = 96 copies, 96 x 64 bf16
    # = 12,288 B of routed tokens (a per-GPU bound, min(imbalance 1, C 1) at ep = 1, would keep all 128: 16,384 B)
    r = next(r for r in t1_results if r.case.loads and r.case.capacity == 1.0)
    assert r.measured["moe_permuted_tokens"] == 96 * 64 * 2 and r.measured["moe_permute_index"] == 96 * 8
    # without a capacity the same routing keeps all 128 copies on the one GPU
    free = next(r for r in t1_results if r.case.loads and r.case.capacity is None)
    assert free.measured["moe_permuted_tokens"] == 128 * 64 * 2
    # the per-expert capacity removed (each expert's load averaged before the cap: the per-GPU bound) fails the case
    monkeypatch.setattr(moe, "_kept", lambda loads, cap: min(sum(loads) / len(loads), cap or float("inf")))
    assert not CaseResult(r.case, predict(r.case, "cpu"), r.measured, 0, None, None, r.tolerance).passed


def test_expert_loads_refused_when_inconsistent():
    from memplan.core.model import ModelSpec

    base = dict(name="m", num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=256,
                norm="rmsnorm", mlp="swiglu", position_embedding="rope", tied_embeddings=False, bias=False,
                num_experts=4, moe_top_k=2)
    for loads, extra, words in (((1.0, 1.0, 1.0), {}, "dividing"), ((2.5, 1.5), {}, "exceeds E / k"),
                                ((1.5, 0.5), {"moe_imbalance": 1.5}, "give one")):
        with pytest.raises(ValueError, match=words):
            ModelSpec(**base, moe_expert_loads=loads, **extra)
    # the loads are the busiest GPU's E/ep experts': 4 loads at ep = 2 refused, 2 taken
    from memplan.core.specs import Config, ParallelSpec

    with pytest.raises(ValueError, match="E/ep = 2"):
        Config(model=ModelSpec(**base, moe_expert_loads=(1.75, 1.25, 0.5, 0.5)), parallel=ParallelSpec(ep=2, dp=2))
    assert Config(model=ModelSpec(**base, moe_expert_loads=(1.75, 1.25)), parallel=ParallelSpec(ep=2, dp=2))
