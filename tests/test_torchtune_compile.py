"""--impl torchtune --compile --loss-chunks N: torchtune's CEWithChunkedOutputLoss compiled as its recipes'
compile_loss compiles it (memplan/inventory/tune_loss.py compiled_loss_terms) against its CPU run.

The expected bytes are measurements of torchtune 0.6.1's own model and loss (h 32, a 4, g 2, f 48, v 64, 2 layers),
`compute_cross_entropy` compiled by torch 2.13's inductor on CPU, read off torch.profiler's allocation events
(validation/compiled.py measure_compiled_tune_loss); tests/data/torchtune_compiled_loss.json was written by

    PYTHONPATH=. python -m validation.compiled loss tests/data/torchtune_compiled_loss.json

(about 50 s of CPU: inductor's C++ compile, once per shape). The suite checks memplan against that file and runs the
same measurement by the "aot" route (AOTAutograd with inductor's partitioner, its graphs run by torch, no C++: the
same saved tensors, not inductor's fused peaks); MEMPLAN_COMPILE_SLOW=1 reruns the inductor measurement.
"""

import dataclasses
import json
import os
from pathlib import Path

import pytest

pytest.importorskip("torchao")
pytest.importorskip("datasets")  # torchtune's own dependencies

from memplan.inventory import compiled, tune_loss  # noqa: E402
from memplan.plan.estimate import estimate  # noqa: E402
from memplan.presets.batch import make_config  # noqa: E402
from memplan.presets.files import ModelPreset  # noqa: E402
from memplan.presets.hf_config import read_hf_config  # noqa: E402
from validation.compiled import measure_compiled_tune_loss  # noqa: E402
from validation.torchtune import import_torchtune  # noqa: E402

try:
    import_torchtune()
except ImportError:  # torchtune not installed (the test extra installs it)
    pytest.skip("torchtune not installed", allow_module_level=True)

DATA = json.loads((Path(__file__).parent / "data" / "torchtune_compiled_loss.json").read_text())
CASES = DATA["cases"]
DIMS = ("vocab", "layers", "heads", "kv_heads", "hidden", "ffn")
SLOW = pytest.mark.skipif(not os.environ.get("MEMPLAN_COMPILE_SLOW"), reason="set MEMPLAN_COMPILE_SLOW=1 to run")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    c = CASES[0]
    path = tmp_path_factory.mktemp("ttc") / "config.json"
    path.write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c["hidden"],
        "intermediate_size": c["ffn"], "num_attention_heads": c["heads"], "num_key_value_heads": c["kv_heads"],
        "num_hidden_layers": c["layers"], "vocab_size": c["vocab"], "max_position_embeddings": 4096,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False}))
    return read_hf_config(str(path)).model


def _memplan_loss(model, s: int, b: int, chunks: int) -> dict[str, int]:
    """memplan's figures as the measurement counts them: from what the model holds at its output, less the logits.
    `saved`: the compiled loss's saved terms; each loss moment: its bytes (saved, transient, gradients) less the
    saved tensors that are not the loss's."""
    config = make_config(ModelPreset(model), training=dict(micro_batch=b, loss_chunks=chunks, precision="bf16-true",
                                                           compile=True), model=dict(seq_length=s))
    est = estimate(config, impl="torchtune", device="cpu")
    loss = sum(r.stage_bytes for r in est.rows if r.term.id in tune_loss.COMPILED_SAVED)
    others = est.stages[0].activations - loss
    names = {m.name: m.id for m in est.inventory.moments if m.scope == "last"}
    out = {names[e.moment]: e.parts["saved"] + e.parts["transient"] + e.parts["gradients"] - others
           for e in est.step.events if e.moment in names}
    return {"saved": loss, "after_forward": loss, **out}


def _matches(got: dict, case: dict) -> bool:
    """Within 16 B: the measurement also holds the loss scalars (4 B each). With b = 1 the chunks' targets are views
    of the shifted labels (no copies) and the forward peaks at the token count (the labels' bool mask and its int64
    sum buffer, s b + 8 s b bytes, beside the logits): memplan counts the shifted labels beside the targets, on the
    safe side by up to 8 s b bytes there, as for the eager loss."""
    forward = got["loss_forward"] - case["loss_forward"]
    return (got["saved"] == case["saved"] and all(abs(case[k] - got[k]) <= 16 for k in ("after_forward", "loss_backward"))
            and (0 <= forward <= 8 * case["s"] if case["b"] == 1 else abs(forward) <= 16))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"N{c['chunks']}-b{c['b']}")
