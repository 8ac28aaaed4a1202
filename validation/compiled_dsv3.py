"""What torch.compile keeps for the backward of torchtitan 0.3.0's DeepSeek-V3 decoder layers (``--compile`` on
DeepSeek-V3 at ep = tp = cp = 1, memplan/inventory/compiled_dsv3.py).

torchtitan's apply_compile compiles each DeepSeek-V3 block as it compiles Qwen3's (``block.compile(fullgraph=True)``
after AC wraps it, ``capture_scalar_outputs`` on for the token dispatch).  ``trace_dsv3_block`` builds one block with
torchtitan's own ``_build_dsv3_layers`` (validation/titan_dsv3.py ``build_dsv3_block``: the 671B flavour's kinds, q
latent, yarn ComplexRoPE, the sigmoid router with expert groups, route_norm, route_scale, shared experts; bf16; the
router's own top-k; ``build``), wraps it as torchtitan's AC modes do (validation/titan_moe.py ``wrap_ac``: none,
selective-op with its shipped save list and the stand-in attention op in it, full), calls it as torchtitan's Trainer does, with the dataloader's ``positions`` (validation/titan.py
``loader_positions``: each layer's RoPE gathers its cache rows at them), compiles it with dynamic s, b and reads the
forward graph's saved tensors with validation/compiled.py ``trace_compiled_layer`` (inductor's partitioner; each
shape a polynomial in s, b and the widths, ``names``), then measures the same compiled block's bytes alive after its
forward with real tensors (torch.profiler's allocation events) and the eager block's for comparison.

One substitution, as in validation/titan_dsv3.py: FlexAttention (no CPU backward) is stood in by one custom op.  Under
AOTAutograd the partitioner keeps what a backward USES, not what ``save_for_backward`` names, so the stand-in here
(``flex_lse``: validation/titan_dsv3.py's ``flex_saved`` forward) has FlexAttention's backward's inputs: its backward
is the flash formula on q, k, v, out and the fp32 log-sum-exp (torch's ``flex_attention_backward`` takes the same
five), so the partitioner keeps them as it keeps the flex_attention HOP's; the backward is one custom op
(``flex_lse_backward``) as FlexAttention's is one kernel (validation/compiled_moe_backward.py replays it).  That save
set on CUDA is derived from torch 2.13's code; the rest is traced.

    PYTHONPATH=. python -m validation.compiled_dsv3 dense|moe [none|selective-op|full] [inductor|aot] [S B]
    PYTHONPATH=. python -m validation.compiled_dsv3 record tests/data/compiled_dsv3.json   # every case, inductor

(``record``: both layers under the three AC modes, each compiled with inductor and measured at SHAPES, written as
the fixture tests/test_compiled_dsv3.py checks memplan's tables against.)

Nothing here computes a byte count from a formula: the trace reads the graph, the measurement reads allocations.
"""

from __future__ import annotations

import sys
import warnings

import torch

from validation.compiled import CompiledLayer, trace_compiled_layer
from validation.titan import loader_positions
from validation.titan_dsv3 import DsvShape, build_dsv3_block, flex_saved
from validation.titan_moe import wrap_ac

# every width and every width a shape could hold distinct (the MLA's sums and products, the router's groups and the
# constant 2 of its per-group top-2 included), so that a size names one field; h and fe multiples of 8 (the grouped
# GEMMs want 16-byte strides), E a multiple of 8 (memplan's DeepSeek-V3 router: 8 groups, of which 4 chosen, as here)
SHAPE = DsvShape(h=56, a=5, rq=34, rkv=44, dn=10, dr=18, dv=11, f=80, fe=32, E=24, ns=3, k=7, groups=8, limited=4)


@torch.library.custom_op("memplan_validation::flex_lse", mutates_args=())
def flex_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention (B, N, L, H): out (q's dtype) and the fp32 log-sum-exp (``flex_saved``'s forward)."""
    out, lse = flex_saved(q, k, v, scale)
    return out.clone(), lse.clone()


@flex_lse.register_fake
def _(q, k, v, scale):
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1], dtype=torch.float32)


def _setup(ctx, inputs, output):
    q, k, v, scale = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.scale = scale


@torch.library.custom_op("memplan_validation::flex_lse_backward", mutates_args=())
def flex_lse_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                      grad_out: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The flash backward from q, k, v, out and lse (P = exp(q k^T scale - lse), D = rowsum(dO * out)): dQ, dK, dV.
    One op, as torch's ``flex_attention_backward`` is one kernel: its s x s temporaries live inside it (Inductor keeps
    it opaque; validation/compiled_backward.py's measure counts them as the op's own scratch, its replay sees only
    dQ, dK, dV)."""
    qf, kf, vf, do = q.float(), k.float(), v.float(), grad_out.float()
    sq, sk = q.shape[-2], k.shape[-2]
    scores = (qf @ kf.transpose(-2, -1)) * scale
    scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1 + sk - sq), float("-inf"))
    p = (scores - lse.unsqueeze(-1)).exp()
    ds = p * (do @ vf.transpose(-2, -1) - (do * out.float()).sum(-1, keepdim=True))
    return ((ds @ kf * scale).to(q.dtype), (ds.transpose(-2, -1) @ qf * scale).to(k.dtype),
            (p.transpose(-2, -1) @ do).to(v.dtype))


