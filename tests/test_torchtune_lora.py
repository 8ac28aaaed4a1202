"""--impl torchtune --lora R / --qlora: torchtune 0.6.1's own LoRALinear (its lora_llama3_2 builder, only the adapters
trainable) and QLoRA (torchao's NF4Tensor) run on CPU (validation/torchtune.py) against memplan's LoRA machinery
(memplan/inventory/lora.py, memplan/memory/adapters.py): the saved bytes of a real forward + loss, the weights,
gradients and fused-AdamW states after a real step, and the loss's moments with the chunked loss. Needs torchtune
and torchao (test extra)."""

import json

import pytest

pytest.importorskip("torchao")
pytest.importorskip("datasets")

from click.testing import CliRunner  # noqa: E402

from memplan.cli import cli  # noqa: E402
from memplan.core.errors import MemplanError  # noqa: E402
from memplan.inventory import lora  # noqa: E402
from memplan.memory import adapters  # noqa: E402
from memplan.plan.estimate import estimate  # noqa: E402
from memplan.presets.batch import make_config  # noqa: E402
from memplan.presets.files import ModelPreset  # noqa: E402
from memplan.presets.hf_config import read_hf_config  # noqa: E402
from validation.torchtune import import_torchtune, measure_torchtune_loss, measure_torchtune_step  # noqa: E402

try:
    import_torchtune()
except ImportError:
    pytest.skip("torchtune not installed", allow_module_level=True)

QV = ("q_proj", "v_proj")
DEFAULT = ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # its recipes' configs
TINY = dict(vocab=64, layers=2, heads=4, kv_heads=2, hidden=32, ffn=48)
# torchao's NF4Tensor needs every weight's n / 64 to be a multiple of 256 (h 128, f 256, 4 KV heads: n >= 16,384)
# and quantises slowly on CPU (~2 us a weight): one layer
NF4 = dict(vocab=64, layers=1, heads=4, kv_heads=4, hidden=128, ffn=256)


@pytest.fixture(scope="module")
def measured():
    """torchtune's LoRA model, one real CPU step each (s 64, b 2), by (targets, dropout)."""
    return {(t, p): measure_torchtune_step(64, 2, **TINY, lora=dict(rank=8, targets=list(t or DEFAULT), dropout=p))
            for t, p in [(None, 0.0), (QV, 0.1)]}


def _model(tmp_path, dims):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": dims["hidden"],
              "intermediate_size": dims["ffn"], "num_attention_heads": dims["heads"],
              "num_key_value_heads": dims["kv_heads"], "num_hidden_layers": dims["layers"],
              "vocab_size": dims["vocab"], "max_position_embeddings": 4096, "hidden_act": "silu",
              "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    path = tmp_path / f"h{dims['hidden']}.json"
    path.write_text(json.dumps(config))
    return read_hf_config(str(path)).model


def _estimate(model, s, b, targets=None, dropout=0.0, qlora=False, chunks=1):
    training = dict(micro_batch=b, recompute="none", precision="bf16-true", lora_rank=8, lora_targets=targets,
                    lora_dropout=dropout, qlora=qlora, lora_impl="torchtune", loss_chunks=chunks)
    return estimate(make_config(ModelPreset(model), training=training, model=dict(seq_length=s)), impl="torchtune",
                    device="cpu")


def _first_layer(s, b, h, masks=0):
    """What memplan keeps on the safe side (as for peft, memplan/inventory/lora.py): with the embedding frozen the
    first layer's input needs no gradient, so its sa_norm saves nothing (its fp32 input and rstd: 4 s b h + 4 s b
    bytes) and, with dropout, its `masks` targets' dropout masks on an h-wide input are not saved (2 s b h each,
    bf16 on CPU)."""
    return 4 * s * b * h + 4 * s * b + masks * 2 * s * b * h


@pytest.mark.parametrize("targets, dropout", [(None, 0.0), (QV, 0.1)])
def test_lora_saved_tensors_equal_torchtune(tmp_path, measured, targets, dropout):
    # without dropout every target's lora_a takes its linear's own input (q/k/v_proj's, w1/w3's, w2's saved once
    # each) and lora_b keeps s b r bf16; the frozen model drops the norms' normalised inputs (the scales' gradients),
    # the token ids and the output projection's input. With dropout each target keeps its mask and output instead.
    s, b = 64, 2
    want = measured[(targets, dropout)]["saved"]
    got = _estimate(_model(tmp_path, TINY), s, b, targets, dropout).stages[0].activations
    assert got - _first_layer(s, b, 32, masks=2 if dropout else 0) == want


