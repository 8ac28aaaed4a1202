"""torchtitan 0.3.0's Llama 3 / dense Qwen3 decoder layer: the tensors alive inside its backward (the layer's moments).

One block from ``validation.titan.build_block`` (torchtitan's own layer code and AC wrappers; the sdpa inner
attention in place of FlexAttention, as there), run forward and backward with ``validation.transients``'s
``LiveStorages`` following every storage an op makes, and its ``Sampler`` taking after each op of the block's
backward the candidate moment: everything the block made that is still alive (its saves not yet released, the
recomputed forward under full AC, the incoming gradient, the gradients flowing through it) and the gradients of
its parameters made so far (elements: torch .grad, bf16 here).  The block's input is made from an outside leaf by an
op that saves nothing (``x0 * 1``), so it stays alive only when a checkpoint keeps it; the incoming gradient is
made by the loss's backward (``out.float().sum()``) and held by autograd only, as the layer above hands it on.

* ``trace_moments(shape, ac)``: under FakeTensorMode with s and b symbolic (the front of non-dominated candidates,
  each its bytes as a polynomial in s, b by dtype);
* ``measure_moments(shape, ac, s, b)``: real tensors on CPU, the largest candidate's bytes (transients and the
  layer's parameter gradients) and the op after which it happens; ``measure_moe_moments`` the same of torchtitan's
  Qwen3 MoE block (validation/titan_moe.py, balanced routing).

``python -m validation.titan_moments [none|full|selective-op ...]`` prints both at a tiny shape (``moe [modes]``: the
Qwen3 MoE block measured).
"""

from __future__ import annotations

import sys
from functools import partial

import sympy
import torch

from . import transients
from .titan import AC_MODES, Shape, build_block, loader_positions
from .trace_poly import exact_divisions, symbolic_sizes


def _run(block, x0, live: transients.LiveStorages, sampler, mask=None) -> None:
    """The block's forward and backward under ``live``, its backward sampled as decoder layer 0 (``mask``: the
    attention's, FlexAttention's block mask under CP: validation/titan_tp_moments.py)."""
    hooks = [p.register_post_accumulate_grad_hook(partial(lambda n, p: live.grad_made(p, n), f"layers.0.{name}"))
             for name, p in block.named_parameters()]
    live.sampler = sampler
    pos = loader_positions(x0.shape[0], x0.shape[1])  # as torchtitan's Trainer calls a layer (a batch input)
    try:
        with live:
            live.set(phase="forward", layer=None)
            x = x0 * 1
            out = block(x, mask, pos)
            x.register_hook(lambda g: live.set(layer=None))  # the layer's backward ends with its input's gradient
            del x
            before = set(live.buckets.get(("other",), {}))
            # a DTensor output (validation/titan_tp_moments.py): its local tensor, the gradient handed on as the layer
            # above hands it on (sequence-sharded), not a replicated seed
            loss = (out.to_local() if hasattr(out, "to_local") else out).float().sum()

            def start(g) -> None:  # the loss and its gradient's seed are not the layer's: moved out of the count
                for cdata, rec in list(live.buckets.get(("other",), {}).items()):
                    if cdata not in before and cdata != transients.storage(g)._cdata:
                        live.move(rec, ("loss",))
                live.set(phase="backward", layer=0)

            out.register_hook(start)
            del out
            loss.backward()
    finally:
        live.sampler = None
        for h in hooks:
            h.remove()


def trace_moments(shape, ac: str, s_hint: int = 256, b_hint: int = 3) -> list[dict]:
    """The block's backward moments under FakeTensorMode, s and b symbolic: one row per non-dominated candidate,
    ``at`` the op after which, ``bytes`` {dtype: polynomial in s, b} of what the block made and is alive,
    ``grad_elements`` its parameters' gradients made by then, ``transients`` (what, dtype, bytes) each.  ``shape``: a
    Shape (the dense block) or a MoeShape (the Qwen3 MoE block, its router's own routing: at ep 1 every size is
    static in s b, validation/titan_moe.py ``trace_moe``)."""
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode

    from .titan_moe import MoeShape, build_moe_block, wrap_ac

    if ac not in AC_MODES:
        raise ValueError(f"ac must be one of {AC_MODES}")
    env, names, sizes = symbolic_sizes(s_hint, b_hint)
    with FakeTensorMode(shape_env=env, allow_non_fake_inputs=False), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CPU autocast refuses the MoE router's fp32
        block = (wrap_ac(build_moe_block(shape, balanced=False), ac) if isinstance(shape, MoeShape)
                 else build_block(shape, ac))
        x0 = torch.randn(sizes["b"], sizes["s"], shape.h, dtype=torch.bfloat16, requires_grad=True)
        live = transients.LiveStorages(names, "layers", 1)
        polys = transients.Polys(names, [], exact_divisions)
        sampler = transients.Sampler(live, polys, checkpointed=ac != "none", head=False)
        _run(block, x0, live, sampler)
    rows = []
    for _, snap in sampler.fronts[("layer", 0)].items:
        by_dtype: dict[str, sympy.Expr] = {}
        items = []
        for what, dtype, nbytes in snap["transients"]:
            e = polys.expr(nbytes)
            name = str(dtype).replace("torch.", "")
            by_dtype[name] = sympy.expand(by_dtype.get(name, 0) + e)
            items.append((what, name, e))
        rows.append({"at": snap["op"], "bytes": by_dtype, "grad_elements": snap["grad_elements"], "transients": items})
    return rows


