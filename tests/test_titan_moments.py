"""torchtitan's dense decoder layer's backward moments (memplan/inventory/titan_moments.py) against torchtitan's real
block run forward and backward on CPU (validation/titan_moments.py: every storage the block made that is alive
after each op of its backward, its bf16 weight gradients included).  memplan's moments, evaluated here from their
definition (the layer's terms kept under the AC mode and not freed, plus the moment's transients), must equal the
measured largest moment of the backward and the one after sdpa's backward, at three Llama 3 shapes (the FFN wide,
wider, narrow: the peak then falls in the RMSNorm's backward) and a dense Qwen3 one, every AC mode; without the
moments memplan has no layer moment and every test here fails.  The same for torchtitan's Qwen3 MoE block (its
combine's and experts' moments at two shapes, every AC mode; with EP on 2 gloo ranks recorded, re-measured opt-in)
and DeepSeek-V3's dense and MoE blocks (their feed-forward side: the attention's backward is a stand-in there).  The
symbolic traces (the same step under FakeTensorMode) are opt-in."""

import os

import pytest
import sympy

pytest.importorskip("torchtitan")

from memplan.core.model import ModelSpec  # noqa: E402
from memplan.core.training import Recompute  # noqa: E402
import torch  # noqa: E402

from memplan.inventory.titan import titan_inventory, titan_model  # noqa: E402
from memplan.inventory.titan_dsv3 import ROUTER_GROUPS, dsv3_inventory  # noqa: E402
from memplan.presets.catalog import load_model  # noqa: E402
from validation.titan import AC_MODES, Shape  # noqa: E402
from validation.titan_dsv3 import DsvShape, build_dsv3_block, wrap_dsv3_ac  # noqa: E402
from validation.titan_moe import MoeShape  # noqa: E402
from validation.titan_moments import (measure_block_moments, measure_moe_moments, measure_moments,  # noqa: E402
                                      trace_moments)

MODES = {"none": Recompute.NONE, "full": Recompute.FULL, "selective-op": Recompute.SELECTIVE}
SHAPES = (Shape(h=64, a=4, g=2, f=160), Shape(h=64, a=4, g=1, f=224), Shape(h=128, a=4, g=1, f=96),
          Shape(h=64, a=4, g=2, f=160, qwen3=True))
BYTES = {"act": 2, "fp32": 4, "int64": 8}


