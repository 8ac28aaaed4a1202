"""--float8 tensorwise|rowwise with --impl torchtitan (memplan/inventory/titan_float8.py) against torchtitan's real block
with torchao's Float8Linear run on CPU (torch 2.13 runs torch._scaled_mm and the float8 dtypes there).

The measurement is in tests/test_titan.py (beside the bf16 block's, in the same process: torchtitan's import and the
first checkpointed run are paid once): validation/titan.py converts the block with torchtitan's own
Float8LinearConverter.convert (recipe from torchao's from_recipe_name, filter_fqns ["lm_head"]) and measures what it
keeps after its forward, storage by storage; memplan's kept terms of the same tiny layer (``float8_rows`` here) must
equal them (a multiset of storage sizes), so removing a term fails. The FSDP2 float8 all-gather and the LM head left
in bf16 are derived: checked by hand below. No torch needed here."""

import os
from collections import Counter

import pytest

from memplan.api.estimating import estimate
from memplan.cli import main
from memplan.core.model import ModelSpec
from memplan.core.symbolic import Poly
from memplan.core.training import Recompute, TrainingSpec
from memplan.inventory.assemble import training_inventory
from memplan.inventory import titan_float8
from memplan.inventory.titan import titan_inventory

TINY = ModelSpec(name="tiny-titan", num_layers=1, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                 ffn_hidden_size=160, seq_length=32, vocab_size=256, norm="rmsnorm", mlp="swiglu",
                 position_embedding="rope", tied_embeddings=False, dropout=False, bias=False, attention="flash")
MODES = {"none": Recompute.NONE, "full": Recompute.FULL, "selective-op": Recompute.SELECTIVE}