@flex_lse_backward.register_fake
def _(q, k, v, out, lse, grad_out, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    return (*flex_lse_backward(q, k, v, out, lse, grad_out, ctx.scale), None)


flex_lse.register_autograd(_backward, setup_context=_setup)


class FlexLse(torch.nn.Module):
    """torchtitan's inner-attention call (B, L, N, H in and out) through ``flex_lse``."""

    def forward(self, q, k, v, *, attention_masks=None, scale=None, **_):
        out, _lse = flex_lse(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale)
        return out.transpose(1, 2)


def build(shape: DsvShape, moe: bool, ac: str):
    """torchtitan's DeepSeek-V3 block (``build_dsv3_block``, the router's own top-k) with ``FlexLse`` as its inner
    attention, wrapped as torchtitan's AC mode ``ac`` wraps it (``flex_lse`` in SelectiveAC's save list where
    torchtitan's names flex_attention)."""
    block = build_dsv3_block(shape, moe, balanced=False)
    block.attention.inner_attention = FlexLse()
    return wrap_ac(block, ac, save_also=(torch.ops.memplan_validation.flex_lse.default,))


def names(shape: DsvShape) -> dict[int, dict[str, int]]:
    """Each static width of ``shape`` as exponents of memplan's symbols (validation/compiled.py ``ORDER``): the MLA's
    sums d_n + d_r, d_n + d_v, r_kv + d_r and d_r / 2 (ComplexRoPE's complex rows) as their own symbols."""
    a, dn, dr, dv = shape.a, shape.dn, shape.dr, shape.dv
    table = {shape.h: {"h": 1}, a: {"a": 1}, shape.rq: {"rq": 1}, shape.rkv: {"rkv": 1}, dn: {"dn": 1},
             dr: {"dr": 1}, dr // 2: {"dr2": 1}, dv: {"dv": 1}, dn + dr: {"dqk": 1}, dn + dv: {"dkv": 1},
             a * (dn + dr): {"a": 1, "dqk": 1}, a * (dn + dv): {"a": 1, "dkv": 1}, a * dv: {"a": 1, "dv": 1},
             a * dn: {"a": 1, "dn": 1}, a * dr: {"a": 1, "dr": 1}, a * dr // 2: {"a": 1, "dr2": 1},
             shape.rkv + dr: {"rkvr": 1}, shape.f: {"f": 1}, shape.fe: {"fe": 1}, shape.ns * shape.fe: {"fs": 1},
             shape.E: {"E": 1}, shape.k: {"k": 1}, shape.groups: {"G": 1}, shape.limited: {"lim": 1},
             shape.E // shape.groups: {"E": 1, "G": -1}}
    if len(table) != 25 or 2 in table:
        raise ValueError(f"the widths of {shape} are not distinct")
    return table


def trace_dsv3_block(moe: bool, ac: str = "none", route: str = "inductor", shape: DsvShape = SHAPE, s: int = 20,
                     b: int = 2) -> CompiledLayer:
    """The compiled DeepSeek-V3 block's saved tensors (dynamic s, b; ``moe`` the MoE layer, else the dense first
    layer) and its bytes after the forward at s, b, called with the dataloader's positions."""
    torch.manual_seed(0)
    eager = build(shape, moe, ac)

    def inputs(s: int, b: int, seed: int):
        torch.manual_seed(seed)
        pos = loader_positions(b, s)
        return (torch.randn(b, s, shape.h, dtype=torch.bfloat16, requires_grad=True),
                lambda layer, x: layer(x, None, pos))

    torch._dynamo.reset()
    with warnings.catch_warnings(), torch._dynamo.config.patch(capture_scalar_outputs=True):
        warnings.simplefilter("ignore")  # CPU autocast refuses fp32 (validation/titan_moe.py)
        return trace_compiled_layer(route, "torchtitan", ac=ac, built=(eager, inputs, names(shape)), s=s, b=b)


SHAPES = ((20, 2), (12, 4))  # (s, b) of the measured runs (b > 1: b = 1 would specialise the dynamic kernel)
CASES = tuple((kind, ac) for kind in ("dense", "moe") for ac in ("none", "selective-op", "full"))


def record(path: str) -> None:
    """Compile every CASE with inductor at each of SHAPES and write the saved set and the bytes as JSON."""
    import dataclasses
    import importlib.metadata
    import json

    cases = []
    for kind, ac in CASES:
        runs = [trace_dsv3_block(kind == "moe", ac, s=s, b=b) for s, b in SHAPES]
        cases.append({"layer": kind, "ac": ac, "saved": [[t.kind, t.elements, t.dtype] for t in runs[0].saved
                                                         if t.kind != "parameter"],
                      "runs": [{"s": r.s, "b": r.b, "after_forward": r.after_forward, "output": r.output_bytes,
                                "eager_after_forward": r.eager_after_forward} for r in runs]})
        print(json.dumps(cases[-1]), flush=True)
    doc = {"command": f"PYTHONPATH=. python -m validation.compiled_dsv3 record {path}",
           "measured_with": f"torchtitan {importlib.metadata.version('torchtitan')}, torch {torch.__version__} "
                            "(inductor on CPU)", "shape": dataclasses.asdict(SHAPE),
           "cases": cases}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")


def main(argv: list[str]) -> None:
    if argv[:1] == ["record"]:
        record(argv[1])
        return
    kind, ac, route = (argv + ["dense", "none", "inductor"][len(argv):])[:3]
    s, b = (int(argv[3]), int(argv[4])) if argv[4:] else (20, 2)
    r = trace_dsv3_block(kind == "moe", ac, route, s=s, b=b)
    for t in r.saved:
        print(f"{t.node:24} {t.kind:10} {t.dtype:9} {t.elements}")
    print(f"s={r.s} b={r.b}: after forward {r.after_forward} B (output {r.output_bytes} B), eager "
          f"{r.eager_after_forward} B")


if __name__ == "__main__":
    main(sys.argv[1:])
