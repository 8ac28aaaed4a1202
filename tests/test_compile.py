"""torch.compile per decoder layer (`--compile`, memplan/inventory/compiled.py) against the compiled layer on CPU.

The expected values are measurements of transformers 5.23's LlamaDecoderLayer (sdpa, bf16) compiled by torch 2.13 on
CPU (validation/compiled.py: h 60, f 154, a 6, g 2, head 8, so q 48; s 20, b 2 = 40 tokens):

    PYTHONPATH=. python -m validation.compiled inductor   # or: aot (AOTAutograd + inductor's partitioner, no C++)

prints the forward graph's saved tensors and "after forward 72480 B (output 4800 B), eager 104000 B": the compiled
layer keeps 72,480 - 4,800 = 67,680 B = 1,692 B per token (its input included: the window makes the input), the eager
layer 104,000 - 4,800 = 99,200 B = 2,480 B per token. torchtune 0.6.1's layer (llama3_2 builder, h 48, f 154, a 6,
g 2; `python -m validation.compiled inductor torchtune`, the aot route the same): "after forward 72800 B (output
3840 B), eager 108160 B": 1,724 B per token compiled, 2,608 B eager. torchtitan 0.3.0's Llama 3 block
(validation/titan.py's, sdpa for FlexAttention, h 48; `... inductor torchtitan`), called with the dataloader's
positions as torchtitan's Trainer calls it: "after forward 68960 B (output 3840 B), eager 104320 B":
1,628 B per token compiled, 2,512 B eager (without the positions, as traced before: 67,680 B and 103,040 B,
1,596 and 2,480 B per token: both keep the RoPE rows gathered at them, 4d = 32 B per token). The same block wrapped in torchtitan's
SelectiveAC (--ac selective-op), then compiled, as torchtitan applies AC before apply_compile
(`trace_compiled_layer("inductor", "torchtitan", ac="selective-op")`, dynamic, s 20, b 2): "after forward 31200 B
(output 3840 B), eager 40096 B": 684 B per token compiled; eager SelectiveAC 780 B per token plus the CPU generator's
state (5,056 B, torch.get_rng_state(), which torch.utils.checkpoint's preserve_rng_state stashes once per
checkpointed block). The suite runs transformers' layer by the "aot"
route with static shapes (~2 s of CPU); the symbolic trace through inductor, whose C++ compile takes ~20 s of CPU,
and torchtune's run with MEMPLAN_COMPILE_SLOW=1.
"""

import json
import os
from collections import Counter

import pytest

from memplan.check.cases import ValidationCase
from memplan.check.validate import case_model
from memplan.core.errors import MemplanError
from memplan.core.symbolic import Poly
from memplan.core.training import Recompute, TrainingSpec
from memplan.inventory import compiled
from memplan.inventory.assemble import training_inventory

S, B, H, F, A, G, D = 20, 2, 60, 154, 6, 2, 8
BYTES = {"act": 2, "fp32": 4, "int64": 8}
TOKENS = S * B
COMPILED_PER_TOKEN = (72480 - 4800) // TOKENS  # measured, the docstring's command: 1,692 B
EAGER_PER_TOKEN = (104000 - 4800) // TOKENS  # measured, the same run: 2,480 B
TUNE_H = 48  # torchtune's heads are h / a wide: q = h
TUNE_COMPILED_PER_TOKEN = (72800 - 3840) // TOKENS  # measured, the docstring's torchtune command: 1,724 B
TUNE_EAGER_PER_TOKEN = (108160 - 3840) // TOKENS  # measured, the same run: 2,608 B
TITAN_COMPILED_PER_TOKEN = (68960 - 3840) // TOKENS  # measured, the docstring's torchtitan command: 1,628 B
TITAN_EAGER_PER_TOKEN = (104320 - 3840) // TOKENS  # measured, the same run: 2,512 B
TITAN_ROPE_ROWS = 4 * 8  # the RoPE rows gathered at the positions: d/2 complex64 = 4d B per token at d 8
RNG_STATE = 5056  # torch.get_rng_state()'s bytes: stashed by each eager checkpoint (preserve_rng_state), no s or b
SAC_COMPILED_PER_TOKEN = (31200 - 3840) // TOKENS  # measured, the docstring's selective-op command: 684 B
SAC_EAGER_PER_TOKEN = (40096 - 3840 - RNG_STATE) // TOKENS  # measured, the same run: 780 B
MEASURED = {"hf-sdpa": (COMPILED_PER_TOKEN, EAGER_PER_TOKEN), "torchtune": (TUNE_COMPILED_PER_TOKEN, TUNE_EAGER_PER_TOKEN),
            "torchtitan": (TITAN_COMPILED_PER_TOKEN, TITAN_EAGER_PER_TOKEN),
            "torchtitan-sac": (SAC_COMPILED_PER_TOKEN, SAC_EAGER_PER_TOKEN)}
