"""peft's DoRA (`--lora R --dora`, memplan/inventory/lora.py dora_terms, memplan/memory/adapters.py): what its
DoraLinearLayer saves beyond LoRA and its magnitude vectors, against peft 0.21.2 run on CPU (validation/dora.py)."""

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

from memplan.core.model import ModelSpec  # noqa: E402
from memplan.core.specs import Config  # noqa: E402
from memplan.core.training import TrainingSpec  # noqa: E402
from memplan.inventory.assemble import training_inventory  # noqa: E402
from memplan.memory.adapters import adapter_groups  # noqa: E402
from memplan.memory.term_bytes import PlanValues, term_bytes_for  # noqa: E402
from validation.dora import measure_dora  # noqa: E402

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# transformers' Llama, h 64, f 160, a 4 (q 64), g 2 (k, v 32 wide), L 2, v 128, r 8, every linear a target
SHAPE = dict(hidden=64, ffn=160, heads=4, kv_heads=2, layers=2, vocab=128, rank=8, targets=ALL)


def _model(s):
    return ModelSpec(name="t", num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2, seq_length=s,
                     vocab_size=128, ffn_hidden_size=160, norm="rmsnorm", mlp="swiglu", position_embedding="rope",
                     tied_embeddings=False, bias=False, dropout=False)


def _training(b, dora):
    return TrainingSpec(micro_batch=b, global_batch=b, precision="bf16-true", lora_rank=8, lora_targets=ALL,
                        lora_dora=dora)


@pytest.mark.parametrize("s", [32, 64])
def test_dora_saves_what_peft_saves(s):
    """By hand, per target (in, out) beyond LoRA: the fp32 identity in^2 x 4 B, its A output in r x 4 B, three
    out-vectors 3 out x 4 B and the base (bf16) and adapter (fp32) outputs s b out x (2 + 4) B. Per layer (outs 64, 32,
    32, 64, 160, 160, 64 = 576; ins 64 six times, 160 once): 200,704 + 17,408 + 6,912 + 3,456 s b B. Measured: 512 B
    less at every s: the first layer's m / |W| - 1 of q, k and v ((64 + 32 + 32) x 4 B), unsaved because their input
    (the frozen embedding's, normalised by a frozen norm) needs no gradient; memplan keeps it on the safe side, as the
    first layer's norm tensors with LoRA (tests/test_lora.py)."""
    b = 2
    measured = (measure_dora(s, b, dora=True, **SHAPE)["saved"]
                - measure_dora(s, b, dora=False, **SHAPE)["saved"])
    model = _model(s)
    training = _training(b, True)
    sizes = term_bytes_for(model, PlanValues.from_config(Config(model=model, training=training)), 2)
    inv = training_inventory(model, "hf-sdpa", "cpu", training)
    predicted = 2 * sum(sizes(t) for t in inv.terms if t.id.startswith("dora_"))
    assert predicted == 2 * (200_704 + 17_408 + 6_912 + 3_456 * s * b)
    assert predicted - measured == 512


def test_magnitude_vectors_are_trained():
    """DoRA adds one fp32 magnitude per output feature of each target: 576 per layer, 1,152 for L = 2 (measured)."""
    measured = (measure_dora(32, 2, dora=True, **SHAPE)["trainable"]
                - measure_dora(32, 2, dora=False, **SHAPE)["trainable"])
    values = _model(32).symbols(t=1)

    def count(dora):
        return sum(g.count.evaluate(values) for g in adapter_groups(_model(32), _training(2, dora)).values())

    assert measured == 1_152 == 2 * (count(True) - count(False))


@pytest.mark.parametrize("args, fragment", [
    (["--dora"], "need --lora R"),
    (["--lora", "8", "--dora", "--qlora"], "DoRA (--dora) is modelled"),
    (["--lora", "8", "--dora", "--lora-dropout", "0.1"], "DoRA (--dora) is modelled"),
])
def test_dora_bad_input(run_cli, args, fragment):
    code, _, err = run_cli("estimate", "--model", "llama3-8b", "--impl", "hf-sdpa", "--gpus", "1", "--tp", "1",
                           "--pp", "1", *args)
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1
