"""Issue 22: parameters a real training step never trains are weights only (ParamGroup.trained false): RoFormer's
frozen rotary table and Pegasus' / Marian's sinusoidal positions (nn.Embedding built with _freeze=True, requires_grad
false), HRM's z_L_init (requires_grad false), DeepSeek-V3.2's / GLM-5's / A.X-K2's lightning indexer (its forward
runs under @torch.no_grad: no .grad, so torch AdamW makes no state for it) and a seq2seq decoder's cross-attention with its LayerNorm (transformers' forward
without encoder states skips it). Counted in the parameters (as transformers counts them) and the weights; not in the
gradients, the optimizer states, their ZeRO shards, the timeline's gradients nor the allocation stream's (under
DeepSpeed only the requires_grad false ones: its flat partitions step every requires_grad parameter).

The expected figures are measured: one real CPU training step of the tiny config (validation/registry.py
tiny_config, transformers 5.23, bf16, torch AdamW foreach, s = 8, b = 1), printed by

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m validation.untrained roformer pegasus deepseek_v32 axk2 bart whisper \
        glm_moe_dsa marian trocr bigbird_pegasus hrm_text

(parameters, those with a .grad after backward and their bytes, those with AdamW state after step and the bytes of
exp_avg + exp_avg_sq). MEMPLAN_UNTRAINED_SLOW=1 re-measures them (~5 s of CPU for the eleven).
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from memplan.core.specs import Config  # noqa: E402
from memplan.core.training import TrainingSpec  # noqa: E402
from memplan.inventory.assemble import training_inventory  # noqa: E402
from memplan.memory.offload import host_bytes  # noqa: E402
from memplan.memory.stage import stage_memory  # noqa: E402
from memplan.memory.states import param_groups  # noqa: E402
from memplan.memory.stream_params import Persistent  # noqa: E402
from memplan.memory.term_bytes import PlanValues  # noqa: E402
from memplan.memory.timeline import step_events  # noqa: E402
from memplan.presets.hf_config import read_hf_config  # noqa: E402
from validation.registry import text_model, tiny_config  # noqa: E402

# model type: (parameters, with a gradient, gradient bytes, with AdamW state, state bytes), measured (module docstring)
MEASURED = {
    "roformer": (629_952, 564_416, 1_128_832, 564_416, 2_257_664),  # embed_positions 1 tensor
    "pegasus": (395_520, 99_840, 199_680, 99_840, 399_360),  # embed_positions, 2 layers' encoder_attn + its norm
    "deepseek_v32": (210_448, 191_056, 382_112, 191_056, 764_224),  # 3 layers' indexer: wq_b, wk, k_norm, weights_proj
    "axk2": (180_512, 167_584, 335_168, 167_584, 670_336),  # 2 layers' indexer
    "bart": (395_648, 362_112, 724_224, 362_112, 1_448_448),  # 2 layers' encoder_attn + encoder_attn_layer_norm
    "whisper": (161_792, 128_384, 256_768, 128_384, 513_536),  # the same, k_proj unbiased
    "glm_moe_dsa": (210_448, 191_056, 382_112, 191_056, 764_224),  # GlmMoeDsaIndexer, as DeepSeek-V3.2's
    "marian": (395_392, 99_712, 199_424, 99_712, 398_848),  # embed_positions, encoder_attn + its norm
    "trocr": (395_648, 362_112, 724_224, 362_112, 1_448_448),  # encoder_attn + its norm
    "bigbird_pegasus": (427_264, 394_240, 788_480, 394_240, 1_576_960),  # encoder_attn + its norm
    "hrm_text": (245_824, 245_760, 491_520, 245_760, 983_040),  # z_L_init (h = 64), requires_grad false
}
TRAINING = TrainingSpec(micro_batch=1, global_batch=1, precision="bf16-true")  # bf16 weights, grads and AdamW states


def _model(model_type: str, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(text_model(tiny_config(model_type))))
    return read_hf_config(str(path)).model


@pytest.mark.parametrize("model_type", sorted(MEASURED))
def test_gradients_and_states_equal_a_real_step(model_type, tmp_path):
    """One GPU, no parallelism: the weights hold every parameter (2 B each), the gradients (2 B) and AdamW's two
    moments (2 x 2 B) only those a real step gave a .grad; counted as trained again, both would exceed the run's."""
    params, with_grad, grad_bytes, with_state, state_bytes = MEASURED[model_type]
    model = _model(model_type, tmp_path)
    mem = stage_memory(model, (), TRAINING, PlanValues.from_config(Config(model=model, training=TRAINING)), 0)
    assert mem.params == params and mem.states.weights == 2 * params
    assert mem.trained_params == with_grad == with_state
    assert (mem.states.gradients, mem.states.optimizer) == (grad_bytes, state_bytes)