def test_qlora_saved_tensors_and_states_equal_torchtune(tmp_path):
    # QLoRA saves what LoRA does (LinearNF4 saves the NF4 weight itself, a parameter); the weights are every layer
    # linear's NF4Tensor (measured: its inner tensors), the bf16 embedding, output and norms and the bf16 adapters
    s, b = 16, 2
    model = _model(tmp_path, NF4)
    qlora = dict(rank=8, targets=list(DEFAULT), dropout=0.0, qlora=True)
    est, want = _estimate(model, s, b, qlora=True), measure_torchtune_step(s, b, **NF4, lora=qlora)
    assert est.stages[0].activations - _first_layer(s, b, 128) == want["saved"]
    stage = est.stages[0]
    # a weight of one scaler block (n = 16,384: q, k, v and output_proj here) keeps its one bf16 quantization factor
    # as a view of a 256-value bf16 storage (measured: 512 B, not 2); weights of real models have many blocks
    assert stage.weights + 4 * (512 - 2) == want["weights"]
    assert (stage.gradients, stage.optimizer) == (want["gradients"], want["optimizer"])


def test_lora_states_equal_torchtune(tmp_path, measured):
    # the adapters in bf16 (the model's dtype), their bf16 gradients and fused AdamW's two bf16 moments
    want = measured[(None, 0.0)]
    stage = _estimate(_model(tmp_path, TINY), 64, 2).stages[0]
    assert (stage.weights, stage.gradients, stage.optimizer) == (want["weights"], want["gradients"], want["optimizer"])


def test_lora_chunked_loss_moments_equal_torchtune(tmp_path):
    # the frozen output projection makes no weight gradient: the chunked loss's moments without them, measured
    # (tests/test_torchtune.py's comparison: the loss scalars within 16 B; the chunk's targets freed early, 8 s b / N)
    s, b, chunks = 64, 2, 4
    want = measure_torchtune_loss(s, b, **TINY, chunks=chunks, lora=dict(rank=8, targets=list(QV), dropout=0.0))
    est = _estimate(_model(tmp_path, TINY), s, b, QV, chunks=chunks)
    names = {m.name: m.id for m in est.inventory.moments if m.scope == "last"}
    got = {names[e.moment]: e.parts["saved"] + e.parts["transient"] + e.parts["gradients"] - _first_layer(s, b, 32)
           for e in est.step.events if e.moment in names}
    assert abs(got["loss_forward"] - want["loss_forward"]) <= 16
    assert abs(got["loss_backward"] - 8 * s * b // chunks - want["loss_backward"]) <= 16
    assert abs(got["head_backward"] - want["head_backward"]) <= 16
    assert not any(t.id in lora.HEAD_WEIGHT_GRADS for m in est.inventory.moments for t in m.transients)


def test_removing_or_copying_fails(tmp_path, measured, monkeypatch):
    # dropping the targets' shared input (as peft's per-target copies do) or fp32 adapters break the measured equalities
    s, b = 64, 2
    model = _model(tmp_path, TINY)
    want = measured[(None, 0.0)]
    base = _estimate(model, s, b).stages[0].activations - _first_layer(s, b, 32)
    assert base == want["saved"]
    monkeypatch.setattr(lora, "SHARED_INPUT", dict.fromkeys(lora.SHARED_INPUT, "not_kept"))
    assert _estimate(model, s, b).stages[0].activations - _first_layer(s, b, 32) != want["saved"]
    monkeypatch.undo()
    monkeypatch.setattr(adapters, "adapter_bytes", lambda training: 4)
    assert _estimate(model, s, b).stages[0].gradients != want["gradients"]


def test_torchao_nf4_bytes_by_hand():
    # to_nf4(block_size 64, scaler_block_size 256), 4096 x 4096 (measured on CPU with torchao 0.18: 8,652,834 B):
    # 8,388,608 uint8 codes + 262,144 int8 scalers + 1,024 bf16 factors + the bf16 mean + 16 bf16 NF4 values
    assert adapters.nf4_bytes(4096 * 4096, "torchtune") == 8_388_608 + 262_144 + 2 * 1_024 + 2 + 32 == 8_652_834


def test_cli_torchtune_lora(tmp_path):
    # the API sets torchtune's LoRA for --impl torchtune: its default targets (its recipes'), bf16 adapter states
    out = CliRunner().invoke(cli, ["estimate", "--hf-config", "docs/torchtune/llama3.2-3b.json", "--impl", "torchtune",
                                   "--gpus", "1", "--seq-len", "2048", "--lora", "64"])
    assert out.exit_code == 0, out.output
    assert "q_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (torchtune 0.6.1's LoRALinear)" in out.output
    assert "optimizer (AdamW: LoRA adapters' 2 moments, bf16)" in out.output
    with pytest.raises(MemplanError, match="runs torchtune's LoRA modules"):
        lora.check_lora(_model(tmp_path, TINY), "torchtune", "peft")