def tiny(shape: Shape) -> ModelSpec:
    """The block's sizes as a model (torchtitan's Qwen3 block: q / k norms on the head dim)."""
    qwen3 = dict(qk_norm=True, qk_norm_width="head", head_dim=shape.h // shape.a) if shape.qwen3 else {}
    return ModelSpec(**qwen3,name="tiny-titan", num_layers=1, hidden_size=shape.h, num_attention_heads=shape.a,
                     num_kv_heads=shape.g, ffn_hidden_size=shape.f, seq_length=32, vocab_size=256, norm="rmsnorm",
                     mlp="swiglu", position_embedding="rope", tied_embeddings=False, dropout=False, bias=False,
                     attention="flash")


def _bytes(term, s, b):
    return int(term.elements.evaluate({"s": s, "b": b, "cp": 1, "t": 1})) * BYTES[term.dtype]


def memplan_moments(shape: Shape, ac: str, s: int, b: int) -> dict[str, int]:
    """Each layer moment's bytes on one GPU without TP: the layer's terms kept under ``ac`` that the moment has not
    freed (a recomputed layer holds what none keeps besides its own), plus its transients; the
    FSDP2-only moment and the previous layer's held reduce-scatter input (nothing is reduce-scattered without
    FSDP2: tests/test_titan_step.py measures them in a whole step) left out."""
    inv = titan_inventory(tiny(shape), "cpu")
    layer = [t for t in inv.terms if t.scope == "layer" and not t.needs_tp and not t.needs_cp]
    out = {}
    for m in inv.moments:
        if m.scope != "layer" or m.id == "fsdp_reduce_scatter" or (m.applies == "rerun" and ac == "none"):
            continue
        kept = [t for t in layer if t.id not in m.freed
                and (t.kept(MODES[ac]) or t.kept(Recompute.NONE))]
        out[m.id] = sum(_bytes(t, s, b) for t in kept) + sum(_bytes(t, s, b) for t in m.transients
                                                             if not t.id.startswith("rs_held") and not t.needs_tp)
    return out


@pytest.mark.parametrize("shape", SHAPES, ids=["f2.5h", "f3.5h", "f0.75h", "qwen3"])
@pytest.mark.parametrize("ac", AC_MODES)
def test_measured_backward_peak_equals_memplan(shape, ac):
    s, b = 32, 2
    measured = measure_moments(shape, ac, s, b)
    ours = memplan_moments(shape, ac, s, b)
    assert max(ours.values()) == measured["bytes"], (ours, measured["at"])
    sdpa = [n for _, op, n in measured["samples"] if op == "_scaled_dot_product_flash_attention_for_cpu_backward"]
    assert ours["attention_backward"] == sdpa[0]


def test_swiglu_moment_by_hand():
    # h 64, a 4, g 2, f 160, d 16, AC none, per token: the layer keeps 3032 B (tests/test_titan.py; the RoPE rows
    # gathered at the positions among them), less the product's 2f = 320 freed; the output's gradient 2h = 128, w2's
    # input gradient 2f = 320, silu's and w3's gradients 2 x 2f = 640: 3800 B per token; w2's weight gradient h f x
    # 2 B = 20,480 B
    assert memplan_moments(SHAPES[0], "none", 32, 2)["swiglu_backward"] == 3800 * 64 + 20480 == 263680


def test_llama3_8b_moments_on_cuda():
    # no composite RMSNorm backward on CUDA; FlexAttention's fp32 delta (4a per token) in the attention moment
    inv = titan_inventory(load_model("llama3-8b").model, "cuda")
    ids = [m.id for m in inv.moments if m.scope == "layer"]
    assert ids == ["rerun_w2_reduce_scatter", "swiglu_backward", "attention_backward", "fsdp_reduce_scatter"]
    delta = next(t for m in inv.moments if m.id == "attention_backward" for t in m.transients if t.id == "flex_delta")
    assert _bytes(delta, 1, 1) == 4 * 32
    # FSDP2's reduce-scatter: 6 B per parameter of the layer (bf16 gradients + their fp32 copy): 218,112,000
    # parameters (4096 x (4096 + 2 x 1024 + 4096) + 3 x 4096 x 14336 + 2 x 4096), the input's gradient 2h per token
    rs = next(m for m in inv.moments if m.id == "fsdp_reduce_scatter")
    assert sum(_bytes(t, 1, 1) for t in rs.transients) == 6 * 218_112_000 + 2 * 4096


SLOW = pytest.mark.skipif(not os.environ.get("MEMPLAN_TITAN_SLOW"), reason="set MEMPLAN_TITAN_SLOW=1 to run")


@pytest.mark.slow
@SLOW
@pytest.mark.parametrize("ac", AC_MODES)
def test_traced_front_holds_memplan_moments(ac):
    # the symbolic trace's candidates (every s, b): memplan's SwiGLU, ffn_norm and attention moments are among them
    shape = SHAPES[0]
    s_, b_ = sympy.Symbol("s", integer=True, positive=True), sympy.Symbol("b", integer=True, positive=True)
    front = [sum(r["bytes"].values()) + 2 * r["grad_elements"] for r in trace_moments(shape, ac)]
    at = [(32, 2), (48, 3)]
    candidates = [tuple(int(e.subs({s_: s, b_: b})) for s, b in at) for e in front]
    ours = [memplan_moments(shape, ac, s, b) for s, b in at]
    for id in ours[0]:
        assert tuple(o[id] for o in ours) in candidates, id


# -- torchtitan's Qwen3 MoE layer (memplan/inventory/titan_moments.py moe_moments) --

SDPA, SDPA_OP = "ScaledDotProductFlashAttentionForCpuBackward0", "_scaled_dot_product_flash_attention_for_cpu_backward"
SCATTER_ADD = "GeneratedBackwardFor_torchtitan_deterministic_scatter_add"
MOE_SHAPES = (MoeShape(), MoeShape(fe=64, E=16))  # h 64, a 4, g 2, d 16, top-2; E 8 fe 32 / E 16 fe 64
MOE_SIZES = ((32, 2), (32, 1))  # the second: fewer tokens beside the experts' weights (their gradients' moment peaks)


def memplan_moe_moments(shape: MoeShape, ac: str, s: int, b: int, ep: int = 1, cp: int = 1) -> dict[str, int]:
    """``memplan_moments`` for torchtitan's Qwen3 MoE layer at ``shape`` (tp 1; ``ep`` ranks, the rank's E / ep
    experts; ``cp`` ranks, the rank's s / cp tokens: tests/test_titan_tp_moments.py)."""
    spec = load_model("qwen3-30b-a3b").model.model_copy(update=dict(
        hidden_size=shape.h, num_attention_heads=shape.a, num_kv_heads=shape.g, head_dim=shape.d,
        num_experts=shape.E, moe_top_k=shape.k, moe_ffn_hidden_size=shape.fe, seq_length=s, num_layers=1))
    return layer_moment_bytes(titan_inventory(spec, "cpu"), spec.symbols(b=b, t=1, cp=cp, ep=ep, etp=1), ac, cp, 0)


def layer_moment_bytes(inv, values: dict, ac: str, cp: int, sp: int) -> dict[str, int]:
    """Each layer moment's bytes at ``values``: the layer's terms kept under ``ac`` (a recomputed layer holds what
    none keeps besides its own) not freed by the moment, plus its transients; FSDP2's moment and held input left out
    (``sp``: sequence parallel, Term.bytes)."""
    layer = [t for t in inv.terms if t.scope == "layer" and t.exists_at_cp(cp)]
    out = {}
    for m in inv.moments:
        if m.scope != "layer" or m.id == "fsdp_reduce_scatter" or (m.applies == "rerun" and ac == "none"):
            continue
        kept = [t for t in layer if t.id not in m.freed and (t.kept(MODES[ac]) or t.kept(Recompute.NONE))]
        out[m.id] = sum(t.bytes(values, 2, sp) for t in kept) + sum(
            t.bytes(values, 2, sp) for t in m.transients if not t.id.startswith("rs_held"))
    return out


def measured_points(samples: list, ac: str, attention: str = SDPA) -> dict[str, int]:
    """The measured bytes at memplan's MoE-layer moments, from the samples of the block's backward: combine's score
    multiply (MulBackward0 after the scatter_add's gather: under none the sum of its second product, in a recomputed
    layer the second product, see below), w1's grouped GEMM's weight gradient (the last grouped GEMM of the backward),
    the largest moment between it and the attention's backward (node ``attention``: ffn_norm's composite backward) and
    after sdpa's kernel."""
    gather = next(i for i, (node, _, _) in enumerate(samples) if node.startswith(SCATTER_ADD))
    first = next(i for i, (node, _, _) in enumerate(samples) if i > gather and node == "MulBackward0")
    muls = [n for node, op, n in samples[first:first + 6] if node == "MulBackward0" and op in ("mul", "sum")]
    grouped = [n for node, op, n in samples if node == "GroupedMmBackward0" and op == "_grouped_mm"]
    last_grouped = max(i for i, (node, op, _) in enumerate(samples) if node == "GroupedMmBackward0")
    start = next(i for i, (node, _, _) in enumerate(samples) if node == attention)
    points = {"moe_combine_backward": muls[2] if ac == "none" else muls[1], "moe_experts_backward": grouped[-1],
              "ffn_norm_backward": max(n for _, _, n in samples[last_grouped + 1:start])}
    if ac != "none":  # the recomputed forward's combine: its product's bf16 cast, before the scatter_add
        add = next(i for i, (_, op, _) in enumerate(samples) if op == "torchtitan.deterministic_scatter_add")
        points["moe_rerun_combine"] = next(samples[i][2] for i in range(add, -1, -1) if samples[i][1] == "_to_copy")
    if attention == SDPA:  # after the kernel (the stand-in for DeepSeek-V3's FlexAttention is not its backward)
        points["attention_backward"] = next(n for _, op, n in samples[start:] if op == SDPA_OP)
    return points


def check_moe_points(ours: dict, points: dict, ac: str, shape: MoeShape, s: int, b: int, ep: int,
                     rerun_extra: int = 0) -> None:
    """memplan's MoE-layer moments against the measured points: the grouped GEMMs' int32 offsets (4 E / ep B a layer,
    not modelled: memplan/inventory/titan_moe.py) are alive until w1's grouped GEMM's backward is done; in a
    recomputed layer (full, selective-op: the checkpoint hands the recomputed saves to the node and drops them once
    unpacked) combine's saved fp32 output and scores are gone by the sum of its second product, so the peak there is
    that product, one sum (4 k B per routed token, T k fp32) below memplan's moment, counted as the none one's."""
    offsets = 4 * shape.E // ep
    sum_bytes = 0 if ac == "none" else 4 * shape.k * s * b
    if ac != "none":  # the recomputed forward's combine (a recomputed layer only)
        assert ours["moe_rerun_combine"] + offsets + rerun_extra == points["moe_rerun_combine"]
    assert ours["moe_combine_backward"] + offsets - sum_bytes == points["moe_combine_backward"]
    assert ours["moe_experts_backward"] + offsets == points["moe_experts_backward"]
    assert ours["ffn_norm_backward"] == points["ffn_norm_backward"]
    if "attention_backward" in points:
        assert ours["attention_backward"] == points["attention_backward"]


@pytest.mark.parametrize("ac", AC_MODES)
@pytest.mark.parametrize("at", (0, 1), ids=["E8", "E16-few-tokens"])
def test_moe_measured_moments_equal_memplan(at, ac):
    shape, (s, b) = MOE_SHAPES[at], MOE_SIZES[at]
    measured = measure_moe_moments(shape, ac, s, b)
    ours = memplan_moe_moments(shape, ac, s, b)
    check_moe_points(ours, measured_points(measured["samples"], ac), ac, shape, s, b, 1)
    # and the layer's largest moment, memplan's being the largest of its moments
    top = max(ours, key=ours.get)
    extra = 4 * shape.E if top.startswith("moe_") else 0
    low = 4 * shape.k * s * b if (top == "moe_combine_backward" and ac != "none") else 0
    assert ours[top] + extra - low == measured["bytes"], (ours, measured["at"])
    if ac != "none":  # at ep 1 the recomputed forward's combine stays below the combine's backward
        assert ours["moe_rerun_combine"] < ours["moe_combine_backward"] - low


# measured on rank 0 of 2 over gloo with expert parallelism (rank 1 alike), MoeShape(), s 32, b 2, balanced routing:
#   MEMPLAN_TITAN_SLOW=1 pytest tests/test_titan_moments.py -k moe_ep_moments_gloo   (~35 s a mode)
# the points of measured_points; "max": the backward's largest moment, under full and selective-op the recomputed
# forward's combine (after the bf16 cast of its fp32 product: w2's output, the all-to-all's output and its autograd
# wrapper, the fp32 product and its bf16 cast, the residual and the output's zeros alive in the recompute)
# (the block called with the dataloader's positions, as torchtitan's Trainer calls it: CosSinRoPE's cos and sin gathered
# at them, 8 d s b = 8,192 B, alive at every point until the attention's RoPE backward)
RECORDED_EP2 = {
    "none": {"moe_combine_backward": 361616, "moe_experts_backward": 287376, "ffn_norm_backward": 282496,
             "attention_backward": 216960, "max": 361616},
    "full": {"moe_combine_backward": 369296, "moe_experts_backward": 295568, "ffn_norm_backward": 290688,
             "attention_backward": 225152, "moe_rerun_combine": 386544, "max": 386544},
    "selective-op": {"moe_combine_backward": 369296, "moe_experts_backward": 295568, "ffn_norm_backward": 290688,
                     "attention_backward": 225152, "moe_rerun_combine": 386544, "max": 386544},
}


def memplan_moe_ep_moments(ac: str, ep: int) -> dict[str, int]:
    """``memplan_moe_moments`` at MoeShape(), s 32, b 2 on one rank of ``ep`` (each rank's own s b tokens)."""
    return memplan_moe_moments(MoeShape(), ac, 32, 2, ep=ep)


@pytest.mark.parametrize("ac", AC_MODES)
def test_moe_ep_moments_equal_recorded(ac):
    ours = memplan_moe_ep_moments(ac, 2)
    check_moe_points(ours, RECORDED_EP2[ac], ac, MoeShape(), 32, 2, 2)
    # the largest: combine's backward under none, the recomputed forward's combine in a recomputed layer (with EP
    # it holds the all-to-all's output and its wrapper besides: 2 x 2 k h B per token, above the backward's)
    top = "moe_combine_backward" if ac == "none" else "moe_rerun_combine"
    assert ours[top] + 4 * MoeShape().E // 2 == RECORDED_EP2[ac]["max"]


@pytest.mark.slow
@SLOW
@pytest.mark.parametrize("ac", AC_MODES)
def test_moe_ep_moments_gloo(ac):
    from validation.titan_moe import measure_moe_ep

    for rank in measure_moe_ep(MoeShape(), ac, 32, 2, ep=2, moments=True, port=29561 + AC_MODES.index(ac)):
        assert {**measured_points(rank["samples"], ac), "max": rank["bytes"]} == RECORDED_EP2[ac]


def test_moe_combine_moment_by_hand():
    # qwen3-30b-a3b's MoE (h 2048, top-8) under AC none, per token: the incoming gradient 2h = 4,096 B, combine's
    # gradient copied to fp32 4 k h = 65,536 B, the multiply's two fp32 products 2 x 65,536 B and the scores'
    # fp32 gradient summed over h 4 k = 32 B: 200,736 B per token beside what the layer keeps
    spec = load_model("qwen3-30b-a3b").model
    m = next(m for m in titan_inventory(spec, "cpu").moments if m.id == "moe_combine_backward")
    per_token = sum(_bytes(t, 1, 1) for t in m.transients if not t.id.startswith("rs_held"))
    assert per_token == 4096 + 65536 + 2 * 65536 + 32 == 200_736


@pytest.mark.slow
@SLOW
@pytest.mark.parametrize("ac", AC_MODES)
def test_moe_traced_front_holds_memplan_moments(ac):
    # the MoE block's symbolic trace (every s, b; ~10 s a mode): memplan's four moments are among its candidates, the
    # grouped GEMMs' offsets (4 E B) added to the MoE's two, in a recomputed layer combine's sum taken off (above)
    shape = MoeShape()
    s_, b_ = sympy.Symbol("s", integer=True, positive=True), sympy.Symbol("b", integer=True, positive=True)
    front = [sum(r["bytes"].values()) + 2 * r["grad_elements"] for r in trace_moments(shape, ac, 64, 3)]
    at = [(32, 2), (48, 3)]
    candidates = [tuple(int(e.subs({s_: s, b_: b})) for s, b in at) for e in front]
    ours = [memplan_moe_moments(shape, ac, s, b) for s, b in at]
    for id in ours[0]:
        rerun_sum = id == "moe_combine_backward" and ac != "none"
        extra = [4 * shape.E * id.startswith("moe_") - 4 * shape.k * s * b * rerun_sum for s, b in at]
        assert tuple(o[id] + x for o, x in zip(ours, extra)) in candidates, id


# -- torchtitan's DeepSeek-V3 layers (memplan/inventory/titan_dsv3_moments.py) --

# h 64, 4 heads, r_q 32, r_kv 48, d_n 16, d_r 8, d_v 12, dense f 96, 16 experts of 32, one shared, top-2, the 671B
# router's groups (8, 4 chosen): tests/test_titan_dsv3.py's shape
DSV3 = DsvShape(E=16, groups=ROUTER_GROUPS[0], limited=ROUTER_GROUPS[1])
FLEX = "GeneratedBackwardFor_memplan_validation_flex_saved_defaultBackward"  # the attention stand-in's backward


def memplan_dsv3_moments(ac: str, moe: bool, s: int = 32, b: int = 2) -> dict[str, int]:
    """``memplan_moments`` of the tiny DeepSeek-V3 model's layer 1 (MoE) or 0 (dense): 2 layers, 1 dense; the
    attention's moment apart (derived: validation's stand-in is not FlexAttention's backward)."""
    spec = load_model("deepseek-v3").model.model_copy(update=dict(
        hidden_size=DSV3.h, num_attention_heads=DSV3.a, num_kv_heads=DSV3.a, q_lora_rank=DSV3.rq,
        kv_lora_rank=DSV3.rkv, qk_nope_head_dim=DSV3.dn, qk_rope_head_dim=DSV3.dr, v_head_dim=DSV3.dv,
        ffn_hidden_size=DSV3.f, moe_ffn_hidden_size=DSV3.fe, moe_shared_ffn_hidden_size=DSV3.ns * DSV3.fe,
        num_experts=DSV3.E, moe_top_k=DSV3.k, moe_first_dense_layers=1, num_layers=2, seq_length=s, mtp_layers=0,
        vocab_size=256))
    inv = dsv3_inventory(titan_model(spec), "cpu")
    values = spec.symbols(b=b, t=1, cp=1, ep=1, etp=1)
    layer = [t for t in inv.terms if t.scope == "layer"]
    out = {}
    for m in inv.moments:
        if m.scope != "layer" or m.id in ("fsdp_reduce_scatter", "attention_backward") or (
                m.layers and int(moe) not in m.layers) or (m.applies == "rerun" and ac == "none"):
            continue
        kept = [t for t in layer if t.id not in m.freed and (t.kept(MODES[ac]) or t.kept(Recompute.NONE))]
        out[m.id] = sum(t.bytes(values, 2, 0) for t in kept) + sum(
            t.bytes(values, 2, 0) for t in m.transients if not t.id.startswith("rs_held"))
    return out


@pytest.mark.parametrize("ac", AC_MODES)
@pytest.mark.parametrize("moe", [True, False], ids=["moe", "dense"])
def test_dsv3_measured_moments_equal_memplan(moe, ac):
    torch.manual_seed(0)
    block = wrap_dsv3_ac(build_dsv3_block(DSV3, moe), ac)
    samples = measure_block_moments(block, DSV3.h, 32, 2)["samples"]
    ours = memplan_dsv3_moments(ac, moe)
    start = next(i for i, (node, _, _) in enumerate(samples) if node == FLEX)
    offsets = 4 * DSV3.E  # the grouped GEMMs' int32 offsets, alive until w1's grouped GEMM's backward is done
    if moe:  # Qwen3 MoE's checks (the shared experts' backward runs before the combine's)
        points = measured_points(samples, ac, FLEX)
        # under selective-op the shared experts' w3 output (matmul 7, f_s = 32 wide: 2 x 32 x 64 = 4,096 B) is still
        # in the cache at the recomputed forward's combine; memplan has it as the layer's weighted term, 1/2 of it at
        # L = 2 with one dense layer (titan_dsv3_moments.py): 2,048 B short here, 3/61 of it for the 671B model
        extra = 2 * DSV3.ns * DSV3.fe * 64 // 2 if ac == "selective-op" else 0
        check_moe_points(ours, points, ac, DSV3, 32, 2, 1, extra)
        top = max(ours["moe_combine_backward"] + offsets - (ac != "none") * 4 * DSV3.k * 64,
                  ours["moe_experts_backward"] + offsets, ours["ffn_norm_backward"],
                  ours.get("moe_rerun_combine", 0) + offsets + extra)
    else:  # the SwiGLU's mul backward (its second product), ffn_norm's composite backward after it
        muls = [i for i, (node, op, _) in enumerate(samples) if node == "MulBackward0" and op == "mul"]
        assert ours["dense_swiglu_backward"] == samples[muls[1]][2]
        assert ours["dense_ffn_norm_backward"] == max(n for _, _, n in samples[muls[1] + 1:start])
        top = max(ours.values())
    # nothing in the layer's backward before the attention's is above memplan's moments
    assert max(n for _, _, n in samples[:start]) == top
