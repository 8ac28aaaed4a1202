"""--impl torchtune against torchtune 0.6.1's own Llama code on CPU (validation/torchtune.py).

The expected bytes are torchtune's real code run under FakeTensorMode with symbolic s and b (memplan's
tracer) and run for real on CPU: every storage autograd saves. memplan's inventory (memplan/inventory/hf.py
torchtune_terms) must give the same total per (s, b), so a removed or resized term fails the test. Needs
torchtune and torchao (test extra)."""

import dataclasses
import json
import os
from pathlib import Path

import pytest

pytest.importorskip("torchao")
pytest.importorskip("datasets")  # torchtune's own dependencies (pip installs them with torchtune)

from memplan.inventory import hf, tune_loss  # noqa: E402
from memplan.plan.estimate import estimate  # noqa: E402
from memplan.presets.batch import make_config  # noqa: E402
from memplan.presets.files import ModelPreset  # noqa: E402
from memplan.presets.hf_config import read_hf_config  # noqa: E402
from validation.torchtune import (import_torchtune, measure_torchtune_8bit_states, measure_torchtune_llama,  # noqa: E402
                                  measure_torchtune_loss, torchtune_head_grad_in_backward, trace_torchtune_llama)
from validation.trace_poly import evaluate  # noqa: E402

try:
    import_torchtune()
except ImportError:  # torchtune not installed (the test extra installs it)
    pytest.skip("torchtune not installed", allow_module_level=True)

# h = 32, a = 4 heads of 8, g = 2 KV heads, f = 48, v = 64, L = 2
DIMS = dict(vocab=64, layers=2, heads=4, kv_heads=2, hidden=32, ffn=48)
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 48,
         "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 64,
         "max_position_embeddings": 4096, "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def traced():
    return trace_torchtune_llama(**DIMS)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tt") / "config.json"
    path.write_text(json.dumps(LLAMA))
    return read_hf_config(str(path)).model


def _estimate(model, s, b, impl="torchtune", recompute="none", chunks=1):
    config = make_config(ModelPreset(model), training=dict(micro_batch=b, recompute=recompute, precision="bf16-true",
                                                           loss_chunks=chunks), model=dict(seq_length=s))
    return estimate(config, impl=impl, device="cpu")


def test_kv_expanded_before_attention(traced):
    # sdpa saves q, k, v, the log-sum-exp and the output: K and V at all a = 4 heads (q width 32, bf16: 64 s b
    # bytes each), not at g = 2 heads as transformers' sdpa with enable_gqa (32 s b)
    sdpa = [t for t in traced if t["module"] == "layers.0.attn" and "scaled_dot_product" in t["op"]]
    assert [t["nbytes"] for t in sdpa] == ["64 s b", "64 s b", "64 s b", "16 s b", "64 s b"]


@pytest.mark.parametrize("s, b", [(64, 2), (256, 3)])
def test_torchtune_inventory_equals_the_traced_code(traced, model, s, b):
    want = sum(evaluate(t["nbytes"], s, b) for t in traced)
    if s == 64:  # the trace is the real run's bytes
        assert measure_torchtune_llama(s, b, **DIMS) == want
    got = _estimate(model, s, b)
    assert got.stages[0].activations == want
    # the same model in transformers' sdpa code keeps less: K / V at g heads, a bf16 normalised input
    hf = _estimate(model, s, b, "hf-sdpa")
    assert hf.stages[0].activations < want


def test_activation_checkpointing_keeps_each_layer_input(traced, model):
    # torchtune's checkpoint_wrapper (non-reentrant) keeps each layer's input (2 h = 64 s b bytes), the rest of the
    # model (embedding, final norm, head, loss) as without it; memplan's activations under full recompute also
    # hold the one layer being recomputed in the backward: one layer's saved tensors of the run without checkpoints
    # (the L = 2 layers save alike; torchtune's builder shares one SiLU module, so layer 1's SiLU input is named
    # under layers.0: split the layers' sum, not by name)
    s, b = 128, 2
    recomputed = sum(evaluate(t["nbytes"], s, b) for t in traced if t["module"].startswith("layers.")) // 2
    want = measure_torchtune_llama(s, b, **DIMS, checkpoint=True) + recomputed
    assert _estimate(model, s, b, recompute="full").stages[0].activations == want