def measure_moments(shape: Shape, ac: str, s: int, b: int, seed: int = 0) -> dict:
    """Real tensors on CPU: the largest moment of the dense block's backward (``bytes``: what the block made that is
    alive, its parameters' bf16 gradients made so far included; ``at``: the op after which; ``grad_bytes``) and
    ``samples``: (node, op, bytes) after every op of the backward, in order."""
    torch.manual_seed(seed)
    return measure_block_moments(build_block(shape, ac), shape.h, s, b, seed)


def measure_moe_moments(shape, ac: str, s: int, b: int, seed: int = 0) -> dict:
    """``measure_moments`` for torchtitan's Qwen3 MoE block (validation/titan_moe.py ``build_moe_block``, balanced
    routing, ``shape`` a MoeShape) wrapped as AC mode ``ac``."""
    import warnings

    from .titan_moe import build_moe_block, wrap_ac

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CPU autocast refuses the router's fp32 (validation/titan_moe.py)
        return measure_block_moments(wrap_ac(build_moe_block(shape), ac), shape.h, s, b, seed)


def measure_block_moments(block, h: int, s: int, b: int, seed: int = 0, place=None, detail: bool = False,
                          mask=None) -> dict:
    """``measure_moments`` of any built block (hidden size ``h``); ``place``: the rank's (b, s, h) input made the
    block's input (validation/titan_tp_moments.py: a sequence-sharded DTensor, the positions then its global ones);
    ``detail``: ``rows``, each sample's live storages (what made it, dtype, bytes, bucket)."""
    torch.manual_seed(seed)
    x0 = torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True)
    if place is not None:
        x0 = place(x0)
    live = transients.LiveStorages({}, "layers", 1)
    best: dict = {"bytes": -1, "samples": []}

    def sample(op: str) -> None:
        if live.phase != "backward" or live.layer is None:
            return
        recs = [r for bucket, rs in live.buckets.items() if bucket[0] in ("other", "grad") for r in rs.values()]
        total = sum(int(r.nbytes) for r in recs)
        node = torch._C._current_autograd_node()
        best["samples"].append((node.name() if node is not None else "", op, total))
        if detail:
            best.setdefault("rows", []).append(sorted((r.what, str(r.dtype).replace("torch.", ""), int(r.nbytes),
                                                       r.bucket[0]) for r in recs))
        if total > best["bytes"]:
            grads = sum(int(r.nbytes) for r in live.buckets.get(("grad", 0), {}).values())
            best.update(bytes=total, at=op, grad_bytes=grads)

    _run(block, x0, live, sample, mask)
    return best


def main(argv: list[str]) -> None:
    if argv[:1] == ["moe"]:  # the Qwen3 MoE block: its measured largest moment per AC mode
        from .titan_moe import MoeShape
        for ac in argv[1:] or AC_MODES:
            m = measure_moe_moments(MoeShape(), ac, 32, 2)
            print(f"== moe {ac}: measured at s 32, b 2: {m['bytes']:,} B after {m['at']} ({m['grad_bytes']:,} B "
                  "gradients)")
        return
    shape = Shape()
    for ac in argv or AC_MODES:
        m = measure_moments(shape, ac, 32, 2)
        print(f"== {ac}: measured at s 32, b 2: {m['bytes']:,} B after {m['at']} ({m['grad_bytes']:,} B gradients)")
        for row in trace_moments(shape, ac):
            print(f"  after {row['at']}: {row['bytes']} + grads {row['grad_elements']} elements")
            for what, dtype, e in row["transients"]:
                print(f"      {what} {dtype} {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
