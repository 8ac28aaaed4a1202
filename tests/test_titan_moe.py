"""torchtitan 0.3.0's Qwen3 MoE layer (memplan/inventory/titan_moe.py, --impl torchtitan --ep) against torchtitan's
real block run on CPU.

validation/titan_moe.py builds the layer from torchtitan's own ``_build_qwen3_moe_layers`` with its balanced
round-robin routing (``_debug_force_load_balance``) and wraps it with torchtitan's FullAC / SelectiveAC; what it keeps
after its forward is measured with real tensors (ep = 1 here; ep = 2 over gloo recorded below, re-measured opt-in)
and traced under FakeTensorMode with symbolic s and b (opt-in).  memplan's terms, evaluated for the same tiny
shapes, must equal the measured storages term by term (a multiset of bytes), so removing any term fails.  The
grouped GEMMs' int32 offsets (4 E / ep bytes a layer) are the one storage memplan leaves out (module docstring).
Needs torchtitan (the test extra)."""

import os
from collections import Counter

import pytest
import yaml

pytest.importorskip("torchtitan")

import torch  # noqa: E402
from torchtitan.models.common import CosSinRoPE, Embedding, Linear  # noqa: E402
from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_moe_layers, _qwen3_norm  # noqa: E402

from memplan import search  # noqa: E402
from memplan.api.estimating import estimate  # noqa: E402
from memplan.cli import main  # noqa: E402
from memplan.core.errors import MemplanError  # noqa: E402
from memplan.core.training import Recompute  # noqa: E402
from memplan.inventory.titan import is_qwen3_moe, titan_inventory  # noqa: E402
from memplan.memory.states import total_params  # noqa: E402
from memplan.presets.catalog import load_model  # noqa: E402
from validation.titan_moe import MoeShape, measure_ep_states, measure_moe, measure_moe_ep, trace_moe  # noqa: E402