def test_zero_shards_only_the_trained_parameters(tmp_path):
    """ZeRO-3 over d = 4 (Pegasus): weights ceil(2 x 395,520 / 4) = 197,760 B, gradients ceil(2 x 99,840 / 4) =
    49,920 B, AdamW moments ceil(4 x 99,840 / 4) = 99,840 B (plus ZeRO-3's one gathered layer, StageMemory.gathered)."""
    model = _model("pegasus", tmp_path)
    config = Config(model=model, training=TrainingSpec(micro_batch=1, global_batch=4, precision="bf16-true"),
                    parallel=dict(dp=4, zero=3))
    mem = stage_memory(model, (), config.training, PlanValues.from_config(config), 0)
    assert (mem.states.gradients, mem.states.optimizer) == (49_920, 99_840)
    assert mem.states.weights - mem.gathered == 197_760  # gathered: bytes


def test_deepspeed_steps_what_requires_a_gradient(tmp_path):
    """DeepSpeed ZeRO 1 / 2 flattens every requires_grad parameter into its fp32 partitions and zero-fills a missing
    .grad (deepspeed/runtime/zero/stage_1_and_2.py: derived from the code, not measured): Pegasus' cross-attention
    is stepped there, its frozen table (4,096 x 64 = 262,144, requires_grad false) is not. 395,520 - 262,144 = 133,376
    parameters over d = 4, bf16: gradients 2 x 133,376 = 266,752 B (ZeRO 1) or / 4 = 66,688 B (ZeRO 2), two moments
    4 x 133,376 / 4 = 133,376 B."""
    model = _model("pegasus", tmp_path)
    training = TrainingSpec(micro_batch=1, global_batch=4, precision="bf16-true", dp_stack="deepspeed")
    for zero, gradients in ((1, 266_752), (2, 66_688)):
        config = Config(model=model, training=training, parallel=dict(dp=4, zero=zero))
        mem = stage_memory(model, (), training, PlanValues.from_config(config), 0)
        assert (mem.trained_params, mem.gradients, mem.optimizer) == (133_376, gradients, 133_376)


def test_the_planners_arrays_count_as_the_scalars(tmp_path):
    """`search` evaluates the same stage_memory on arrays (one element per plan): ZeRO 0..3 over d = 4 for DeepSeek-V3.2's
    tiny config, each element equal to the scalar plan's."""
    model = _model("deepseek_v32", tmp_path)
    training = TrainingSpec(micro_batch=1, global_batch=4, precision="bf16-true")
    one = PlanValues.from_config(Config(model=model, training=training, parallel=dict(dp=4)))
    zero = np.arange(4)
    many = stage_memory(model, (), training, dataclasses.replace(one, zero=zero, d=np.full(4, 4), shard=np.full(4, 4)), 0)
    for z in range(4):
        alone = stage_memory(model, (), training, dataclasses.replace(one, zero=z), 0)
        assert (np.broadcast_to(many.trained_params, 4)[z], many.gradients[z], many.optimizer[z]) == (
            alone.trained_params, alone.gradients, alone.optimizer)
    assert many.gradients[0] == 382_112 and many.optimizer[1] == 764_224 // 4  # measured, module docstring


def test_optimizer_offload_stages_only_the_trained_parameters(tmp_path):
    """Optimizer offload of all of Pegasus' states (bf16-true): the host steps the 99,840 trained parameters (measured),
    their two moments 4 B each on the host (399,360 B), pinned staging of a gradient buffer and a 16-bit clone, 2 + 2
    B each (399,360 B); the frozen table and the cross-attention stage nothing."""
    model = _model("pegasus", tmp_path)
    training = TrainingSpec(micro_batch=1, global_batch=1, precision="bf16-true", offload_optimizer_fraction=1.0)
    mem = stage_memory(model, (), training, PlanValues.from_config(Config(model=model, training=training)), 0)
    host = host_bytes(model, (), training, PlanValues.from_config(Config(model=model, training=training)), mem)
    assert (host.optimizer, host.staging) == (399_360, 399_360)


