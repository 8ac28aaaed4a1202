"""Megatron-LM's --cross-entropy-loss-fusion (memplan/inventory/fusions.py apply_loss_fusion) against megatron-core
0.16.1's own cross-entropy measured on CPU: tests/data/mcore_cross_entropy.json, recorded by
`PYTHONPATH=. python -m validation.mcore_loss tests/data/mcore_cross_entropy.json` (the eager
vocab_parallel_cross_entropy and the torch.compile'd fused_vocab_parallel_cross_entropy on bf16 logits [32, 2, 256],
bytes read off torch.profiler's allocation events); the slow test (opt-in: MEMPLAN_CE_SLOW=1) measures again.
TE's kernel is CUDA only: its terms are checked against a hand derivation from its code."""

import json
import os
from pathlib import Path

import pytest

from memplan.check.cases import mcore_case
from memplan.check.validate import case_model
from memplan.core.training import TrainingSpec
from memplan.inventory.assemble import training_inventory
from memplan.memory.term_bytes import PlanValues, TermBytes

DATA = Path(__file__).parent / "data" / "mcore_cross_entropy.json"
# moments' tensors that are not the cross-entropy's: the embedding's output held by GPTModel.forward (CPU), the
# output layer's input gradient
OUTSIDE = ("decoder_input", "grad_head_input")
LOSS_TERMS = ("logits_fp32", "target_ids", "target_mask", "logits_te", "cross_entropy_m_d_x_y")


def _recorded():
    return {c["fused"]: c for c in json.loads(DATA.read_text())["cases"]}


def _loss_bytes(impl, device, fusion):
    """memplan's bytes at the loss for the recorded shape (s = 32, b = 2, v = 256, t = 1): the saved loss terms and
    each loss moment's transients (the cross-entropy's own)."""
    case = _recorded()[False]
    model = case_model(mcore_case("llama"))  # h = 64, one layer's worth of loss
    assert (model.seq_length, model.vocab_size) == (case["s"], case["v"])
    inv = training_inventory(model, impl, device, TrainingSpec(cross_entropy_fusion=fusion))
    sizes = TermBytes(model, PlanValues(1, 1, 1, 1, 0, 0, 1, case["b"], 0, 1, 1), 2)
    kept = sum(sizes(t) for t in inv.terms if t.id in LOSS_TERMS)
    moments = {m.id: sum(sizes(t) for t in m.transients if t.id not in OUTSIDE) for m in inv.moments
               if m.scope == "last"}
    return inv, kept, moments


def _close(got, want, rel):
    return abs(got - want) <= rel * want


@pytest.mark.parametrize("impl, device", [("megatron-local", "cpu"), ("megatron-local", "cuda"), ("megatron", "cuda")])
def test_native_fusion_is_megatron_core_measured(impl, device):
    fused, eager = _recorded()[True], _recorded()[False]
    inv, kept, moments = _loss_bytes(impl, device, "native")
    assert inv.name.endswith("/ce-fusion:native")
    # saved for the backward: the softmax in the fp32 copy (4 B / logit), the targets; measured + the loss scalar
    assert _close(kept, fused["after_forward"], 0.001) and fused["after_forward"] == eager["after_forward"]
    # forward: the bf16 logits beside the fp32 copy that becomes the softmax, no third buffer (10 B / logit would be
    # 163,840 B here; measured 100,160 B with the small per-token tensors)
    assert _close(kept + moments["loss_forward"], fused["forward_peak"], 0.02)
    # backward: the compiled gradient is a new fp32 buffer beside the softmax, then its bf16 cast: 65,536 + 32,768 B
    # over what the forward kept (the eager path: the bf16 cast only, 32,768 B)
    assert _close(moments["cross_entropy_backward"], fused["backward_peak"] - fused["after_forward"], 0.001)
    assert fused["backward_peak"] - eager["backward_peak"] > 60_000
    # unfused: no such moment
    assert "cross_entropy_backward" not in _loss_bytes(impl, device, None)[2]


def test_te_fusion_keeps_the_bf16_logits_as_their_gradient():
    inv, kept, moments = _loss_bytes("megatron", "cuda", "te")
    s, b, v = 32, 2, 256
    # hand-derived from transformer_engine/pytorch/triton/cross_entropy.py: the bf16 logits (2 s b v, overwritten
    # by the gradient), m_d_X_y (3 fp32 per token, t = 1) and the targets (int64); no fp32 copy, no target mask
    assert kept == 2 * s * b * v + 3 * 4 * s * b + 8 * s * b
    assert moments["loss_forward"] == 0  # the logits are the saved term
    assert moments["loss_backward"] == 0  # the gradient is the saved logits' storage
    unfused = _loss_bytes("megatron", "cuda", None)[1]
    assert unfused - kept == 2 * s * b * v + s * b - 3 * 4 * s * b  # 4 -> 2 B per logit, no mask, m_d_X_y


@pytest.mark.parametrize("extra, fragment", [
    (("--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te", "--device", "cpu",
      "--transformer-impl", "local"), "CUDA only"),
    (("--cross-entropy-loss-fusion", "--impl", "hf-sdpa"), "not --impl hf-sdpa"),
    (("--cross-entropy-loss-fusion", "--loss-chunks", "4"), "drop --loss-chunks"),
    (("--cross-entropy-fusion-impl", "te"), "needs --cross-entropy-loss-fusion"),
])
def test_bad_combinations(run_cli, extra, fragment):
    code, _, err = run_cli("estimate", "--model", "llama3-8b", "--gpus", "8", *extra)
    assert code == 2 and fragment in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("emit, want", [
    ("megatron", {"--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl te"}),
    ("bridge", {"model.cross_entropy_loss_fusion=true", "model.cross_entropy_fusion_impl=te"}),
])
def test_emitted(run_cli, emit, want):
    code, out, err = run_cli("estimate", "--model", "llama3-8b", "--tp", "8", "--cross-entropy-loss-fusion",
                             "--cross-entropy-fusion-impl", "te", "--emit", emit, "--emit-only")
    assert code == 0, err
    assert want <= set(out.replace(" \\", "").split("\n")) | set(out.split())


# Opt-in (MEMPLAN_CE_SLOW=1; ~35 s: megatron-core's import and the compilation in a spawned process, over the
# suite's time budget); test_native_fusion_is_megatron_core_measured compares memplan with the recorded bytes.
@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("MEMPLAN_CE_SLOW"), reason="set MEMPLAN_CE_SLOW=1 to run")
def test_recorded_measurement_is_megatron_core_now():
    from validation.mcore_loss import measure_mcore_loss

    for got in measure_mcore_loss():
        want = _recorded()[got.fused]
        for key in ("forward_peak", "after_forward", "backward_peak"):  # gloo frees a few small tensors late
            assert abs(getattr(got, key) - want[key]) <= 512, (got.fused, key)
