"""torchtitan 0.3.0's DeepSeek-V3 layers (memplan/inventory/titan_dsv3.py, --impl torchtitan) against torchtitan's
real blocks run on CPU.

validation/titan_dsv3.py builds a dense first layer and an MoE layer from torchtitan's own ``_build_dsv3_layers``
(MLA with the q latent or without, the 671B flavour's sigmoid router with 8 groups of which 4 are chosen,
route_norm, a shared expert, balanced routing) and wraps them with torchtitan's FullAC / SelectiveAC; what each
keeps after its forward is measured with real tensors (the attention a stand-in op with FlexAttention's save set).
memplan's terms, evaluated for the same tiny shapes, must equal the measured storages term by term (a multiset of
bytes), so removing any term fails.  The grouped GEMMs' int32 offsets (4 E bytes a layer) are the one storage
memplan leaves out (memplan/inventory/titan_moe.py).  Needs torchtitan (the test extra)."""

import os
from collections import Counter
from fractions import Fraction

import pytest
import yaml

pytest.importorskip("torchtitan")

import torch  # noqa: E402

from memplan.api.estimating import estimate  # noqa: E402
from memplan.cli import main  # noqa: E402
from memplan.core.errors import MemplanError  # noqa: E402
from memplan.core.symbolic import Poly  # noqa: E402
from memplan.core.training import Recompute  # noqa: E402
from memplan.inventory.titan import is_dsv3, is_qwen3_moe  # noqa: E402
from memplan.inventory.titan_dsv3 import ROUTER_GROUPS, dsv3_layer_terms  # noqa: E402
from memplan.memory.states import total_params  # noqa: E402
from memplan.presets.catalog import load_model  # noqa: E402
from validation.titan_dsv3 import (DsvShape, dsv3_model_config, measure_dsv3, measure_dsv3_ep_states,  # noqa: E402
                                   trace_dsv3)

# h 64, 4 heads, r_q 32, r_kv 48, d_n 16, d_r 8, d_v 12 (d_v != d_n + d_r as in DeepSeek-V3), dense f 96, 16 experts
# of 32, one shared, top-2, torchtitan's 671B router groups (8, 4 chosen)
SHAPE = DsvShape(E=16, groups=ROUTER_GROUPS[0], limited=ROUTER_GROUPS[1])
S, B = 32, 2
REC = {"none": Recompute.NONE, "selective-op": Recompute.SELECTIVE, "full": Recompute.FULL}
SLOW = pytest.mark.skipif(not os.environ.get("MEMPLAN_TITAN_SLOW"), reason="set MEMPLAN_TITAN_SLOW=1 to run")
OFFSETS = 4 * SHAPE.E  # the grouped GEMMs' int32 offsets (not modelled)
DENSE_IDS = ("w1.out", "silu.out", "w3.out", "swiglu.mul", "mm.w1", "mm.w3", "mm.w2")


def _model(q_lora=True, **kw):
    spec = load_model("deepseek-v3").model
    return spec.model_copy(update={
        "hidden_size": SHAPE.h, "num_attention_heads": SHAPE.a, "num_kv_heads": SHAPE.a,
        "q_lora_rank": SHAPE.rq if q_lora else None, "kv_lora_rank": SHAPE.rkv, "qk_nope_head_dim": SHAPE.dn,
        "qk_rope_head_dim": SHAPE.dr, "v_head_dim": SHAPE.dv, "ffn_hidden_size": SHAPE.f,
        "moe_ffn_hidden_size": SHAPE.fe, "moe_shared_ffn_hidden_size": SHAPE.ns * SHAPE.fe, "num_experts": SHAPE.E,
        "moe_top_k": SHAPE.k, "moe_first_dense_layers": 1, "num_layers": 2, "seq_length": S, "mtp_layers": 0,
        "vocab_size": 256, **kw})