SLOW = pytest.mark.skipif(not os.environ.get("MEMPLAN_COMPILE_SLOW"), reason="set MEMPLAN_COMPILE_SLOW=1 to run")


def _model(impl: str = "hf-sdpa"):
    h, d = (H, D) if impl == "hf-sdpa" else (TUNE_H, None)
    return case_model(ValidationCase("llama compile", "layer", impl=impl, s=S, b=B, h=h, a=A, f=F, t=1,
                                     sp=False, recompute="none", backend="ledger", arch="llama", g=G, head_dim=d,
                                     dropout=0.0))


def _layer_bytes(training: TrainingSpec, impl: str = "hf-sdpa", drop: str = "") -> int:
    model = _model(impl)
    inv = training_inventory(model, impl, "cpu", training)
    h = H if impl == "hf-sdpa" else TUNE_H
    vals = dict(s=S, b=B, h=h, a=A, f=F, g=G, q=A * D, v=model.vocab_size, t=1)
    return sum(t.elements.evaluate(vals) * BYTES[t.dtype] * t.kept(training.recompute) for t in inv.terms
               if t.scope == "layer" and not t.needs_tp and not t.needs_cp  # t = cp = 1: no TP- or CP-only term
               and t.id != drop)


def test_compiled_layer_bytes_equal_the_cpu_measurement():
    # fails when a compiled term is taken out (or the eager terms are left in)
    assert _layer_bytes(TrainingSpec(compile=True)) == COMPILED_PER_TOKEN * TOKENS
    # eager transformers' inventory equals the same run's eager measurement (the layer input not kept)
    assert _layer_bytes(TrainingSpec()) == EAGER_PER_TOKEN * TOKENS


@pytest.mark.parametrize("impl", ["torchtune", "torchtitan"])
def test_compiled_tune_titan_layer_bytes_equal_the_cpu_measurement(impl):
    assert _layer_bytes(TrainingSpec(compile=True), impl) == MEASURED[impl][0] * TOKENS
    assert _layer_bytes(TrainingSpec(), impl) == MEASURED[impl][1] * TOKENS


def test_compiled_titan_block_keeps_the_rope_rows_gathered_at_the_positions():
    # torchtitan's compiled block, called with the dataloader's positions, saves the RoPE rows gathered at them
    # (measured above: 32 B per token more than the same block called without positions, 1,596 B); memplan's
    # rope_rows term holds them, so taking it out breaks the measured match
    assert TITAN_COMPILED_PER_TOKEN == (67680 - 3840) // TOKENS + TITAN_ROPE_ROWS
    rows = [t for t in compiled.compiled_terms("torchtitan") if t.id == "rope_rows"]
    assert len(rows) == 1 and rows[0].dtype == "fp32" and rows[0].elements == Poly.parse_sum("s b q /a")
    without = _layer_bytes(TrainingSpec(compile=True), "torchtitan", drop="rope_rows")
    assert without != TITAN_COMPILED_PER_TOKEN * TOKENS == without + TITAN_ROPE_ROWS * TOKENS
    # selective-op and full recompute the gather (a checkpointed block keeps the positions, held by the loop)
    assert not rows[0].kept(Recompute.SELECTIVE) and not rows[0].kept(Recompute.FULL)


