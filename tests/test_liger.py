"""Liger-Kernel's kernels (--liger, memplan/inventory/liger.py) on transformers' Llama layout. Liger-Kernel is
Triton only, so nothing is measured: the expected bytes are derived by hand from Liger-Kernel 0.8.5's code
(ops/rms_norm.py, ops/swiglu.py, ops/rope.py, ops/fused_linear_cross_entropy.py), as the comments show."""

import pytest

from memplan.check.cases import ValidationCase
from memplan.check.validate import case_model
from memplan.core.errors import MemplanError
from memplan.core.training import TrainingSpec
from memplan.inventory.assemble import training_inventory

# a small Llama layer: s 32, b 2, h 64, a 4 (head dim 16, q = 64), g 2, f 160; the vocabulary of case_model
S, B, H, F = 32, 2, 64, 160
BYTES = {"act": 2, "fp32": 4, "int64": 8}


def _model():
    return case_model(ValidationCase("llama", "layer", impl="hf-sdpa", s=S, b=B, h=H, a=4, f=F, t=1, sp=False,
                                     recompute="none", backend="ledger", arch="llama", g=2, dropout=0.0))


def _bytes(inv, model):
    vals = dict(s=S, b=B, h=H, a=4, f=F, g=2, v=model.vocab_size, q=H, t=1)
    return {t.id: t.elements.evaluate(vals) * BYTES[t.dtype] for t in inv.terms}


@pytest.mark.parametrize("impl", ["hf-sdpa", "hf-eager"])
def test_liger_terms_by_hand(impl):
    model = _model()
    plain = _bytes(training_inventory(model, impl, "cuda", TrainingSpec()), model)
    liger = _bytes(training_inventory(model, impl, "cuda", TrainingSpec(liger=True)), model)
    v = model.vocab_size
    # LigerRMSNormFunction.forward: save_for_backward(X, W, RSTD): X the bf16 input (2 s b h bytes), RSTD fp32 per
    # row (4 s b); LlamaRMSNorm's fp32 input copy and bf16 normed tensor are gone
    for norm in ("ln1", "ln2", "final_norm"):
        assert liger[f"{norm}_input"] == 2 * S * B * H
        assert liger[f"{norm}_rstd"] == 4 * S * B
        assert f"{norm}_fp32_input" not in liger and f"{norm}_normed" not in liger
    # LigerSiLUMulFunction.forward: save_for_backward(a, b) (2 s b f bytes each), SiLU(a) recomputed: not saved
    assert liger["silu_input"] == liger["up_out"] == 2 * S * B * F and "silu_out" not in liger
    # LigerRopeFunction.forward: save_for_backward(cos, sin), the shared tables transformers keeps: same bytes
    assert liger["rope_cos"] == plain["rope_cos"] == 2 * S * H // 4
    # fused linear cross-entropy: grad_input = zeros_like(_input) (s b h bf16) and grad_weight = zeros_like(weight)
    # (v h, the weight's dtype: bf16, accum_dtype None) saved; no lm_head input, log-softmax or targets
    assert liger["liger_grad_head_input"] == 2 * S * B * H
    assert liger["liger_grad_head_weight"] == 2 * v * H
    assert not {"head_input", "logits_fp32", "target_ids", "nll_total_weight"} & set(liger)
    # per layer: - 2 x 4 s b h (fp32 copies) - 2 x 2 s b h (normed) - 2 s b f (SiLU out) + 2 x 2 s b h (X) + 2 x 4 s b
    # (rstd, kept) => - 8 s b h - 2 s b f bytes
    layer = {t.id for t in training_inventory(model, impl, "cuda", TrainingSpec()).terms if t.scope == "layer"}
    layer_liger = {t.id for t in training_inventory(model, impl, "cuda", TrainingSpec(liger=True)).terms
                   if t.scope == "layer"}
    assert (sum(liger[i] for i in layer_liger) - sum(plain[i] for i in layer)) == -8 * S * B * H - 2 * S * B * F


def test_liger_loss_moment_has_one_logits_chunk():
    model = _model()
    inv = training_inventory(model, "hf-sdpa", "cuda", TrainingSpec(liger=True))
    fwd = next(m for m in inv.moments if m.id == "loss_forward")
    ids = {t.id for t in fwd.transients}
    # chunk_size = min(next_pow2(ceil(sb / ceil(v / h))), sb) rows of v logits: at most 2 s b h elements; no full logits
    assert ids == {"liger_logits_chunk", "liger_loss_1d"}
    assert not any("logits" in t.id and "chunk" not in t.id for m in inv.moments for t in m.transients)


@pytest.mark.parametrize("impl", ["megatron", "megatron-local", "torch", "torchtune"])
def test_liger_refused_for_other_impls(impl):
    with pytest.raises(MemplanError, match="--liger"):
        training_inventory(_model(), impl, "cuda", TrainingSpec(liger=True))


def test_estimate_says_liger_is_derived(run_cli):
    code, out, err = run_cli("estimate", "--model", "llama3-8b", "--impl", "hf-sdpa", "--seq-len", "2048", "--liger")
    assert code == 0, err
    assert "NOT MEASURED" in out and "LigerRMSNorm input X" in out


def test_cli_refuses_liger_for_megatron(run_cli):
    code, out, err = run_cli("estimate", "--model", "llama3-8b", "--impl", "megatron", "--liger")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--liger" in err


def test_liger_with_lora_keeps_no_frozen_head_gradient():
    # fused_linear_cross_entropy_forward: grad_weight is None when the weight needs no gradient (peft freezes
    # lm_head); the input's gradient (s b h bf16) is still made and saved
    ids = {t.id for t in training_inventory(_model(), "hf-sdpa", "cuda", TrainingSpec(liger=True, lora_rank=8)).terms}
    assert "liger_grad_head_weight" not in ids and "liger_grad_head_input" in ids