def float8_rows(recipe, ac, s, b):
    """memplan's layer terms kept under ``ac`` (CPU kernels), one entry per storage, and whether it keeps the block
    input (the harness reports the input apart)."""
    inv = titan_float8.apply(titan_inventory(TINY, "cpu"), TINY, recipe)
    rows, input_kept = Counter(), False
    for t in inv.terms:
        if t.scope != "layer" or not t.kept(MODES[ac]):
            continue
        if t.id == "input":
            input_kept = True
            continue
        n = t.bytes({"s": s, "b": b, "t": 1}, 2, 0)
        if n:  # the TP-only terms are 0 at t = 1
            rows[n // t.storages] += t.storages
    return rows, input_kept


def test_converted_linears_and_the_amax_term_by_hand():
    # llama3-8b: h 4096, 32 heads of 128, 8 KV heads, f 14336; every dim divides by 16: all five linears converted
    spec = estimate("llama3-8b", impl="torchtitan", gpus=8, global_batch=8).estimate.config.model
    assert titan_float8.converted_linears(spec) == [("wqkv", 4096, 6144), ("wo", 4096, 4096), ("w1", 4096, 14336),
                                                    ("w2", 14336, 4096), ("w3", 4096, 14336)]
    # a dim not divisible by 16 stays bf16 (torchtitan's module_filter_fn): f = 168 leaves w1, w2, w3 out
    odd = TINY.model_copy(update={"ffn_hidden_size": 168})
    assert [n for n, *_ in titan_float8.converted_linears(odd)] == ["wqkv", "wo"]
    # the amax term: 2 bf16 scalars per linear, selective-op only, tensorwise only
    amax = [t for t in titan_float8.apply(titan_inventory(TINY, "cpu"), TINY, "tensorwise").terms if t.id == "float8.amax"]
    assert len(amax) == 1 and amax[0].storages == 10 and amax[0].bytes({"s": 7, "b": 3, "t": 1}, 2, 0) == 20
    assert [t.kept(m) for t in amax for m in MODES.values()] == [0, 0, 1]
    assert not [t for t in titan_float8.apply(titan_inventory(TINY, "cpu"), TINY, "rowwise").terms
                if t.id.startswith("float8")]


def _est(**kw):
    return estimate("llama3-8b", impl="torchtitan", gpus=8, seq_len=1024, micro_batch=1, global_batch=8, **kw).estimate


def test_float8_all_gather_halves_the_layers_in_flight_by_hand():
    # tensorwise: FSDP2 all-gathers the float8 weights (1 B per element) of the running and the prefetched layer;
    # a llama3-8b layer's linears: 4096 x 6144 + 4096 x 4096 + 3 x 4096 x 14336 = 218,103,808 elements, so the
    # weights (the unsharded copies; FSDP2 keeps no bf16 sharded one) are 2 x 218,103,808 B below bf16's
    bf16, rowwise, tensorwise = (_est(ac="full", float8=r).peak.states.weights for r in (None, "rowwise", "tensorwise"))
    assert rowwise == bf16  # torchtitan 0.3.0's rowwise all-gathers bf16
    assert bf16 - tensorwise == 2 * 218_103_808


def test_amax_scalars_in_the_estimate_by_hand():
    # selective-op, CUDA: 10 amax scalars per layer, 2 B each (20 B per layer), each its own allocation, which the
    # peak rounds to the caching allocator's 512 B block: 32 layers x 10 x 512 B more than rowwise (= the bf16 layer)
    sel = {r: _est(ac="selective-op", float8=r) for r in (None, "rowwise", "tensorwise")}
    assert sel["rowwise"].per_layer_bytes == sel[None].per_layer_bytes
    assert sel["tensorwise"].per_layer_bytes - sel[None].per_layer_bytes == 20
    assert sel["tensorwise"].peak.activations - sel[None].peak.activations == 32 * 10 * 512
    none = {r: _est(ac="none", float8=r).per_layer_bytes for r in (None, "tensorwise")}
    assert none["tensorwise"] == none[None]


@pytest.mark.parametrize("args", [["--float8", "tensorwise", "--compile", "--ac", "selective-op"], ["--float8", "rowwise", "--tp", "2", "--compile", "--ac", "none"],
                                  ["--float8", "rowwise", "--impl", "megatron"], ["--float8", "blockwise"]])
def test_refused_in_one_line(args, capsys):
    argv = ["estimate", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "8"] + args
    if "--impl" not in args:
        argv += ["--impl", "torchtitan"]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("memplan: error:") and err.count("\n") == 1, err


def test_the_estimate_says_what_is_measured_and_derived():
    notes = " ".join(_est(ac="selective-op", float8="tensorwise").notes)
    assert "float8 (tensorwise" in notes and "measured on CPU" in notes and "derived" in notes


# --compile --float8: torchtitan's block with float8 linears compiled by torch 2.13's inductor on CPU, measured with
# `PYTHONPATH=. python -m validation.compiled inductor torchtitan RECIPE` (h 48, f 160, a 6, g 2, head 8; static s 28,
# b 5 = 140 tokens; the block called with the dataloader's positions, as torchtitan's Trainer calls it): "after
# forward 174720 B (output 13440 B)" rowwise, 174,750 B tensorwise (without the positions: 170,240 and 170,270 B).
# By hand, per token: input 96 + rstd 4 + q 96 + k 32 + v 32 + attention out 96 + lse 24 + wo out 96 + rstd 4 + w1
# out 320 + w3 out 320 + the RoPE rows gathered at the positions (d/2 complex64) 32 = 1,152 B (the bf16 compiled
# block's 1,664 B without the norms' outputs 96 + 96 and SwiGLU's product 320) x 140 = 161,280 B; tensorwise + 5 bf16
# amax + 5 fp32 scales = 30 B
COMPILED_TOKENS = 140
COMPILED_FLOAT8 = {"rowwise": 174720 - 13440, "tensorwise": 174750 - 13440}
COMPILED_MODEL = TINY.model_copy(update={"hidden_size": 48, "num_attention_heads": 6, "ffn_hidden_size": 160})


def _compiled_layer_bytes(recipe):
    inv = training_inventory(COMPILED_MODEL, "torchtitan", "cpu", TrainingSpec(compile=True, float8=recipe))
    return sum(t.bytes({"s": 28, "b": 5, "t": 1, "h": 48, "a": 6, "g": 2, "f": 160, "q": 48}, 2, 0)
               for t in inv.terms if t.scope == "layer" and t.kept(Recompute.NONE))


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_compiled_float8_layer_equals_the_cpu_measurement(recipe):
    assert _compiled_layer_bytes(recipe) == COMPILED_FLOAT8[recipe] == 1152 * COMPILED_TOKENS + (
        30 if recipe == "tensorwise" else 0)
    # and the bf16 compiled block of the same widths keeps 1,664 B per token (tests/test_compile.py's table)
    assert _compiled_layer_bytes(None) == 1664 * COMPILED_TOKENS


def test_compile_float8_in_the_estimate():
    # llama3-8b, --ac none, compiled: the float8 layer keeps 2h + 2h + 2f = 45,056 B per token less than the bf16 one
    per = {r: _est(ac="none", compile=True, float8=r).per_layer_bytes for r in (None, "rowwise", "tensorwise")}
    assert per[None] - per["rowwise"] == 45056 * 1024
    assert per["tensorwise"] - per["rowwise"] == 30
    assert "partitioner saves with float8" in " ".join(_est(ac="none", compile=True, float8="rowwise").notes)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("MEMPLAN_COMPILE_SLOW"), reason="set MEMPLAN_COMPILE_SLOW=1 to run")
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_partitioner_saves_the_float8_table_inductor(recipe):
    # the measurement above, run (~2-3 min each): the saved storages are memplan's table, the bytes the measured ones
    pytest.importorskip("torchtitan")
    from validation.compiled import trace_compiled_layer

    r = trace_compiled_layer("inductor", "torchtitan", s_trace=28, b_trace=5, dynamic=False, float8=recipe)
    # the complex64 RoPE rows gathered at the positions count as their fp32 pairs (memplan's rope_rows)
    made = Counter((Poly.parse_sum(t.elements or "1"), t.dtype.replace("complex64", "float32")) for t in r.saved
                   if t.kind != "parameter")
    inv = training_inventory(COMPILED_MODEL, "torchtitan", "cpu", TrainingSpec(compile=True, float8=recipe))
    dtypes = {"act": "bfloat16", "fp32": "float32"}
    table = Counter()
    for t in inv.terms:
        if t.scope == "layer" and t.kept(Recompute.NONE):
            table[(t.elements if t.storages == 1 else Poly.parse_sum("1"), dtypes[t.dtype])] += t.storages
    assert made == table
    assert r.after_forward - r.output_bytes == COMPILED_FLOAT8[recipe]