def _loss_bytes(model, s, b, chunks):
    """memplan's bytes at each loss / output-projection moment of --impl torchtune: what the step holds beside the
    weights and optimizer states (saved tensors, transients, gradients), by moment id."""
    config = make_config(ModelPreset(model), training=dict(micro_batch=b, loss_chunks=chunks, precision="bf16-true"),
                         model=dict(seq_length=s))
    est = estimate(config, impl="torchtune", device="cpu")
    names = {m.name: m.id for m in est.inventory.moments if m.scope == "last"}
    return {names[e.moment]: e.parts["saved"] + e.parts["transient"] + e.parts["gradients"]
            for e in est.step.events if e.moment in names}


@pytest.fixture(scope="module")
def measured_loss():
    return {(n, b): measure_torchtune_loss(64, b, **DIMS, chunks=n) for n, b in [(1, 2), (4, 2), (2, 2)]}


@pytest.mark.parametrize("chunks", [1, 4, 2])
def test_torchtune_loss_equals_its_cpu_run(model, measured_loss, chunks):
    # torchtune's own model and loss run as full_finetune_single_device's _loss_step (chunks > 1: the model's
    # set_num_output_chunks and CEWithChunkedOutputLoss), s 64, b 2, v 64, h 32, against memplan's moments
    s, b = 64, 2
    assert _matches(_loss_bytes(model, s, b, chunks), measured_loss[(chunks, b)], s * b, chunks)
    if chunks > 1:
        # the chunks save what the whole loss saves (s b v fp32 log-softmax, s b int64 targets) with N fp32 total
        # weights and the int64 token count: 4 (N - 1) + 8 bytes more
        want = measured_loss[(chunks, b)]["saved"]
        assert want == measured_loss[(1, b)]["saved"] + 4 * (chunks - 1) + 8
        assert _estimate(model, s, b, chunks=chunks).stages[0].activations == want