def test_compiled_loss_equals_its_cpu_run(model, case):
    assert _matches(_memplan_loss(model, case["s"], case["b"], case["chunks"]), case)
    # the compiled loss keeps the bf16 logits (2 s b v) and two fp32 per token where the eager one keeps an fp32
    # log-softmax (4 s b v) and N fp32 total weights: 2 s b v + 4 (N - 2 s b) bytes less
    s, b, n, v = case["s"], case["b"], case["chunks"], case["vocab"]
    eager = make_config(ModelPreset(model), training=dict(micro_batch=b, loss_chunks=n, precision="bf16-true"),
                        model=dict(seq_length=s))
    eager_saved = sum(r.stage_bytes for r in estimate(eager, impl="torchtune", device="cpu").rows
                      if r.term.id in tune_loss.EAGER_SAVED)
    assert eager_saved - case["saved"] == 2 * s * b * v + 4 * (n - 2 * s * b)


@pytest.mark.parametrize("removed", ["logits_bf16", "loss_row_stats", "shifted_labels", "grad_logits_chunk",
                                     "grad_row_sum"])
def test_removing_a_compiled_loss_tensor_fails(model, monkeypatch, removed):
    def drop(m):
        return dataclasses.replace(m, transients=tuple(t for t in m.transients if t.id != removed))

    monkeypatch.setattr(compiled, "compiled_loss_terms",
                        lambda n: [t for t in tune_loss.compiled_loss_terms(n) if t.id != removed])
    monkeypatch.setattr(compiled, "tune_loss_forward", lambda n, c: drop(tune_loss.tune_loss_forward(n, c)))
    monkeypatch.setattr(compiled, "tune_chunked_backward",
                        lambda n, c: [drop(m) for m in tune_loss.tune_chunked_backward(n, c)])
    case = CASES[0]
    assert not _matches(_memplan_loss(model, case["s"], case["b"], case["chunks"]), case)


def test_whole_loss_stays_eager(model):
    # full_finetune_single_device calls training.compile_loss(self._loss_fn) without keeping what it returns: a
    # whole (unchunked) loss runs eager, so --compile leaves its saved tensors as they are (the layers' change)
    def loss_saved(compile):
        config = make_config(ModelPreset(model), training=dict(micro_batch=2, precision="bf16-true", compile=compile),
                             model=dict(seq_length=64))
        return sorted((r.term.id, r.stage_bytes) for r in estimate(config, impl="torchtune", device="cpu").rows
                      if r.term.scope == "last")
    assert loss_saved(True) == loss_saved(False)


def test_aot_route_keeps_what_inductor_keeps():
    # the same compiled loss through AOTAutograd's partitioner without inductor's code generation (seconds): the
    # same saved storages and the same bytes alive after the loss forward as the inductor run on file
    case = CASES[0]
    got = measure_compiled_tune_loss(case["s"], case["b"], chunks=case["chunks"], route="aot",
                                     **{k: case[k] for k in DIMS})
    assert (got["saved"], got["after_forward"]) == (case["saved"], case["after_forward"])


@SLOW
def test_inductor_measurement_is_the_file():
    case = CASES[0]
    got = measure_compiled_tune_loss(case["s"], case["b"], chunks=case["chunks"], **{k: case[k] for k in DIMS})
    assert got == {k: case[k] for k in got}


def test_published_llama32_3b_chunked_compiled_row():
    # torchtune's README "Optimization flags" table (pytorch/torchtune @a9ea6d5, docs/guide.md): Llama 3.2 3B,
    # full_finetune_single_device, b 2, packed 4,096 tokens, compile, CEWithChunkedOutputLoss: 42.9 GiB. With the
    # compiled loss memplan's allocated peak is within 1 % of it; with the eager loss's fp32 log-softmax it was 6 % above
    llama = read_hf_config(str(Path(__file__).parent.parent / "docs" / "torchtune" / "llama3.2-3b.json")).model
    config = make_config(ModelPreset(llama), training=dict(micro_batch=2, precision="bf16-true", loss_chunks=8,
                                                           compile=True), model=dict(seq_length=4096))
    est = estimate(config, impl="torchtune", device="cuda")
    assert abs(est.step.peak_bytes / 2**30 - 42.9) <= 0.01 * 42.9
    # the estimate says what is measured and what is derived
    assert any("CEWithChunkedOutputLoss's compute_cross_entropy" in n and "CUDA derived" in n for n in est.notes)


def test_compiled_loss_tensors_are_freed_by_the_head_backward(model):
    # every chunk's compiled backward frees its saved chunk and statistics before the output projection's backward
    # (measured: the loss backward's peak is the first chunk's; the head's moments and the final norm's hold none)
    config = make_config(ModelPreset(model), training=dict(micro_batch=2, loss_chunks=4, precision="bf16-true",
                                                           compile=True), model=dict(seq_length=64))
    moments = {m.id: m for m in estimate(config, impl="torchtune", device="cpu").inventory.moments}
    for later in ("head_backward", "head_weight_sum", "final_norm_backward"):
        assert set(tune_loss.COMPILED_SAVED) <= set(moments[later].freed), later
