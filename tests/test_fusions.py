"""Megatron-LM's kernels and fusions as options (memplan/inventory/fusions.py): --device, --transformer-impl and
--no-<name>-fusion reach the inventory, and the tensors an unfused CUDA run keeps are the ones megatron-core's
unfused code keeps, measured on CPU (validation/mcore.py runs megatron-core 0.16.1 with every fusion off;
tests/test_validate_mcore.py test_unfused_cuda_terms_are_what_megatron_core_keeps)."""

import json

import pytest

from memplan.check.cases import mcore_case
from memplan.check.validate import case_model
from memplan.cli import options as cli_options
from memplan.core.training import FUSIONS, Recompute, TrainingSpec
from memplan.inventory.assemble import training_inventory

# the terms each switch adds on CUDA (the rest change no bytes: memplan/inventory/fusions.py)
ADDED = {"masked-softmax": "causal_mask", "bias-swiglu": ("swiglu_up", "swiglu_silu_out"), "rope": "rope_cos_sin"}


def test_cli_names_the_fusions_training_knows():
    assert cli_options.FUSIONS == FUSIONS


def _ids(inv):
    return {t.id for t in inv.terms}


def test_each_switch_adds_its_terms_on_cuda_only():
    model = case_model(mcore_case("llama"))  # RMSNorm, SwiGLU, RoPE, GQA, no bias
    fused = training_inventory(model, "megatron-local", "cuda", TrainingSpec())
    assert not _ids(fused) & {"causal_mask", "swiglu_up", "swiglu_silu_out", "rope_cos_sin"}
    assert not fused.grad_hook_transient
    for name, ids in ADDED.items():
        ids = {ids} if isinstance(ids, str) else set(ids)
        inv = training_inventory(model, "megatron-local", "cuda", TrainingSpec(fusions_off=(name,)))
        assert _ids(inv) - _ids(fused) == ids, name
    inv = training_inventory(model, "megatron-local", "cuda", TrainingSpec(fusions_off=("gradient-accumulation",)))
    assert inv.grad_hook_transient and _ids(inv) == _ids(fused)
    # Transformer Engine's attention has its own softmax: the masked-softmax switch changes nothing there
    te = training_inventory(model, "megatron", "cuda", TrainingSpec(fusions_off=("masked-softmax",)))
    assert "causal_mask" not in _ids(te)
    # the CPU inventory (measured) already has every unfused tensor; no fused wgrad on CPU
    cpu = training_inventory(model, "megatron-local", "cpu", TrainingSpec())
    assert {"causal_mask", "swiglu_up", "swiglu_silu_out", "rope_cos_sin"} <= _ids(cpu) and cpu.grad_hook_transient


def _estimate(run_cli, *extra):
    code, out, err = run_cli("estimate", "--model", "llama3-8b", "--tp", "8", "--json", *extra)
    assert code == 0, err
    return json.loads(out)


def test_device_and_transformer_impl_reach_the_inventory(run_cli):
    assert _estimate(run_cli, "--transformer-impl", "local", "--device", "cpu")["inventory"] == "megatron-local/eager/cpu"
    off = _estimate(run_cli, "--transformer-impl", "local", "--no-rope-fusion", "--no-bias-swiglu-fusion")
    assert off["inventory"] == "megatron-local/eager/cuda/no-fusion:bias-swiglu,rope"
    on = _estimate(run_cli, "--transformer-impl", "local")
    assert off["memory"]["peak_bytes"] > on["memory"]["peak_bytes"]


@pytest.mark.parametrize("extra, fragment", [
    (("--tp", "8", "--device", "cpu"), "runs on CUDA only"),
    (("--transformer-impl", "local", "--impl", "hf-sdpa"), "conflicts with --impl hf-sdpa"),
    (("--impl", "hf-sdpa", "--no-rope-fusion"), "not --impl hf-sdpa"),
])
def test_bad_combinations(run_cli, extra, fragment):
    code, _, err = run_cli("estimate", "--model", "llama3-8b", *extra)
    assert code == 2 and fragment in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_search_emits_what_was_chosen(run_cli):
    code, out, err = run_cli("search", "--model", "llama3-8b", "--gpus", "8", "--mem", "80GB", "--top", "1",
                             "--transformer-impl", "local", "--no-rope-fusion", "--no-gradient-accumulation-fusion",
                             "--emit", "megatron", "--emit-only")
    assert code == 0, err
    lines = out.replace(" \\", "").splitlines()
    assert {"--transformer-impl local", "--no-rope-fusion", "--no-gradient-accumulation-fusion"} <= set(lines)
    assert not [line for line in lines if line in ("--no-bias-swiglu-fusion", "--no-masked-softmax-fusion")]
    assert not [line for line in lines if line.startswith("--attention-backend")]  # the local spec's own attention


def test_api_takes_the_same_options():
    from memplan import estimate
    from memplan.core.errors import MemplanError

    got = estimate("llama3-8b", tp=8, transformer_impl="local", no_masked_softmax_fusion=True)
    assert got.estimate.inventory.name == "megatron-local/eager/cuda/no-fusion:masked-softmax"
    assert "causal_mask" in {row.term.id for row in got.estimate.rows}
    with pytest.raises(MemplanError, match="unknown --transformer-impl"):
        estimate("llama3-8b", tp=8, transformer_impl="te")


def test_memory_efficient_layer_norm_keeps_the_output_not_the_input(run_cli):
    from memplan.memory.term_bytes import PlanValues, TermBytes

    model = case_model(mcore_case("gpt"))  # LayerNorm, s = 32, b = 2, h = 64
    s, b, h = model.seq_length, 2, model.hidden_size
    sizes = TermBytes(model, PlanValues(1, 1, 1, 1, 0, 0, 1, b, 0, 1, 1), 2)

    def kept(recompute=Recompute.NONE, **training):
        inv = training_inventory(model, "megatron-local", "cuda", TrainingSpec(recompute=recompute, **training))
        return {scope: sum(sizes(t) * t.kept(recompute) for t in inv.terms if t.scope == scope)
                for scope in ("layer", "last")}

    on, off = kept(memory_efficient_layer_norm=True), kept()
    # hand-derived from apex FusedLayerNormAffineFunction (memory_efficient=True): save_for_backward(output, weight,
    # bias, None, invvar) instead of (input, weight, bias, mean, invvar); the output is the next linear's saved input.
    # Per LayerNorm: its bf16 input (2 s b h) and its fp32 mean (4 s b) go: two per layer, the final one at the loss.
    assert off["layer"] - on["layer"] == 2 * (2 * s * b * h + 4 * s * b)
    assert off["last"] - on["last"] == 2 * s * b * h + 4 * s * b
    # full recompute keeps the layer input (the checkpoint's) either way
    full = Recompute.FULL
    assert kept(full, memory_efficient_layer_norm=True)["layer"] == kept(full)["layer"] == 2 * s * b * h
    code, _, err = run_cli("estimate", "--model", "llama3-8b", "--tp", "8", "--transformer-impl", "local",
                           "--memory-efficient-layer-norm")
    assert code == 2 and "a LayerNorm model" in err and len(err.strip().splitlines()) == 1
    code, out, err = run_cli("estimate", "--model", "gpt-22b", "--tp", "8", "--transformer-impl", "local",
                             "--memory-efficient-layer-norm", "--emit", "megatron", "--emit-only")
    assert code == 0 and "--memory-efficient-layer-norm" in out, err
