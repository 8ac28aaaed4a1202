"""CI: megatron-core's whole training step on CPU (validation/mcore_step.py: GPTModel from the local spec, DDP with the
fp32 gradient buffer, the distributed optimizer over torch AdamW, gloo) against memplan's step peak for the same plan
(`estimate --impl megatron-local --device cpu`, memplan/check/mcore_step.py). Two cases run here in one spawned
process (GPT-like with full recompute, Llama-like without); `python -m memplan.check.mcore_step` runs the whole grid
(GPT and Llama-like, recompute none / selective / full, d = 1 and 2), the slow test below too.
"""

import dataclasses

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from memplan.check import mcore_step  # noqa: E402
from memplan.check.mcore_step import McoreStep, mcore_step_cases, predict_mcore_step, run_mcore_step  # noqa: E402
from memplan.inventory import assemble, mcore  # noqa: E402

# The measurement reads every storage (exact bytes); what memplan leaves out is below 0.1 % here: the cross-entropy's
# s b-sized index / mask temporaries, the gradient buffer's padding, AdamW's step counters
STEP_TOLERANCE = 2e-3
CASES = [McoreStep("gpt", "full"), McoreStep("llama", "none")]


@pytest.fixture(scope="module")
def results(announce):
    with announce(f"measuring {len(CASES)} megatron-core training steps (one process)"):
        return run_mcore_step(CASES, STEP_TOLERANCE)


def _error(case: McoreStep, measured: int) -> float:
    return (int(predict_mcore_step(case).peak_bytes) - measured) / measured


def test_step_peak_matches_megatron_core(results):
    for x in results:
        r = x.peak
        assert r.passed, (r.case.name, r.measured, r.predicted, r.error)
        assert r.measured_params == r.predicted_params, r.case.name
        assert abs(x.optimizer_error) <= STEP_TOLERANCE, (r.case.name, x.measured_optimizer, x.predicted_optimizer)
    gpt, llama = (x.peak for x in results)
    # where the peaks are: full recompute in the last layer's backward, no recompute at the loss
    assert (gpt.measured_at, gpt.predicted_at) == ("backward", "backward 2")
    assert (llama.measured_at, llama.predicted_at) == ("forward", "loss")


def test_softmax_is_the_fp32_copy(results, monkeypatch):
    # megatron-core's VocabParallelCrossEntropy exponentiates and normalises the fp32 copy in place: counting a third
    # s b v fp32 buffer puts the Llama-like step's loss peak 4 s b v = 65,536 B (2.4 %) high
    original = mcore.vocab_parallel_loss_moments
    monkeypatch.setattr(mcore, "vocab_parallel_loss_moments",
                        lambda src, extra=(), softmax_in_copy=False: original(src, extra))
    assert _error(CASES[1], results[1].peak.measured) > STEP_TOLERANCE


def test_decoder_input_held_to_the_loss(results, monkeypatch):
    # GPTModel.forward's decoder_input (s b h bf16 = 8,192 B) is alive at the loss, saved by no CPU RMSNorm
    monkeypatch.setattr(assemble, "held_decoder_input", lambda inv, *args: inv)
    assert _error(CASES[1], results[1].peak.measured) < -STEP_TOLERANCE


def test_tied_head_gradient_waits(results, monkeypatch):
    # without the fused wgrad the tied output layer's bf16 weight gradient (v h = 32,768 B) waits in autograd for
    # the embedding's through the whole backward
    original = assemble.apply_fusions
    monkeypatch.setattr(assemble, "apply_fusions",
                        lambda *a: dataclasses.replace(original(*a), tied_grad_waits=False))
    assert _error(CASES[0], results[0].peak.measured) < -STEP_TOLERANCE


def test_for_loop_adamw_temporaries(results, monkeypatch):
    # torch's for-loop AdamW (megatron-core's fallback on CPU): sqrt and denom of a matrix beside the previous
    # matrix's denom; GPT-like: fc2 then fc1 (reverse order), 3 x 64 x 256 fp32 = 196,608 B on top of the states
    from memplan.memory import optimizers
    assert results[0].measured_optimizer - results[0].predicted_optimizer in range(0, 200)  # AdamW's step counters
    monkeypatch.setattr(optimizers, "_adamw_kept", lambda t: 0 * t.numel)
    p = predict_mcore_step(CASES[0])
    optimizer = max(int(ev.bytes) for ev in p.events if ev.phase == "optimizer")
    assert (optimizer - results[0].measured_optimizer) / results[0].measured_optimizer < -STEP_TOLERANCE


@pytest.mark.slow
def test_step_grid_matches_megatron_core():
    """GPT and Llama-like, recompute none / selective / full, d = 1 and 2 (the optimizer states sharded)."""
    for x in run_mcore_step(mcore_step_cases(), STEP_TOLERANCE):
        assert x.peak.passed, (x.peak.case.name, x.peak.measured, x.peak.predicted, x.peak.error)
        assert abs(x.optimizer_error) <= STEP_TOLERANCE, (x.peak.case.name, x.measured_optimizer)


def test_cases_are_the_measured_plans():
    c = mcore_step.mcore_step_config(McoreStep("llama", "full", 2))
    assert (c.parallel.dp, c.parallel.zero, c.training.device, c.model.norm) == (2, 1, "cpu", "rmsnorm")
