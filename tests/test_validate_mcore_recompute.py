"""CI: selective recompute by Megatron-LM's module names (--recompute-modules; memplan/inventory/recompute.py) against
megatron-core 0.16.1's own TransformerLayer on CPU, and the flags `--emit megatron` gives for it.

validation/mcore.py runs the local-spec layer with recompute_granularity "selective" and recompute_modules as given,
labels every tensor autograd saves (a norm output that CheckpointWithoutOutput frees counts with the bytes left in its
storage: none) and compares with memplan per term (0.01 %: the measurement is exact). "mlp" is measured on the
Llama-like layer (no biases): on the GPT layer (biases, skip_bias_add) megatron-core 0.16.1's CheckpointFunction
returns the fc2 bias parameter as its output and its backward re-enters itself without end. "moe", "shared_experts"
and "mla_up_proj" are measured on the MoE layer (4 experts, shared experts) and the MLA layer of
tests/test_validate_mcore_moe.py / test_validate_mcore_mla.py; "moe_act" needs grouped GEMM (CUDA): refused.
"""

import dataclasses
import subprocess
import sys

import pytest

from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.core.specs import Config, ParallelSpec
from memplan.core.training import TrainingSpec
from memplan.inventory import recompute
from memplan.inventory.assemble import training_inventory
from memplan.launch.megatron import megatron_args

LLAMA = dict(num_layers=4, hidden_size=256, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=640,
             seq_length=64, vocab_size=512, norm="rmsnorm", mlp="swiglu", position_embedding="rope",
             tied_embeddings=False, dropout=False, bias=False, attention="flash")


def _config(**training):
    return Config(model=ModelSpec(**LLAMA), parallel=ParallelSpec(), training=TrainingSpec(**training))


def test_emit_megatron_recompute_flags():
    args = megatron_args(_config(recompute="selective", recompute_modules="layernorm,mlp"))
    assert "--recompute-granularity selective" in args and "--recompute-modules layernorm mlp" in args
    # Megatron-LM's default module (core_attn) needs no flag
    assert not any(a.startswith("--recompute-modules") for a in megatron_args(_config(recompute="selective")))
    args = megatron_args(_config(recompute="full", recompute_method="block", recompute_num_layers=4))
    assert "--recompute-method block" in args and "--recompute-num-layers 4" in args
    args = megatron_args(_config(recompute="full", recompute_method="uniform", recompute_num_layers=1))
    assert "--recompute-method uniform" in args and "--recompute-num-layers 1" in args


@pytest.mark.parametrize("training, words", [
    (dict(recompute="selective", recompute_modules="core_attn,lm_head"), "recompute_modules takes"),
    (dict(recompute="full", recompute_method="uniform", recompute_num_layers=2), "one layer per checkpoint"),
    (dict(recompute="full", recompute_method="block"), "needs recompute_num_layers"),
    (dict(recompute="selective", recompute_method="block"), "applies to full recompute"),
])
def test_bad_recompute_choices(training, words):
    with pytest.raises(ValueError, match=words):
        TrainingSpec(**training)


def test_cli_bad_recompute_module_is_one_line():
    # as tests/test_bad_input.py: the real CLI in a new process, one line on stderr, exit 2, the name echoed as data
    p = subprocess.run([sys.executable, "-m", "memplan.cli", "estimate", "--model", "llama3-8b", "--recompute",
                        "selective", "--recompute-modules", "core_attn,[b]x[/b]"], capture_output=True, text=True,
                       timeout=60)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("memplan: error:"), p.stderr[-2000:]
    assert "'[b]x[/b]'" in lines[0] and "recompute_modules takes" in lines[0]


def test_mcore_grid_has_every_modelled_module():
    from memplan.check.cases import mcore_grid

    modules = {m for c in mcore_grid((1,)) if c.recompute == "selective" for m in c.modules}
    assert modules == set(recompute.MODELLED)


def test_unmodelled_modules_and_impls_refused():
    model = ModelSpec(**LLAMA)
    for modules, impl, words in ((("moe_act",), "megatron", "moe-grouped-gemm"),
                                 (("mla_up_proj",), "megatron-local", "multi-latent attention"),
                                 (("mlp",), "hf-sdpa", "--impl hf-sdpa")):
        with pytest.raises(MemplanError, match=words):
            training_inventory(model, impl, "cuda", TrainingSpec(recompute="selective", recompute_modules=modules))


def test_selective_without_core_attn_keeps_the_attention():
    # derived check of the rewrite on the CUDA (TE spec) inventory: with only "mlp" chosen the attention core's terms
    # are kept under selective recompute, the MLP's dropped; with the default they are the other way round
    model = ModelSpec(**LLAMA)
    inv = training_inventory(model, "megatron", "cuda", TrainingSpec(recompute="selective", recompute_modules="mlp"))
    by_id = {t.id: t for t in inv.terms}
    assert not any(t.dropped_by_selective for t in inv.terms if t.block == "attention")
    assert by_id["swiglu_input"].dropped_by_selective and by_id["fc2_input"].dropped_by_selective
    assert not by_id["fc1_input"].dropped_by_selective


pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from mcore_checks import assert_exact  # noqa: E402
from memplan.check.cases import mcore_case, mcore_module_cases  # noqa: E402
from memplan.check.validate import CaseResult, predict, run  # noqa: E402

CASES = [mcore_case("gpt", recompute="selective", modules=("layernorm",)),
         mcore_case("llama", recompute="selective", modules=("layernorm",)),
         mcore_case("llama", recompute="selective", modules=("mlp",)),
         mcore_case("llama", recompute="selective", modules=("core_attn", "layernorm", "mlp")),
         mcore_case("llama", recompute="selective", modules=()),
         mcore_case("llama", recompute="selective", scope="model", modules=("layernorm", "mlp"))] + mcore_module_cases()
MOE, SHARED, MLA, MLA_DIRECT, DSV3 = range(6, 11)


@pytest.fixture(scope="module")
def results(announce):
    with announce(f"measuring {len(CASES)} megatron-core selective-recompute cases (one process)"):
        return run(CASES, "cpu")


def test_recompute_modules_match_megatron_core(results):
    assert_exact(results)
    assert all(r.measured_total > 0 for r in results)


def test_gpt_layernorm_by_hand(results):
    # s = 32, b = 2, h = 64, a = 4, f = 4h, bf16 on CPU: without recompute megatron-core keeps 198,144 B
    # (tests/test_validate_mcore.py test_gpt_layer_by_hand); recomputing the norms drops their mean / rstd
    # (2 norms * 2 * sb * 2 B = 512) and frees their outputs, the QKV projection's and fc1's inputs (2 * sbh * 2 B =
    # 16,384); their inputs stay (the checkpoint keeps the tensors the norms kept)
    r = results[0]
    assert r.measured_total == 198_144 - 512 - 16_384
    assert "ln1_stats" not in r.measured and "qkv_input" not in r.measured and r.measured["ln2_input"] == 8_192


def _fails(r, predicted) -> bool:
    return not CaseResult(r.case, predicted, r.measured, 0, None, None, r.tolerance).passed


def test_every_term_and_rule_is_checked(monkeypatch, results):
    """Each predicted term, removed, fails its case; each id of recompute.DROPS (what a module drops), kept, fails
    a case; the norm checkpoint's inputs, not kept, fail a case."""
    for r in results:
        predicted = predict(r.case, "cpu")
        # attn_mask_type and the aux loss are 4 bytes per layer, the aux loss's tokens per expert 4 x 8 B: within
        # 0.01 % of the larger cases (as in tests/test_validate_mcore.py, test_validate_mcore_moe.py)
        unchecked = {k for k in predicted if not _fails(r, {**predicted, k: 0})}
        assert unchecked <= {"attn_mask_type", "moe_aux_loss", "moe_aux_counts"}, r.case.name
    unchecked = []
    for module, ids in recompute.DROPS.items():
        for term_id in ids:
            monkeypatch.setitem(recompute.DROPS, module, tuple(i for i in ids if i != term_id))
            if not any(_fails(r, predict(r.case, "cpu")) for r in results):
                unchecked.append(term_id)
            monkeypatch.undo()
    # gelu_input / fc2_input (GeLU) and the LayerNorm-only ids are not in the Llama-like mlp cases
    assert set(unchecked) <= {"gelu_input"}, unchecked
    monkeypatch.setattr(recompute, "NORM_INPUTS", ())
    assert any(_fails(r, predict(r.case, "cpu")) for r in results)
    for module in recompute.DROPS_BLOCKS:  # the blocks a module drops, kept, fail a case
        monkeypatch.setitem(recompute.DROPS_BLOCKS, module, ())
        assert any(_fails(r, predict(r.case, "cpu")) for r in results), module
        monkeypatch.undo()


def test_moe_and_mla_modules_by_hand(results):
    # s = 32, b = 2, h = 64, bf16, one layer. "moe": the checkpoint around the MoELayer keeps its input (the second
    # norm's output, 32 x 2 x 64 x 2 B = 8,192 B) and nothing of the router, experts or shared experts
    moe = results[MOE].measured
    assert moe["fc1_input"] == 8_192 and not [k for k in moe if k.startswith(("moe_", "shared_"))]
    # "shared_experts": the shared experts' four tensors gone (fc1 output 2 x 32 x 2 x 64 x 2 B, three 32 x 2 x 64 x 2 B),
    # the routed experts' kept
    shared = results[SHARED].measured
    assert "moe_fc1_output" in shared and not [k for k in shared if k.startswith("shared_")]
    # "mla_up_proj" (r_kv = 48, d_r = 16): k_pos_emb keeps the kv down projection's 32 x 2 x (48 + 16) bf16 output
    # (8,192 B), the rotary frequencies 32 x 16 fp32 (2,048 B); no RoPE cos / sin, Q, K or V
    mla = results[MLA].measured
    assert (mla["mla_k_pos_emb"], mla["mla_rope_freqs"]) == (8_192, 2_048)
    assert "rope_cos_sin" not in mla and "qkv" not in mla


def test_no_modules_is_no_recompute(results):
    # selective recompute of no module keeps what no recompute keeps (measured against the "none" inventory)
    r = results[4]
    assert predict(dataclasses.replace(r.case, recompute="none"), "cpu") == r.measured