def test_compiled_titan_selective_op_layer_bytes_equal_the_cpu_measurement():
    # torchtitan's SelectiveAC block compiled: fails when a term of compiled.TITAN_SAC is taken out (or the compiled
    # no-AC terms it drops are left in)
    sac = Recompute.SELECTIVE
    assert _layer_bytes(TrainingSpec(compile=True, recompute=sac), "torchtitan") == SAC_COMPILED_PER_TOKEN * TOKENS
    # the eager SelectiveAC inventory (memplan/inventory/titan.py) equals the same run's eager measurement
    assert _layer_bytes(TrainingSpec(recompute=sac), "torchtitan") == SAC_EAGER_PER_TOKEN * TOKENS
    # hand check of the table at these widths (h 48, a 6, g 2, head 8, f 154; bytes per token): the block input 2h
    # 96, the fused QKV output 2(a + 2g)d 160, the attention output 2ad 96 and log-sum-exp 4a 24, w1's output 2f 308
    assert SAC_COMPILED_PER_TOKEN == 96 + 160 + 96 + 24 + 308
    # and the compiled block without AC is unchanged by the selective-op table beside it
    assert _layer_bytes(TrainingSpec(compile=True), "torchtitan") == TITAN_COMPILED_PER_TOKEN * TOKENS


def test_compiled_layer_moments_free_compiled_tensors():
    inv = training_inventory(_model(), "hf-sdpa", "cpu", TrainingSpec(compile=True))
    ids = {t.id for t in inv.terms}
    layer = [m for m in inv.moments if m.scope == "layer"]
    assert layer and all(m.source == compiled.MOMENTS for m in layer)
    attention = next(m for m in layer if m.id == "attention_backward")
    assert set(attention.freed) <= ids and {"o_proj_out", "attn_out", "fc2_input"} <= set(attention.freed)


def _check_trace(route: str, impl: str = "hf-sdpa", dynamic: bool = True, ac: str = "none") -> None:
    from validation.compiled import trace_compiled_layer

    # static shapes: traced and measured at s 20, b 5 (no size equal to a width); dynamic: traced with symbolic s, b
    # (hinted 24, 3), measured at s 20, b 2 by the same kernel
    r = trace_compiled_layer(route, impl, ac=ac) if dynamic else trace_compiled_layer(route, impl, 20, 5, dynamic=False, ac=ac)
    # what the forward graph hands the backward (parameters and buffers apart) is the table, term by term; where
    # q = h (torchtune) the two name one width
    dtype = {"act": "bfloat16", "fp32": "float32"}
    same = (lambda e: e) if impl == "hf-sdpa" else (lambda e: e.replace("q", "h"))
    # torchtitan's block is called with the dataloader's positions (int64 s b, a batch input the training loop holds:
    # memplan's held ``positions``), which a checkpointed block saves; its complex64 RoPE rows count as fp32 pairs
    positions = (Poly.parse_sum("s b"), "int64")
    traced = Counter((Poly.parse_sum(same(t.elements)), t.dtype.replace("complex64", "float32")) for t in r.saved
                     if t.kind != "parameter" and not (t.kind == "input" and (Poly.parse_sum(t.elements), t.dtype) == positions))
    rows = compiled.TITAN_SAC if ac == "selective-op" else compiled.TABLES[impl]
    table = Counter((Poly.parse_sum(same(e)), dtype[d]) for _, _, _, e, d in rows)
    if impl == "hf-sdpa":
        table[(Poly.parse_sum("s q /a"), "bfloat16")] += 2  # the rotary cos / sin (hf.py's rope_cos / rope_sin)
    assert traced == table
    # and the bytes the compiled layer keeps are the measured ones
    assert (r.s, r.b) == ((S, B) if dynamic else (20, 5))
    kept = MEASURED[impl + ("-sac" if ac == "selective-op" else "")]
    assert r.after_forward - r.output_bytes == kept[0] * r.s * r.b
    rng = RNG_STATE if ac == "selective-op" else 0  # the eager checkpoint's stashed generator state
    assert r.eager_after_forward - r.output_bytes == kept[1] * r.s * r.b + rng


def test_partitioner_saves_the_table_aot():
    # the suite's check: static shapes, AOTAutograd with inductor's partitioner, no C++ (~2 s of CPU)
    pytest.importorskip("transformers")
    _check_trace("aot", dynamic=False)


def test_partitioner_saves_the_titan_table_aot():
    # torchtitan's block compiled without AC, with the dataloader's positions: the fast route (static shapes, ~4 s)
    pytest.importorskip("torchtitan")
    _check_trace("aot", "torchtitan", dynamic=False)


def test_partitioner_saves_the_selective_op_table_aot():
    # torchtitan's SelectiveAC block compiled: the fast route (static shapes, AOTAutograd with inductor's partitioner
    # and the SAC tags, no C++); the dynamic inductor trace of the docstring with MEMPLAN_COMPILE_SLOW=1
    pytest.importorskip("torchtitan")
    _check_trace("aot", "torchtitan", dynamic=False, ac="selective-op")


