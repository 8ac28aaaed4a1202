"""torch.compile per decoder layer (`--compile`, memplan/inventory/compiled.py) against the compiled layer on CPU.

The expected values are measurements of transformers 5.23's LlamaDecoderLayer (sdpa, bf16) compiled by torch 2.13 on
CPU (validation/compiled.py: h 60, f 154, a 6, g 2, head 8, so q 48; s 20, b 2 = 40 tokens):

    PYTHONPATH=. python -m validation.compiled inductor   # or: aot (AOTAutograd + inductor's partitioner, no C++)

prints the forward graph's saved tensors and "after forward 72480 B (output 4800 B), eager 104000 B": the compiled
layer keeps 72,480 - 4,800 = 67,680 B = 1,692 B per token (its input included: the window makes the input), the eager
layer 104,000 - 4,800 = 99,200 B = 2,480 B per token. The suite runs the "aot" route (seconds); the inductor route,
whose C++ compile takes ~20 s of CPU, runs with MEMPLAN_COMPILE_SLOW=1.
"""

import os
from collections import Counter

import pytest

from memplan.check.cases import ValidationCase
from memplan.check.validate import case_model
from memplan.core.errors import MemplanError
from memplan.core.symbolic import Poly
from memplan.core.training import TrainingSpec
from memplan.inventory import compiled
from memplan.inventory.assemble import training_inventory

S, B, H, F, A, G, D = 20, 2, 60, 154, 6, 2, 8
BYTES = {"act": 2, "fp32": 4, "int64": 8}
TOKENS = S * B
COMPILED_PER_TOKEN = (72480 - 4800) // TOKENS  # measured, the docstring's command: 1,692 B
EAGER_PER_TOKEN = (104000 - 4800) // TOKENS  # measured, the same run: 2,480 B


def _model():
    return case_model(ValidationCase("llama compile", "layer", impl="hf-sdpa", s=S, b=B, h=H, a=A, f=F, t=1,
                                     sp=False, recompute="none", backend="ledger", arch="llama", g=G, head_dim=D,
                                     dropout=0.0))


def _layer_bytes(training: TrainingSpec) -> int:
    model = _model()
    inv = training_inventory(model, "hf-sdpa", "cpu", training)
    vals = dict(s=S, b=B, h=H, a=A, f=F, g=G, q=A * D, v=model.vocab_size, t=1)
    return sum(t.elements.evaluate(vals) * BYTES[t.dtype] for t in inv.terms if t.scope == "layer" and not t.only_full)


def test_compiled_layer_bytes_equal_the_cpu_measurement():
    # fails when a compiled term is taken out (or the eager terms are left in)
    assert _layer_bytes(TrainingSpec(compile=True)) == COMPILED_PER_TOKEN * TOKENS
    # eager transformers' inventory equals the same run's eager measurement (the layer input not kept)
    assert _layer_bytes(TrainingSpec()) == EAGER_PER_TOKEN * TOKENS


def test_compiled_layer_moments_free_compiled_tensors():
    inv = training_inventory(_model(), "hf-sdpa", "cpu", TrainingSpec(compile=True))
    ids = {t.id for t in inv.terms}
    layer = [m for m in inv.moments if m.scope == "layer"]
    assert layer and all(m.source == compiled.MOMENTS for m in layer)
    attention = next(m for m in layer if m.id == "attention_backward")
    assert set(attention.freed) <= ids and {"o_proj_out", "attn_out", "fc2_input"} <= set(attention.freed)


def _check_trace(route: str) -> None:
    from validation.compiled import trace_compiled_layer

    r = trace_compiled_layer(route)
    # what the forward graph hands the backward (parameters apart) is the table, term by term
    dtype = {"act": "bfloat16", "fp32": "float32"}
    traced = Counter((Poly.parse_sum(t.elements), t.dtype) for t in r.saved if t.kind != "parameter")
    table = Counter((Poly.parse_sum(e), dtype[d]) for _, _, _, e, d in compiled.LAYER)
    table[(Poly.parse_sum("s q /a"), "bfloat16")] += 2  # the rotary cos / sin (hf.py's rope_cos / rope_sin)
    assert traced == table
    # and the bytes the compiled layer keeps are the measured ones
    assert (r.s, r.b) == (S, B)
    assert r.after_forward - r.output_bytes == COMPILED_PER_TOKEN * TOKENS
    assert r.eager_after_forward - r.output_bytes == EAGER_PER_TOKEN * TOKENS


def test_partitioner_saves_the_table_aot():
    pytest.importorskip("transformers")
    _check_trace("aot")


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("MEMPLAN_COMPILE_SLOW"), reason="set MEMPLAN_COMPILE_SLOW=1 to run")
def test_partitioner_saves_the_table_inductor():
    pytest.importorskip("transformers")
    _check_trace("inductor")


@pytest.mark.parametrize("impl", ["torchtune", "torchtitan", "hf-eager", "megatron"])
def test_compile_refused_elsewhere(run_cli, impl):
    code, out, err = run_cli("estimate", "--model", "llama3-8b", "--impl", impl, "--gpus", "8", "--tp", "1",
                             "--compile")
    assert code == 2 and "--compile" in err and "Traceback" not in err


def test_compile_refuses_liger():
    with pytest.raises(MemplanError, match="--liger"):
        training_inventory(_model(), "hf-sdpa", "cpu", TrainingSpec(compile=True, liger=True))


def test_estimate_says_what_is_traced(run_cli):
    code, out, err = run_cli("estimate", "--model", "llama3-8b", "--impl", "hf-sdpa", "--seq-len", "2048", "--compile")
    assert code == 0, err
    assert "traced from torch.compile's partitioner (torch 2.13, inductor on CPU" in out
    assert "Inductor's fused kernels' own buffers left out" in out