def _matches(got: dict, want: dict, tokens: int, chunks: int) -> bool:
    """memplan's moments equal the measured live bytes within 16 B: the measurement also holds the loss scalars
    (the loss, the chunks' running sum, the division's result: 4 B each). Where noted, memplan is above by the int64
    targets the real backward has freed by then: nll_loss's backward of the chunk back-propagated first frees its
    targets (8 s b / N B) before log_softmax's; with the whole loss the targets are gone for the output projection's
    backward too (memplan frees them with the final norm's: the safe side)."""
    early = {"loss_backward": 8 * tokens // chunks, "head_backward": 8 * tokens if chunks == 1 else 0}
    return all(abs(want[k] - (got[k] - early.get(k, 0))) <= 16 for k in want if k != "saved")


@pytest.mark.parametrize("removed", ["logits", "logits_fp32_copy", "shifted_labels", "grad_nll", "grad_logits",
                                     "grad_head_weight_sum"])
def test_removing_a_chunked_loss_tensor_fails(model, measured_loss, monkeypatch, removed):
    def without(make):
        def wrapped(*args):
            made = make(*args)
            drop = lambda m: dataclasses.replace(m, transients=tuple(t for t in m.transients if t.id != removed))  # noqa: E731
            return [drop(m) for m in made] if isinstance(made, list) else drop(made)
        return wrapped

    monkeypatch.setattr(hf, "tune_loss_forward", without(tune_loss.tune_loss_forward))
    monkeypatch.setattr(hf, "tune_chunked_backward", without(tune_loss.tune_chunked_backward))
    assert not _matches(_loss_bytes(model, 64, 2, 4), measured_loss[(4, 2)], 128, 4)


def test_optimizer_in_backward_steps_the_head_at_once(model, monkeypatch):
    # torchtune's optimizer_in_bwd steps and zeroes each parameter in its own hook: when the output projection's
    # backward is done its gradient is gone (measured: no .grad alive); memplan's final-norm moment holds none either
    # (MsT's recipe, memplan's default, keeps the LM head's gradient until the embedding's step: v h x 2 B here, with
    # the final norm's, h x 2 B, counted with the head's)
    assert torchtune_head_grad_in_backward(64, 2, **DIMS) == 0
    config = make_config(ModelPreset(model), training=dict(micro_batch=2, optimizer_in_backward=True,
                                                           precision="bf16-true"), model=dict(seq_length=64))

    def norm_grads(impl):
        est = estimate(config, impl=impl, device="cpu")
        return next(e.parts["gradients"] for e in est.step.events if e.moment.startswith("final norm backward"))

    assert norm_grads("torchtune") == 0
    assert norm_grads("hf-sdpa") == 64 * 32 * 2 + 32 * 2


def test_published_llama32_3b_packed_row():
    # torchtune's README (github.com/pytorch/torchtune), Llama 3.2 3B, full_finetune_single_device, b = 2, packed
    # 4,096 tokens, bf16, one A100: 60.0 GiB peak active memory. memplan's allocated peak for it is within 4 %
    # (docs/guide.md explains the difference); transformers' Llama (hf-sdpa) lower by the expanded K / V and the fp32
    # normalised inputs, 2 s b q (1 - g/a) 2 bytes x L + 2 s b h bytes x (2 L + 1) = 1.88 GB + 2.87 GB
    llama = read_hf_config(str(Path(__file__).parent.parent / "docs" / "torchtune" / "llama3.2-3b.json")).model
    config = make_config(ModelPreset(llama), training=dict(micro_batch=2, recompute="none", precision="bf16-true"),
                         model=dict(seq_length=4096))
    tune = estimate(config, impl="torchtune", device="cuda").step.peak_bytes
    hf = estimate(config, impl="hf-sdpa", device="cuda").step.peak_bytes
    assert abs(tune / 2**30 - 60.0) <= 0.04 * 60.0
    s, b, q, h, layers = 4096, 2, 3072, 3072, 28
    extra = 2 * s * b * q * 2 * layers * 2 // 3 + 2 * s * b * h * (2 * layers + 1)
    assert abs((tune - hf) - extra) <= 0.01 * extra


# bitsandbytes' AdamW8bit stepped in the backward as torchtune's optimizer_in_bwd runs it (one optimizer per
# parameter), one real CPU step of torchtune's model with h 64, a 4, g 2, f 128, v 128, 2 layers (bitsandbytes 0.50.2
# runs its 8-bit optimizers on CPU; PagedAdamW8bit falls back to the same tensors there):
#     measure_torchtune_8bit_states(32, 2, vocab=128, layers=2, heads=4, kv_heads=2, hidden=64, ffn=128[, paged=True])
# gives {"optimizer": 259072, "gradients": 0} both ways. By hand: a tensor of n >= 4,096 values keeps two uint8 states
# (2 n), an fp32 absmax per 256 values of each (8 ceil(n / 256)) and its optimizer's two 256-value fp32 quantile maps
# (2,048 B); a smaller one two fp32 states (8 n): embedding, output, w1, w2, w3 (8,192 values) 16,384 + 256 + 2,048,
# q_proj and output_proj (4,096) 8,192 + 128 + 2,048, k_proj and v_proj (2,048) 16,384, each norm (64) 512:
# 2 x 18,688 + 512 + 2 x (2 x 10,368 + 2 x 16,384 + 3 x 18,688 + 2 x 512) = 259,072 B.
ADAM8BIT = dict(vocab=128, layers=2, heads=4, kv_heads=2, hidden=64, ffn=128)
ADAM8BIT_MEASURED = {"optimizer": 259072, "gradients": 0}


def _adam8bit_model(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, "hidden_size": 64, "intermediate_size": 128, "vocab_size": 128}))
    return read_hf_config(str(path)).model


def test_adam8bit_in_backward_states_equal_bitsandbytes(tmp_path):
    config = make_config(ModelPreset(_adam8bit_model(tmp_path)),
                         training=dict(micro_batch=2, precision="bf16-true", optimizer="adam8bit",
                                       optimizer_in_backward=True), model=dict(seq_length=32))
    est = estimate(config, impl="torchtune", device="cpu")
    assert est.stages[0].optimizer == ADAM8BIT_MEASURED["optimizer"]
    # without the step in the backward one optimizer holds every tensor: its quantile maps once
    config = make_config(ModelPreset(_adam8bit_model(tmp_path)),
                         training=dict(micro_batch=2, precision="bf16-true", optimizer="adam8bit"),
                         model=dict(seq_length=32))
    assert estimate(config, impl="torchtune", device="cpu").stages[0].optimizer == 259072 - 11 * 2048


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("MEMPLAN_COMPILE_SLOW"), reason="set MEMPLAN_COMPILE_SLOW=1 to run")
@pytest.mark.parametrize("paged", [False, True])
def test_adam8bit_measurement_is_the_constant(paged):
    pytest.importorskip("bitsandbytes")
    assert measure_torchtune_8bit_states(32, 2, **ADAM8BIT, paged=paged) == ADAM8BIT_MEASURED