@pytest.mark.slow
@SLOW
def test_partitioner_saves_the_selective_op_table_inductor():
    pytest.importorskip("torchtitan")
    _check_trace("inductor", "torchtitan", ac="selective-op")


@pytest.mark.slow
@SLOW
@pytest.mark.parametrize("impl", ["hf-sdpa", "torchtune", "torchtitan"])
def test_partitioner_saves_the_table_inductor(impl):
    pytest.importorskip("transformers")
    if impl == "torchtitan":
        pytest.importorskip("torchtitan")
    if impl == "torchtune":
        pytest.importorskip("torchao")
        from validation.torchtune import import_torchtune

        try:
            import_torchtune()
        except ImportError:
            pytest.skip("torchtune not installed")
    _check_trace("inductor", impl)


@pytest.mark.parametrize("impl", ["hf-eager", "megatron", "torchtitan"])
def test_compile_refused_elsewhere(run_cli, impl):
    layout = ["--cp", "2"] if impl == "torchtitan" else ["--tp", "1"]  # torchtitan with CP: not traced
    code, out, err = run_cli("estimate", "--model", "llama3-8b", "--impl", impl, "--gpus", "8", *layout, "--compile")
    assert code == 2 and "--compile" in err and "Traceback" not in err


def test_compile_refuses_liger():
    with pytest.raises(MemplanError, match="--liger"):
        training_inventory(_model(), "hf-sdpa", "cpu", TrainingSpec(compile=True, liger=True))


def test_compiled_torchtune_moments_have_all_heads():
    inv = training_inventory(_model("torchtune"), "torchtune", "cpu", TrainingSpec(compile=True))
    attention = next(m for m in inv.moments if m.id == "attention_backward")
    assert attention.source == compiled.MOMENTS
    grad_qkv = next(t for t in attention.transients if t.id == "grad_qkv")
    assert grad_qkv.elements == Poly.parse_sum("3 s b q")  # dQ, dK, dV at all heads (K, V expanded)


def test_issue_24s_command_answers_term_by_term(run_cli):
    # issue 24's done-means command: the compiled selective-op block's terms, each with its source
    code, out, err = run_cli("estimate", "--model", "llama3-8b", "--impl", "torchtitan", "--gpus", "8", "--ac",
                             "selective-op", "--compile", "--json")
    assert code == 0, err
    terms = {t["id"]: t for t in json.loads(out)["activations"]["terms"]}
    layer = {row[0] for row in compiled.TITAN_SAC}
    assert layer <= set(terms) and not {"q", "k", "v", "o_proj_out", "up_out", "fc2_input"} & set(terms)
    assert all(terms[i]["source"].startswith(compiled.SRC) for i in layer)  # + the per-TP-rank measurement
    # llama3-8b, s 8192, b 1: the fused QKV output 2(a + 2g)d = 2 x (32 + 16) x 128 = 12,288 B per token
    assert terms["qkv_out"]["bytes"] == 12288 * 8192


def test_estimate_says_what_is_traced(run_cli):
    code, out, err = run_cli("estimate", "--model", "llama3-8b", "--impl", "hf-sdpa", "--seq-len", "2048", "--compile")
    assert code == 0, err
    text = " ".join(out.split())  # the notes wrap
    assert "traced from torch.compile's partitioner (torch 2.13, inductor on CPU" in text
    assert "Inductor's fused kernels' own buffers left out" in text