def _memplan(ac, moe, q_lora=True, drop=(), device="cpu"):
    """memplan's kept bytes of one tiny layer, the dense or the MoE one (at L = 2, one dense: each kind's terms
    weighted 1/2, undone here), the block input apart (input_kept reports it)."""
    model = _model(q_lora)
    values = model.symbols(b=B, t=1, cp=1, ep=1, etp=1)
    out = Counter()
    for t in dsv3_layer_terms(model, device):
        dense = t.id in DENSE_IDS
        kind = dense or t.id.startswith(("moe.", "shared.", "mm.shared", "mm.moe"))
        if t.id == "input" or t.id in drop or not t.kept(REC[ac]) or (kind and dense == moe):
            continue
        n = t.bytes(values, 2, 0) * (2 if kind else 1)
        if n:
            out[n] += 1
    return out


def _measured(ac, moe, q_lora=True):
    got = measure_dsv3(SHAPE, ac, S, B, moe=moe, q_lora=q_lora)
    measured = Counter(n for _, _, n in got["rows"])
    if moe and ac == "none":
        measured[OFFSETS] -= 1
    return +measured, got["input_kept"]


def _input_kept(ac):
    return any(t.id == "input" and t.kept(REC[ac]) for t in dsv3_layer_terms(_model(), "cpu"))


def test_preset_is_torchtitans_layout():
    # deepseek-v3 is torchtitan's 671B flavour (models/deepseek_v3/__init__.py: dim 7168, 61 layers, 3 dense, 128
    # heads, q_lora 1536, kv_lora 512, 256 experts of 2048 and one shared, top-8); Qwen3 MoE is not
    assert is_dsv3(load_model("deepseek-v3").model) and not is_qwen3_moe(load_model("deepseek-v3").model)
    assert not is_dsv3(load_model("qwen3-30b-a3b").model)
    assert not is_dsv3(_model(moe_shared_ffn_hidden_size=0)) and not is_dsv3(_model(qk_norm=True))


@pytest.mark.parametrize("q_lora", [True, False])
def test_parameters_equal_torchtitan_model(q_lora):
    # torchtitan's DeepSeekV3Model (meta device) with its own _build_dsv3_layers at the tiny shape, 2 layers (one
    # dense): its parameters are memplan's count.  At full size (the 671B flavour, model_registry("671B"), no MTP
    # layers) torchtitan builds 671,026,404,352 parameters on the meta device, memplan's deepseek-v3 count to the one
    # (measured: ~12 s, test_671b_parameters below, opt-in)
    cfg = dsv3_model_config(SHAPE, 256, q_lora)
    with torch.device("meta"):
        real = sum(p.numel() for p in cfg.build().parameters())
    assert total_params(_model(q_lora)) == real


@pytest.mark.slow
@SLOW
def test_671b_parameters():
    from torchtitan.models.deepseek_v3 import model_registry
    with torch.device("meta"):
        real = sum(p.numel() for p in model_registry("671B").model.build().parameters())
    assert real == total_params(load_model("deepseek-v3").model) == 671_026_404_352


@pytest.mark.parametrize("ac,moe", [("none", False), ("none", True), ("selective-op", False),
                                    ("selective-op", True), ("full", True)])
def test_measured_bytes_equal_memplan(ac, moe):
    measured, input_kept = _measured(ac, moe)
    assert measured == _memplan(ac, moe)
    assert input_kept == _input_kept(ac)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_without_q_latent_the_saved_matmuls_shift(moe):
    # the debug and 16B flavours (q_lora_rank 0): one wq in place of wq_a / wq_b, so selective-op's every-other-matmul
    # rule saves wq (1), wkv_b (3), then w1 (5) and w2 (7), the dense layer's or the shared experts' (the router gate
    # not counted: torchtitan's default force_recompute_mm_shapes_by_fqns)
    measured, _ = _measured("selective-op", moe, q_lora=False)
    assert measured == _memplan("selective-op", moe, q_lora=False)