@pytest.mark.parametrize("model_type", ["roformer", "pegasus"])
def test_the_timeline_and_the_stream_make_no_gradient_for_them(model_type, tmp_path):
    """torch .grad tensors (one micro-batch) made layer by layer: between the same moment of layer 2's and layer 1's
    backward, one layer's gradients appear. By hand (h = 64, f = 128, bf16): attention 4 x 64 x 64 + 4 x 64 = 16,640,
    MLP 2 x 64 x 128 + 128 + 64 = 16,576, two LayerNorms 256: 33,472 parameters, 66,944 B; Pegasus' encoder_attn
    (16,640) and its LayerNorm (128) make none. Once the embedding's are made, the measured gradient bytes; the
    allocation stream's optimizer steps only the trained tensors, and no .grad row is an untrained group's. (The
    activations are the decoder-only reference layer's: only the gradients are checked.)"""
    model = _model(model_type, tmp_path)
    _, with_grad, grad_bytes, _, _ = MEASURED[model_type]
    plain = model.model_copy(update=dict(encoder_kind=None, frozen_position_rows=0, attention="eager", mlp="gelu",
                                         norm="layernorm"))
    inv = dataclasses.replace(training_inventory(plain, "torch", "cpu", TRAINING), grad_lifetime="backward")
    plan = PlanValues.from_config(Config(model=model, training=TRAINING))
    mem = stage_memory(model, inv.terms, TRAINING, plan, 0)
    events = step_events(model, inv, TRAINING, plan, mem, 0).events
    grads = {(e.layer, e.moment): e.parts["gradients"] for e in events if e.phase == "backward"}
    assert {grads[1, m] - grads[2, m] for (j, m) in grads if j == 2} == {66_944}
    assert [e.parts["gradients"] for e in events if e.phase == "optimizer"] == [grad_bytes]
    assert max(grads.values()) == grad_bytes
    pers = Persistent(model, inv, TRAINING, plan, mem, model.num_layers, True, True)
    assert sum(n for *_, n in pers.trained()) == with_grad
    untrained = {g.name for g in param_groups(model) if not g.trained}
    assert untrained and not any(group in untrained for _, group in pers.grad_rows)


def test_deepseek_v32_trains_deepseek_v3s_parameters(tmp_path):
    """DeepseekV32Config's defaults: 671,877,929,216 parameters, of which the indexer's 61 x 13,959,424 = 851,524,864
    (hand derivation in tests/test_indexers.py) get no gradient; the rest is DeepSeek-V3's 671,026,404,352. bf16-mixed
    (no parallelism): gradients 4 B and master + moments 12 B per trained parameter, weights 2 B per parameter."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**transformers.DeepseekV32Config().to_dict(),
                                "architectures": ["DeepseekV32ForCausalLM"]}))
    preset = read_hf_config(str(path))
    model = preset.model
    assert any("runs under torch.no_grad" in n and "no gradient or optimizer state" in n for n in preset.notes)
    training = TrainingSpec(micro_batch=1, global_batch=1, precision="bf16-mixed")
    mem = stage_memory(model, (), training, PlanValues.from_config(Config(model=model, training=training)), 0)
    assert (mem.params, mem.trained_params) == (671_877_929_216, 671_026_404_352)
    assert (mem.weights, mem.gradients, mem.optimizer) == (2 * 671_877_929_216, 4 * 671_026_404_352, 12 * 671_026_404_352)


@pytest.mark.skipif(not os.environ.get("MEMPLAN_UNTRAINED_SLOW"), reason="~5 s of CPU in all: MEMPLAN_UNTRAINED_SLOW=1")
@pytest.mark.parametrize("model_type", sorted(MEASURED))
def test_the_recorded_figures_are_a_real_step(model_type):
    from validation.untrained import measure_untrained

    m = measure_untrained(tiny_config(model_type))
    assert (m["params"], m["grad_params"], m["grad_bytes"], m["state_params"], m["state_bytes"]) == MEASURED[model_type]