# torchtune's LoRA layer (lora_llama3_2, only the adapters trainable, rank 5, no dropout) compiled: the dynamic
# trace `trace_compiled_layer("inductor" | "aot", "torchtune", lora=dict(rank=5, targets=..., dropout=0.0))` at
# s 20, b 2 prints "after forward 75200 B (output 3840 B)" with its recipes' targets (q, v, output_proj, w1, w2, w3)
# and "after forward 57440 B (output 3840 B)" with q and v only: 1,784 and 1,340 B per token. The partitioner saves
# the plain compiled layer's tensors that the adapters' and the input gradients need and each target's A output
# (s b r): with the MLP frozen, not w1 / w3's input nor w2's (as eager LoRA)
TUNE_TARGETS = ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_MEASURED = {TUNE_TARGETS: (75200 - 3840) // TOKENS, ("q_proj", "v_proj"): (57440 - 3840) // TOKENS}


@pytest.mark.parametrize("targets", list(LORA_MEASURED), ids=["recipe-targets", "q-v"])
def test_compiled_torchtune_lora_layer_bytes_equal_the_cpu_measurement(targets):
    training = TrainingSpec(compile=True, lora_rank=5, lora_impl="torchtune", lora_targets=tuple(targets),
                            loss_chunks=2)
    assert _layer_bytes(training, "torchtune") == LORA_MEASURED[targets] * TOKENS


@pytest.mark.slow
@SLOW
def test_compiled_torchtune_lora_layer_aot():
    # the LoRA layer's trace (~25 s of CPU: torchtune's LoRA layer through dynamo): static shapes (s 20, b 5; rank 7, a size no width or s, b has),
    # AOTAutograd with inductor's partitioner; the compiled LoRA layer keeps what memplan's terms give
    pytest.importorskip("torchao")
    from validation.compiled import trace_compiled_layer
    from validation.torchtune import import_torchtune

    try:
        import_torchtune()
    except ImportError:
        pytest.skip("torchtune not installed")
    r = trace_compiled_layer("aot", "torchtune", 20, 5, dynamic=False,
                             lora=dict(rank=7, targets=TUNE_TARGETS, dropout=0.0))
    training = TrainingSpec(compile=True, lora_rank=7, lora_impl="torchtune", loss_chunks=2)
    model = _model("torchtune")
    inv = training_inventory(model, "torchtune", "cpu", training)
    vals = dict(s=20, b=5, h=TUNE_H, a=A, f=F, g=G, q=TUNE_H, v=model.vocab_size, t=1)
    want = sum(t.elements.evaluate(vals) * BYTES[t.dtype] for t in inv.terms
               if t.scope == "layer" and not t.only_full and not t.only_selective)
    assert r.after_forward - r.output_bytes == want


def test_compile_with_torchtune_lora_refuses_what_is_not_traced():
    model = _model("torchtune")
    for extra, match in ((dict(lora_dropout=0.1), "--lora-dropout"), (dict(loss_chunks=1), "--loss-chunks")):
        training = TrainingSpec(**{"compile": True, "lora_rank": 8, "lora_impl": "torchtune", "loss_chunks": 2,
                                   **extra})
        with pytest.raises(MemplanError, match=match):
            training_inventory(model, "torchtune", "cpu", training)


def test_compiled_torchtune_qlora_layer_keeps_the_dequantised_weights():
    # torchtune's QLoRA layer compiled (torchao NF4 needs weights of 16,384 values: h 256, f 704, a 8, g 2, head
    # 32, rank 5, its recipes' targets): the dynamic trace at s 20, b 2 (aot route, the docstring's
    # trace_compiled_layer with lora=dict(..., qlora=True) and these widths) prints "after forward 1766304 B (output
    # 20480 B)"; the LoRA layer of the same widths "after forward 357280 B (output 20480 B)". The difference is every
    # NF4 linear's dequantised bf16 weight, saved by the partitioner: 2 x (2 h h + 2 h 64 + 3 h f) = 1,409,024 B
    s, b, h, f = 20, 2, 256, 704
    model = case_model(ValidationCase("qlora compile", "layer", impl="torchtune", s=s, b=b, h=h, a=8, f=f, t=1,
                                      sp=False, recompute="none", backend="ledger", arch="llama", g=2, head_dim=None,
                                      dropout=0.0))
    vals = dict(s=s, b=b, h=h, a=8, f=f, g=2, q=h, v=model.vocab_size, t=1)

    def layer(qlora):
        training = TrainingSpec(compile=True, lora_rank=5, lora_impl="torchtune", loss_chunks=2, qlora=qlora)
        inv = training_inventory(model, "torchtune", "cpu", training)
        return sum(t.elements.evaluate(vals) * BYTES[t.dtype] for t in inv.terms
                   if t.scope == "layer" and not t.only_full and not t.only_selective)

    assert layer(False) == 357280 - 20480
    assert layer(True) == 1766304 - 20480
    assert 1766304 - 357280 == 2 * (2 * h * h + 2 * h * 64 + 3 * h * f)


@pytest.mark.slow
@SLOW
def test_compiled_torchtune_qlora_layer_aot():
    # the trace behind the QLoRA figures above (~60 s of CPU): the seven dequantised weights are bf16 "constants"
    pytest.importorskip("torchao")
    from validation.compiled import trace_compiled_layer
    from validation.torchtune import import_torchtune

    try:
        import_torchtune()
    except ImportError:
        pytest.skip("torchtune not installed")
    widths, h, f = dict(h=256, f=704, a=8, g=2, d=32), 256, 704
    r = trace_compiled_layer("aot", "torchtune", lora=dict(rank=5, targets=TUNE_TARGETS, dropout=0.0, qlora=True),
                             widths=widths)
    weights = sorted(int(t.elements) for t in r.saved if t.kind == "constant" and t.dtype == "bfloat16")
    assert weights == sorted([h * h, h * 64, h * 64, h * h, h * f, h * f, h * f])
    assert (r.after_forward, r.output_bytes) == (1766304, 20480)


# torchtitan's memory-budget AC (--ac budget:F, compiled): what the partitioner saves at llama3-8b's real widths,
# measured with `PYTHONPATH=. python benchmarks/budget_saved.py 4096 32 8 14336 8192 0 0.1 0.2 0.3 0.4 0.5 0.6 0.7 0.8 0.9 1`
# (the real-size block compiled under FakeTensorMode; the same sets at s 2,048 and 32,768 and at the 70B and 405B
# widths): bytes per token and layer at F = 0, 0.1, ..., 1
BUDGET_MEASURED = (8192, 20480, 28672, 49152, 57344, 77824, 86024, 94344, 94344, 94344, 139912)


@pytest.mark.parametrize("tenths", range(11))
def test_titan_memory_budget_layer_bytes_equal_the_partitioners(tenths):
    from memplan import estimate

    s = 1024
    est = estimate("llama3-8b", impl="torchtitan", gpus=8, seq_len=s, micro_batch=1, global_batch=8,
                   ac=f"budget:{tenths / 10:g}", compile=True).estimate
    assert est.per_layer_bytes == BUDGET_MEASURED[tenths] * s
    # by hand (h 4096, a 32, g 8, d 128, f 14336): F = 0 the block input 2h; F = 0.5 the input, q 2h, k and v 2gd
    # each, w1's and w3's outputs 2f each; F = 1 the plain compiled block (TITAN_LAYER: transformers' compiled layer's
    # 139,400 B, reference.md, and the RoPE rows gathered at the dataloader's positions, 4d = 512 B); below 1 the
    # partitioner recomputes the gather (traced with the positions passed)
    assert BUDGET_MEASURED[0] == 2 * 4096 and BUDGET_MEASURED[5] == 2 * 4096 * 2 + 2 * 2 * 8 * 128 + 2 * 2 * 14336
    assert BUDGET_MEASURED[10] == 139400 + 4 * 128


@pytest.mark.parametrize("args", [["--ac", "budget:0.5"], ["--ac", "budget:0.55", "--compile"],
                                  ["--ac", "budget:1.5", "--compile"],
                                  ["--ac", "budget:0.5", "--compile", "--float8", "rowwise"],
                                  ["--ac", "budget:0.5", "--compile", "--model", "llama2-7b"]])
def test_memory_budget_refuses_what_is_not_traced(run_cli, args):
    argv = ["estimate", "--model", "llama3-8b", "--impl", "torchtitan", "--gpus", "8", *args]
    code, _, err = run_cli(*argv)
    assert code == 2 and "budget" in err and "Traceback" not in err, err
    code, _, err = run_cli("search", "--model", "llama3-8b", "--impl", "torchtitan", "--gpus", "8", "--mem", "80GB",
                           *args[:2], "--no-compile")  # searched compiled only (tests/test_titan_search.py)
    assert code == 2 and "budget" in err and "Traceback" not in err, err


@pytest.mark.slow
@SLOW
def test_memory_budget_trace_gives_the_table():
    # the partitioner's saved sets at llama3-8b's widths (s 2,048; ~15 s of CPU) are compiled.BUDGET_SAVED's
    pytest.importorskip("torchtitan")
    from validation.budget import budget_saved

    got = budget_saved(4096, 32, 8, 14336, 2048, tuple(i / 10 for i in range(11)), compiled.TITAN_LAYER)
    assert [" ".join(r["saved"]) for r in got.values()] == list(compiled.BUDGET_SAVED)
    assert [r["per_token"] for r in got.values()] == list(BUDGET_MEASURED)