# (the EP-only terms are titan_moe.py's, checked by tests/test_titan_moe.py; the TP- and CP-only ones by
# tests/test_titan_dsv3_tp.py)
ALL_IDS = sorted({t.id for t in dsv3_layer_terms(_model(), "cpu")
                  if t.id != "input" and not (t.needs_ep or t.needs_tp or t.needs_cp)})


@pytest.mark.parametrize("term", ALL_IDS)
def test_a_removed_term_changes_the_answer(term):
    # each term is kept in some AC mode by one of the two layers: without it memplan's bytes differ from what the
    # passing comparisons above measured (the answer they check against)
    assert any(_memplan(ac, moe, drop=(term,)) != _memplan(ac, moe) for ac in ("none", "selective-op")
               for moe in (False, True))


def test_dense_first_layers_weigh_the_kinds():
    # at L = 61 with 3 dense layers (the 671B flavour): the dense SwiGLU's terms in 3/61 of the layers, the MoE's in
    # 58/61; the attention's in all
    model = load_model("deepseek-v3").model
    terms = {t.id: t for t in dsv3_layer_terms(model, "cuda")}
    assert terms["w1.out"].elements == Poly.parse("18432 s b") * Fraction(3, 61)
    assert terms["shared.w1.out"].elements == Poly.parse("2048 s b") * Fraction(58, 61)
    assert terms["moe.routed_input"].elements == Poly.parse("8 s b h") * Fraction(58, 61)
    assert terms["mla.q"].elements == Poly.parse(f"{128 * (128 + 64)} s b")


def test_cuda_latent_norms_fused_by_hand():
    # on CUDA (derived from torch's dispatch, as titan.py's block norms) F.rms_norm is one fused kernel: a latent norm
    # keeps its bf16 input (2 r), fp32 rstd (4) and bf16 output (2 r) a token, against CPU's fp32 copy, rstd, fp32
    # x * rstd and bf16 output (10 r + 4)
    model = _model()
    values = model.symbols(b=B, t=1, cp=1, ep=1, etp=1)
    for which, r in (("q_norm", SHAPE.rq), ("kv_norm", SHAPE.rkv)):
        got = {d: sum(t.bytes(values, 2, 0) for t in dsv3_layer_terms(model, d) if t.id.startswith(which + ".")
                      and t.kept(Recompute.NONE)) for d in ("cpu", "cuda")}
        assert got == {"cpu": (10 * r + 4) * S * B, "cuda": (4 * r + 4) * S * B}, which


@pytest.mark.slow
@SLOW
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("ac", sorted(REC))
def test_traced_equals_memplan(ac, moe):
    # every kept storage c s b (the offsets 4 E a constant): the trace's polynomials at s, b are memplan's bytes
    traced = trace_dsv3(SHAPE, ac, moe=moe)
    at = {"s": S, "b": B}
    for _, _, expr in traced["rows"]:
        s_, b_ = sorted(expr.free_symbols, key=str) if not expr.is_number else (1, 1)
        assert (expr / s_ / b_).is_number, expr
    values = Counter(int(expr.subs({x: at[x.name] for x in expr.free_symbols})) for _, _, expr in traced["rows"])
    if moe and ac == "none":
        values[OFFSETS] -= 1
    assert +values == _memplan(ac, moe) and traced["input_kept"] == _input_kept(ac)


# deepseek-v3 (torchtitan's 671B flavour) on 64 GPUs (FSDP2 d = 64), s b = 4096 tokens, CUDA
H, A, RQ, RKV, DN, DR, DV, F, FE, E, L, V, ND = 7168, 128, 1536, 512, 128, 64, 128, 18432, 2048, 256, 61, 129280, 3


def _estimate(ac="full", **kw):
    return estimate("deepseek-v3", impl="torchtitan", gpus=64, ac=ac, seq_len=4096, micro_batch=1, global_batch=64,
                    **kw).estimate