SHAPE = MoeShape()  # h 64, a 4, g 2, head dim 16, fe 32, E 8, top-2
S, B = 32, 2
REC = {"none": Recompute.NONE, "selective-op": Recompute.SELECTIVE, "full": Recompute.FULL}
SLOW = pytest.mark.skipif(not os.environ.get("MEMPLAN_TITAN_SLOW"), reason="set MEMPLAN_TITAN_SLOW=1 to run")
OFFSETS = {1: 4 * SHAPE.E, 2: 4 * SHAPE.E // 2}  # the grouped GEMMs' int32 offsets, E / ep of them (not modelled)

# measured on rank 0 of 2 over gloo (both ranks alike), balanced routing, bytes of each storage the layer keeps:
#   PYTHONPATH=. python -m validation.titan_moe none   (and selective-op, full; ~10 s each)
# none: the attention half and ffn_norm as at ep = 1, then softmax 1024 (s b E bf16), ids 1024 (s b k int64),
#   gathered scores 256, route_norm 128, argsort 1024, sorted scores 256, token idx 1024, the permutation index 1024
#   (R = s b k int64: EP only), the received copies 16384 (R h bf16), offsets 16, the experts' 4 x 8192 (R fe bf16),
#   combine's fp32 output 32768 (s b k h fp32)
# (the block called with the dataloader's positions, as torchtitan's Trainer calls it: the attention's storages
# include CosSinRoPE's cos and sin gathered at them, fp32 8 d s b = 8192, validation/titan.py kept_storages)
_ATTN = [16384, 256, 16384, 8192, 4096, 16384, 1024, 16384, 8192, 512, 8192, 8192, 8192, 4096, 8192, 1024,
         16384, 256, 16384, 8192]
RECORDED_EP2 = {
    "none": _ATTN + [1024, 1024, 256, 128, 1024, 256, 1024, 1024, 16384, 16, 8192, 8192, 8192, 8192, 32768],
    # torchtitan's default SelectiveAC (the router gate recomputed, not counted): wqkv 16384 (matmul 1; wo, matmul 2,
    # recomputed), attention out 8192 + lse 1024, topk 512 + 1024; the all-to-alls: the token counts 64 (E int64),
    # the received copies 16384 (R h), the combined copies 16384 (s b k h)
    "selective-op": [16384, 8192, 1024, 512, 1024, 64, 16384, 16384],
    "full": [],
}


def _model(**kw):
    spec = load_model("qwen3-30b-a3b").model
    return spec.model_copy(update=dict(hidden_size=SHAPE.h, num_attention_heads=SHAPE.a, num_kv_heads=SHAPE.g,
                                       head_dim=SHAPE.d, num_experts=SHAPE.E, moe_top_k=SHAPE.k,
                                       moe_ffn_hidden_size=SHAPE.fe, **{"seq_length": S, "num_layers": 1, **kw}))


def _memplan(ac, ep=1, device="cpu", drop=(), prefix=""):
    """memplan's kept layer terms (bytes) for the tiny layer, the block input apart (input_kept reports it);
    ``prefix``: those whose id starts so only."""
    inv = titan_inventory(_model(), device)
    values = _model().symbols(b=B, t=1, cp=1, ep=ep, etp=1)
    out = Counter()
    for t in inv.terms:
        if t.scope == "layer" and t.id not in ("input",) + tuple(drop) and t.id.startswith(prefix) and t.kept(REC[ac]):
            n = t.bytes(values, 2, 0)
            if n:
                out[n] += 1
    return out


def _input_kept(ac):
    return any(t.id == "input" and t.kept(REC[ac]) for t in titan_inventory(_model(), "cpu").terms)


def test_qwen3_moe_preset_is_torchtitans_layout():
    # qwen3-30b-a3b is torchtitan's "30B-A3B" flavour (models/qwen3/__init__.py: dim 2048, 48 layers, 32 heads, 4 KV
    # heads, head dim 128, 128 experts of 768, top-8, no shared experts); mixtral has no q / k norms
    assert is_qwen3_moe(load_model("qwen3-30b-a3b").model)
    assert not is_qwen3_moe(load_model("mixtral-8x7b").model)
    assert not is_qwen3_moe(_model(moe_shared_ffn_hidden_size=64))


def test_parameters_equal_torchtitan_model():
    # torchtitan's Qwen3Model (meta device) with _build_qwen3_moe_layers at the tiny shape, 2 layers: its parameters
    # (per layer: wqkv, wo, the norms, the router E h, the experts' w1 / w2 / w3 E x fe x h) are memplan's count
    v, layers = 256, 2
    cfg = Qwen3Model.Config(
        vocab_size=v, dim=SHAPE.h, norm=_qwen3_norm(SHAPE.h),
        tok_embeddings=Embedding.Config(num_embeddings=v, embedding_dim=SHAPE.h),
        lm_head=Linear.Config(in_features=SHAPE.h, out_features=v),
        layers=_build_qwen3_moe_layers(n_layers=layers, dim=SHAPE.h, n_heads=SHAPE.a, n_kv_heads=SHAPE.g,
                                       head_dim=SHAPE.d, moe_hidden_dim=SHAPE.fe, num_experts=SHAPE.E, top_k=SHAPE.k,
                                       attn_backend="flex", moe_comm_backend="standard",
                                       rope=CosSinRoPE.Config(dim=SHAPE.d, max_seq_len=64, theta=1e6)))
    with torch.device("meta"):
        real = sum(p.numel() for p in cfg.build().parameters())
    assert total_params(_model(num_layers=layers, vocab_size=v)) == real


@pytest.mark.parametrize("ac", sorted(REC))
def test_measured_bytes_equal_memplan(ac):
    got = measure_moe(SHAPE, ac, S, B)
    measured = Counter(n for _, _, n in got["rows"])
    if ac == "none":
        measured[OFFSETS[1]] -= 1
    assert +measured == _memplan(ac)
    assert got["input_kept"] == _input_kept(ac)


@pytest.mark.parametrize("ac", sorted(RECORDED_EP2))
def test_ep_recorded_bytes_equal_memplan(ac):
    measured = Counter(RECORDED_EP2[ac])
    if ac == "none":
        measured[OFFSETS[2]] -= 1
    assert +measured == _memplan(ac, ep=2)


# the MoE output's reduce-scatter exists with TP at ep 1 only: tests/test_titan_moe_tp.py removes it
MOE_IDS = [t.id for t in titan_inventory(_model(), "cpu").terms if t.id.startswith("moe.") and t.id != "moe.rs"]


@pytest.mark.parametrize("term", MOE_IDS)
def test_a_removed_term_fails(term):
    # every MoE term is kept under none or selective-op at ep = 2: without it memplan misses a recorded storage
    assert any(_memplan(ac, 2, drop=(term,)) != Counter(RECORDED_EP2[ac]) - Counter([OFFSETS[2]] * (ac == "none"))
               for ac in ("none", "selective-op"))
    assert all(_memplan(ac, 2) == Counter(RECORDED_EP2[ac]) - Counter([OFFSETS[2]] * (ac == "none"))
               for ac in ("none", "selective-op"))


def test_cuda_router_in_fp32_by_hand():
    # the MoE's terms (the norms differ on CUDA too: titan.py's fused RMSNorm, tests/test_titan_cli.py)
    # torchtitan's gate runs under autocast(float32): on CUDA (derived) the scores are fp32, and under none the gate
    # keeps fp32 copies of its input (4 h a token) and weight (4 E h a layer). Per token at h 64, E 8, k 2, none: the
    # softmax 2E -> 4E (+16), gathered and sorted scores 2 x 2k -> 2 x 4k (+8), route_norm 2 -> 4 (+2), the input
    # 4h = 256: +282 a token, + 4 E h = 2048; selective-op keeps no router tensor (the gate recomputed, topk's values
    # fp32 on either): no difference
    def total(ac, device):
        c = _memplan(ac, device=device, prefix="moe.")
        return sum(n * k for n, k in c.items())
    assert total("none", "cuda") - total("none", "cpu") == 282 * S * B + 4 * SHAPE.E * SHAPE.h
    assert total("selective-op", "cuda") == total("selective-op", "cpu") > 0


# qwen3-30b-a3b on 8 GPUs (FSDP2 d = 8), s b = 1024 tokens, CUDA
H, A, G, D, FE, E, K, V, L = 2048, 32, 4, 128, 768, 128, 8, 151936, 48


def _estimate(ac="full", **kw):
    return estimate("qwen3-30b-a3b", impl="torchtitan", gpus=8, ac=ac, seq_len=1024, micro_batch=1, global_batch=8,
                    **kw).estimate


def test_router_gate_recomputed_under_selective_op():
    # torchtitan 0.3.0's SelectiveAC.Config ships force_recompute_mm_shapes_by_fqns = ["moe.router.gate"]: the Qwen3
    # MoE block's gate (a Linear E x h) is recomputed and not counted in the every-other-matmul rule, so its output
    # (tokens x E, 4 E B a token in fp32 on CUDA) is not kept (measured: RECORDED_EP2 and the ep 1 run above, which
    # validation/titan_moe.py wraps with that default). By hand, qwen3-30b-a3b a token on CUDA: the block input 2h
    # 4096, wqkv's output 2 (a + 2g) d 10240 (matmul 1; wo, matmul 2, recomputed), attention's output 2 a d 8192 and
    # fp32 log-sum-exp 4a 128, topk's fp32 values 4k 32 and int64 ids 8k 64: 22,752 B (with the gate 23,264)
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from validation.titan_moe import build_moe_block

    assert SelectiveAC.Config().force_recompute_mm_shapes_by_fqns == ["moe.router.gate"]
    gate = build_moe_block(SHAPE).get_submodule("moe.router.gate")
    assert isinstance(gate, torch.nn.Linear) and tuple(gate.weight.shape) == (SHAPE.E, SHAPE.h)
    per_token = 2 * H + 2 * (A + 2 * G) * D + 2 * A * D + 4 * A + 4 * K + 8 * K
    assert per_token == 22752
    assert _estimate("selective-op").per_layer_bytes == per_token * 1024


def test_ep_states_by_hand():
    # torchtitan's ParallelDims: efsdp = d t cp / ep = 1 at ep 8: each GPU keeps its E / 8 = 16 experts' fp32
    # states whole, the rest FSDP-sharded over 8: 16 B / 8 per parameter either way; in flight (bf16) the running and
    # the prefetched layer, each with the GPU's 16 experts only (FSDP2 all-gathers them over efsdp), and the head
    dense = H * (A + 2 * G) * D + A * D * H + 2 * H + 2 * D + E * H  # wqkv, wo, two norms, q / k norms, router
    experts = 3 * E * H * FE
    total = V * H + L * (dense + experts) + V * H + H
    for ep in (1, 8):
        st = _estimate(ep=ep).peak.states
        assert st.optimizer == -(-12 * total // 8) and st.gradients == -(-4 * total // 8)
        # + each layer's RoPE cache (CosSinRoPE: fp32 cos, sin [s, 2d] = 8 s d B; tests/test_titan.py)
        assert st.weights == 2 * (2 * (dense + experts // ep) + V * H + H) + L * 8 * 1024 * D


def test_ep_layer_adds_the_permutation_index():
    # at ep > 1 the layer keeps the permutation index (int64 k s b): 8 k = 64 bytes a token more under none; the
    # all-to-all outputs under selective-op: 2 x 2 k h + 8 E bytes (the counts) a layer
    for ac, extra in (("none", 64 * 1024), ("selective-op", 2 * 2 * K * H * 1024 + 8 * E), ("full", 0)):
        assert _estimate(ac, ep=8).per_layer_bytes - _estimate(ac).per_layer_bytes == extra, ac


@pytest.mark.parametrize("kw", [dict(compile=True, ep=2), dict(ep=3), dict(ep=16),
                                dict(ep=8, etp=2), dict(moe_imbalance=1.5)])
def test_refused(kw):
    with pytest.raises(MemplanError):
        _estimate(**kw)


@pytest.mark.slow
@SLOW
@pytest.mark.parametrize("ac", sorted(RECORDED_EP2))
def test_ep_gloo_equals_recorded(ac):
    for rank in measure_moe_ep(SHAPE, ac, S, B, ep=2):
        assert [n for _, _, n in rank["rows"]] == RECORDED_EP2[ac]
        assert rank["input_kept"] == (ac != "none")


@pytest.mark.slow
@SLOW
@pytest.mark.parametrize("ac", sorted(REC))
def test_traced_equals_memplan(ac):
    # every kept storage c s b (the offsets 4 E): the trace's polynomials at s b = 64 are memplan's bytes there
    traced = trace_moe(SHAPE, ac, balanced=False)
    at = {"s": S, "b": B}
    for _, _, expr in traced["rows"]:  # c s b, or a constant (the offsets): no other dependence on s or b
        s_, b_ = sorted(expr.free_symbols, key=str) if not expr.is_number else (1, 1)
        assert (expr / s_ / b_).is_number, expr
    values = Counter(int(expr.subs({x: at[x.name] for x in expr.free_symbols})) for _, _, expr in traced["rows"])
    if ac == "none":
        values[OFFSETS[1]] -= 1
    assert +values == _memplan(ac) and traced["input_kept"] == _input_kept(ac)


def test_search_tries_ep_and_agrees_with_estimate():
    # search --impl torchtitan on a Qwen3 MoE: ep over the divisors of E = 128 that divide the shard group (1, 2, 4,
    # 8 at d = 8), tp 1, 2, 4 (dividing the 4 KV heads: tests/test_titan_moe_tp.py), pp 1 to 8 (single- and
    # multi-stage: tests/test_titan_moe_plans.py); each listed plan is the plan
    # `estimate` gives the same memory and step time
    base = dict(impl="torchtitan", gpus=8, global_batch=16, gpu="h100-80gb", seq_len=2048)
    found = search("qwen3-30b-a3b", all_variants=True, **base).result
    assert sorted(set(found.evaluated.plans.ep.tolist())) == [1, 2, 4, 8]
    assert set(found.evaluated.plans.t.tolist()) == {1, 2, 4} and set(found.evaluated.plans.p.tolist()) == {1, 2, 4, 8}
    assert found.top
    for x in found.top[:3]:
        row = found.row(x)
        dims = row["torchtitan"]
        piped = dict(pp=dims["pp"], pipeline_schedule=dims["pipeline_schedule"]) if dims["pp"] > 1 else {}
        est = estimate("qwen3-30b-a3b", **base, ep=dims["ep"], tp=dims["tp"], ac=dims["ac"], dp_replicate=dims["dp_replicate"],
                       compile=dims["compile"], micro_batch=dims["pipeline_microbatch_size"] or dims["local_batch"], **piped)
        assert row["memory"]["device_bytes"] == est.device_bytes
        assert row["step_time_s"] == pytest.approx(est.estimate.perf.step_time_s, rel=1e-6)


@pytest.mark.parametrize("kw", [dict(compile=True, ep=2), dict(ep=3), dict(etp=2)])
def test_search_refusals(kw):
    with pytest.raises(MemplanError):
        search("qwen3-30b-a3b", impl="torchtitan", gpus=8, global_batch=16, gpu="h100-80gb", seq_len=2048, **kw)


@pytest.mark.parametrize("command", ["estimate", "search"])
def test_other_moe_layouts_refused_in_one_line(command, capsys):
    # Mixtral (no q / k norms, no MLA) is neither torchtitan's Qwen3 MoE nor its DeepSeek-V3 (tests/test_titan_dsv3.py)
    for model in ("mixtral-8x7b",):
        with pytest.raises(SystemExit) as exit_:
            main([command, "--model", model, "--impl", "torchtitan", "--gpus", "8", "--gpu", "h100-80gb"])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1 and "Qwen3 MoE and DeepSeek-V3 layouts only" in err, err


# torchtitan's own parallelize_qwen3 (sharding config with enable_ep, FSDP2 over 2 ranks, the experts over efsdp =
# 2 / ep) on a 2-layer model of the tiny shape, vocabulary 256, one AdamW step over gloo, both ranks alike:
#   MEMPLAN_TITAN_SLOW=1 PYTHONPATH=. pytest tests/test_titan_moe.py -k states_gloo   (~60 s).
# Hand derivation: a layer's dense parameters wqkv 64 x 128, wo 64 x 64, the q / k norms 16 + 16, the router 8 x 64, two norms 64 + 64: 12,960; its experts 3 x 8 x 32 x 64 = 49,152; the
# embedding and LM head 256 x 64 each, the final norm 64: 2 x 62,112 + 32,832 = 157,056 parameters, 78,528 a rank
# at ep 1 (all sharded over 2, no padding) and at ep 2 (the 4 local experts whole, 2 x 24,576 = 49,152, the rest / 2:
# 29,376): fp32 params and grads 4 x 78,528 = 314,112 B each, AdamW's two moments 628,224 B.
# The running layer unsharded in bf16 (the most at a block's MoE end): 2 x (12,960 + 49,152 / ep) = 124,224 B at
# ep 1, 75,072 B at ep 2 (the rank's experts only).
RECORDED_STATES = {1: {"params": 314112, "grads": 314112, "adam": 628224, "running": 124224},
                   2: {"params": 314112, "grads": 314112, "adam": 628224, "running": 75072}}
DENSE, EXPERTS, TAIL = 12960, 49152, 256 * 64 + 64


def _tiny_yaml(tmp_path):
    spec = _model(num_layers=2, vocab_size=256, seq_length=16, name="tiny-qwen3-moe").model_dump(exclude={"inventory"})
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({"model": spec}))
    return str(path)


@pytest.mark.parametrize("ep", sorted(RECORDED_STATES))
def test_ep_states_equal_the_recorded_run(ep, tmp_path):
    got = RECORDED_STATES[ep]
    assert got["running"] == 2 * (DENSE + EXPERTS // ep)  # the hand derivation above
    st = estimate(_tiny_yaml(tmp_path), impl="torchtitan", gpus=2, ep=ep, micro_batch=2, global_batch=4,
                  ac="full").estimate.peak.states
    assert st.gradients == got["grads"] and st.optimizer == got["params"] + got["adam"]
    # in flight: the running layer (measured) and the next one prefetched (derived: a GPU all-gathers ahead; on CPU
    # torchtitan's explicit EP prefetch is copied out only when the block runs), and the head (measured, dense)
    # + each layer's RoPE cache (CosSinRoPE: fp32 cos, sin [s, 2d] = 8 s d B; tests/test_titan.py)
    assert st.weights == 2 * got["running"] + 2 * TAIL + 2 * 8 * 16 * 16


@pytest.mark.slow
@SLOW
@pytest.mark.parametrize("ep", sorted(RECORDED_STATES))
def test_ep_states_gloo_equal_recorded(ep):
    for rank in measure_ep_states(SHAPE, ep=ep):
        assert {k: rank[k] for k in RECORDED_STATES[ep]} == RECORDED_STATES[ep]
        assert rank["layer_shapes"]["moe.routed_experts.inner_experts.w1_EFD"] == (SHAPE.E // 2, SHAPE.fe, SHAPE.h)