def test_states_by_hand():
    # a layer's attention: wq_a, q_norm, wq_b, wkv_a, kv_norm, wkv_b, wo and the two block norms; a dense layer's
    # SwiGLU 3 h f; an MoE layer's router E h, shared expert 3 h f_e and 256 experts 3 E h f_e; the embedding, LM
    # head and final norm; no MTP layer (torchtitan's flavours build none): 671,026,404,352, torchtitan's own count
    # (test_671b_parameters).  fp32 parameters, gradients and AdamW's moments 16 B / 64 per parameter (at ep 8 the
    # GPU's 32 experts over efsdp = 8, the rest over 64: the same); in flight (bf16) the running and the prefetched
    # MoE layer with the GPU's E / ep experts, and the head; every layer's RoPE cache, s x d_r / 2 complex64 = 4 s d_r B
    # (torchtitan's ComplexRoPE over the rotated width: tests/test_titan.py)
    attn = H * RQ + RQ + RQ * A * (DN + DR) + H * (RKV + DR) + RKV + RKV * A * (DN + DV) + A * DV * H + 2 * H
    moe, experts = attn + E * H + 3 * H * FE, 3 * E * H * FE
    total = 2 * V * H + H + ND * (attn + 3 * H * F) + (L - ND) * (moe + experts)
    assert total == 671_026_404_352
    for ep in (1, 8):
        st = _estimate(ep=ep).peak.states
        assert st.optimizer == -(-12 * total // 64) and st.gradients == -(-4 * total // 64)
        assert st.weights == 2 * (2 * (moe + experts // ep) + V * H + H) + L * 4 * 4096 * DR


def test_estimate_answers_term_by_term(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["estimate", "--model", "deepseek-v3", "--impl", "torchtitan", "--gpus", "64", "--ep", "8", "--seq-len",
              "4096", "--global-batch", "64", "--ac", "selective-op", "--gpu", "h100-80gb"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "build num_mtp_layers 0 by default" in " ".join(out.split())
    for row in ("q down projection output (bf16), matmul 1", "router group choice of 4 groups",
                "shared experts' w3 output (bf16), matmul 7",
                "attention log-sum-exp (fp32)", "torchtitan DeepSeek-V3"):
        assert row in out, row


# --compile at ep 1 is modelled (tests/test_compiled_dsv3.py); tp, cp: test_titan_dsv3_tp.py
@pytest.mark.parametrize("kw", [dict(compile=True, ep=8), dict(ep=3), dict(tp=3)])
def test_refused(kw):
    with pytest.raises(MemplanError):
        _estimate(**kw)


def test_search_leaves_out_the_pipelines_estimate_refuses():
    # --pp with 1F1B, GPipe (tests/test_titan_dsv3_pp.py), Interleaved1F1B and LoopedBFS
    # (tests/test_titan_dsv3_multistage.py) is modelled; the split-backward ones are refused by estimate: search must
    # not list them, and a pinned one gets estimate's refusal
    from memplan.api.searching import search
    listed = search("deepseek-v3", impl="torchtitan", gpus=64, seq_len=4096, global_batch=64,
                    mem="4000GB").to_dict()["plans"]  # a budget every plan fits: all listed
    assert listed and any(plan["pp"] > 1 for plan in listed)
    assert {plan["torchtitan"]["pipeline_schedule"] for plan in listed if plan["pp"] > 1} <= {
        "1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS"}
    with pytest.raises(MemplanError, match="ZBVZeroBubble with an MoE model is not modelled"):
        search("deepseek-v3", impl="torchtitan", gpus=64, pp=2, seq_len=4096, global_batch=64, mem="80GB",
               pipeline_schedule="ZBVZeroBubble")


def test_router_groups_must_divide_the_experts():
    # torchtitan's router refuses experts not a multiple of its groups (8 in the 671B flavour), or 1 a group
    for experts in (12, 8):
        with pytest.raises(MemplanError, match="expert groups"):
            dsv3_layer_terms(_model(num_experts=experts), "cpu")


# torchtitan's own parallelize_deepseekv3 (set_deepseek_v3_sharding_config with enable_ep, FSDP2 over 2 ranks, the
# experts over efsdp = 2 / ep) on the 2-layer tiny model (a dense, an MoE layer), vocabulary 256, one AdamW step over
# gloo, both ranks alike (validation/titan_dsv3.py measure_dsv3_ep_states; ~30 s each):
#   MEMPLAN_TITAN_SLOW=1 PYTHONPATH=. pytest tests/test_titan_dsv3.py -k states_gloo
# Hand derivation: the attention wq_a 64 x 32, q_norm 32, wq_b 32 x 96, wkv_a 64 x 56, kv_norm 48, wkv_b 48 x 112,
# wo 48 x 64, two norms 2 x 64: 17,360; the dense layer + 3 x 64 x 96 = 35,792; the MoE layer's router 16 x 64 and
# shared expert 3 x 64 x 32 + 17,360 = 24,528 and its experts 3 x 16 x 64 x 32 = 98,304; the embedding, LM head and
# final norm 2 x 16,384 + 64: 191,456 parameters, 95,728 a rank at ep 1 and 2 (the 8 local experts whole at ep 2):
# fp32 params and grads 382,912 B each, AdamW's moments 765,824 B.  The running MoE layer unsharded in bf16:
# 2 x (24,528 + 98,304 / ep) = 245,664 B at ep 1, 147,360 B at ep 2.
RECORDED_STATES = {1: {"params": 382912, "grads": 382912, "adam": 765824, "running": 245664},
                   2: {"params": 382912, "grads": 382912, "adam": 765824, "running": 147360}}
MOE_DENSE, EXPERTS, TAIL = 24528, 98304, 256 * 64 + 64


def _tiny_yaml(tmp_path):
    spec = _model(vocab_size=256, seq_length=16, name="tiny-dsv3").model_dump(exclude={"inventory"})
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({"model": spec}))
    return str(path)


@pytest.mark.parametrize("ep", sorted(RECORDED_STATES))
def test_ep_states_equal_the_recorded_run(ep, tmp_path):
    got = RECORDED_STATES[ep]
    assert got["running"] == 2 * (MOE_DENSE + EXPERTS // ep)  # the hand derivation above
    st = estimate(_tiny_yaml(tmp_path), impl="torchtitan", gpus=2, ep=ep, micro_batch=2, global_batch=4,
                  ac="full").estimate.peak.states
    assert st.gradients == got["grads"] and st.optimizer == got["params"] + got["adam"]
    # in flight: the running MoE layer (measured) and the next one prefetched (derived), and the head (measured); the
    # 2 layers' RoPE caches, 4 s d_r B each at s 16 (tests/test_titan.py)
    assert st.weights == 2 * got["running"] + 2 * TAIL + 2 * 4 * 16 * SHAPE.dr


@pytest.mark.slow
@SLOW
@pytest.mark.parametrize("ep", sorted(RECORDED_STATES))
def test_ep_states_gloo_equal_recorded(ep):
    for rank in measure_dsv3_ep_states(SHAPE, ep=ep):
        assert {k: rank[k] for k in RECORDED_STATES[ep]} == RECORDED_STATES[ep]


def test_ep_defaults_to_torchtitans_one():
    # torchtitan 0.3.0's ParallelismConfig.expert_parallel_degree defaults to 1 (config/configs.py), as its tp and pp
    # do; the deepseek-v3 preset's ep 64 is Megatron-LM's recipe. Without --ep the plan is torchtitan's ep 1: 128 GPUs
    # as 4 replicas x 32-rank shard groups run (ep 64 would not divide a shard group: torchtitan's efsdp =
    # dp_shard cp tp / ep), and the explicit --ep 64 is refused with torchtitan's reason, not Megatron-LM's
    kw = dict(model="deepseek-v3", impl="torchtitan", gpus=128, dp_replicate=4, global_batch=128)
    assert estimate(**kw).config.parallel.ep == 1
    with pytest.raises(MemplanError, match="efsdp"):
        estimate(ep=64, **kw)
