"""What torchtitan's memory-budget AC (``MemoryBudgetAC``: ``activation_memory_budget = F``, the blocks compiled)
RECOMPUTES in the backward of torchtitan 0.3.0's Llama 3 block, read off the same partitioned graphs whose forward
validation/budget.py reads the saved set from: the real-size block compiled under ``FakeTensorMode`` with AOTAutograd
and inductor's partitioner and decompositions (validation/compiled.py ``_aot_backend``), its backward run too so that
the backward graph is partitioned and handed over.

A node of the backward graph that AOTAutograd's joint graph tagged as forward (``partitioner_tag`` "is_forward") is
forward work the backward re-runs. Each is one of:
- a matmul (``aten.mm``): its FLOPs 2 m k n from its fake shapes, classed by its weight's shape (the fused QKV linear
  h x (q + 2 g d), wo q x h, the three FFN linears h x f or f x h);
- the attention kernel (sdpa's CPU forward, the stand-in for FlexAttention: validation/titan.py): re-run whole;
- a view (reshape, permute, slice, alias, getitem): no work;
- anything else: a memory-bound op. Their traffic is counted as Inductor's fused kernels would move it (the
  assumption memplan/timing/traffic.py ``layer_traffic_bytes(fused=True)`` makes for the compiled forward): the
  recomputed memory-bound region reads each tensor it takes from outside itself once (a saved tensor, a recomputed
  matmul's or attention's output, the RoPE buffer's s rows; the norms' weights, h elements a layer, left out: not
  per token) and writes once each tensor a matmul or the attention kernel reads (kernels Inductor does not fuse
  into); what only the backward's own pointwise ops read is taken as fused into them (not written). An estimate
  from the graph, not a measurement: the backward's kernels may read some of the same inputs anyway (less), or
  Inductor may split a chain (more).

The block is called with the dataloader's positions, as torchtitan's Trainer calls it and budget.py traces the saved
sets: below F = 1 the RoPE gather at them is recomputed (the positions, a batch input, read: int64 per token).
"""

from __future__ import annotations

import warnings

import torch

from .compiled import _base

VIEW_OPS = ("view", "permute", "slice", "alias", "t", "expand", "unsqueeze", "squeeze", "_unsafe_view", "getitem",
            "view_as_real", "view_as_complex", "transpose", "select", "as_strided", "reshape")


def _partitioned(shape, s: int, b: int, budget: float):
    """The forward and backward graphs of the compiled block at budget F (fake shapes, nothing computed)."""
    import torch._functorch.config as fconfig
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .compiled import _aot_backend
    from .titan import build_block, loader_positions

    graphs: dict = {}
    torch._dynamo.reset()
    with fconfig.patch(activation_memory_budget=budget, enable_autograd_cache=False), FakeTensorMode():
        block = build_block(shape, "none", max_seq_len=s).train()
        x = torch.randn(b, s, shape.h, dtype=torch.bfloat16, requires_grad=True)
        backend = _aot_backend(lambda gm, _: graphs.setdefault("fw", gm), lambda gm, _: graphs.setdefault("bw", gm))
        pos = loader_positions(b, s)  # as torchtitan's Trainer calls every block, as budget.py traces it
        torch.compile(block, backend=backend, dynamic=False)(x, None, pos).sum().backward()
    if set(graphs) != {"fw", "bw"}:
        raise RuntimeError(f"expected one forward and one backward graph, got {sorted(graphs)}")
    return graphs["fw"], graphs["bw"]


def _kind(node) -> str:
    name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
    if name in ("mm", "addmm", "bmm"):
        return "mm"
    if "scaled_dot_product" in name:
        return "attention"
    if name in VIEW_OPS or getattr(node.target, "is_view", False):
        return "view"
    return "memory"


def _bytes(node) -> int:
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _linear(node, widths: dict) -> str:
    """The block linear a recomputed mm runs, by its weight's (in, out) shape."""
    k, n = (int(x) for x in node.args[1].meta["val"].shape)
    for name, shapes in widths.items():
        if (k, n) in shapes:
            return name
    raise RuntimeError(f"a recomputed matmul of unknown shape {k} x {n}: {node.format_node()}")


def recomputed(shape, s: int, b: int, budget: float) -> dict:
    """What the backward re-runs at budget F: ``linears`` (the recomputed matmuls by linear, sorted), ``matmul_flops``
    (their FLOPs per token), ``attention`` (attention kernels re-run), ``memory_bytes`` (the fused traffic of the
    recomputed memory-bound ops per token, the module docstring's bound; int division by s b), ``memory_ops`` (how
    many recomputed memory-bound nodes)."""
    _, bw = _partitioned(shape, s, b, budget)
    h, d = shape.h, shape.h // shape.a
    q, kv = shape.a * d, shape.g * d
    if s in (h, d, q, kv, shape.a, shape.g, shape.f, d // 2):
        raise ValueError(f"s {s} must differ from the widths (a graph input holding s rows is taken for a token's)")
    widths = {"wqkv": {(h, q + 2 * kv)}, "wo": {(q, h)}, "ffn": {(h, shape.f), (shape.f, h)}}
    redo = [n for n in bw.graph.nodes if n.op == "call_function" and n.meta.get("partitioner_tag") == "is_forward"]
    kinds = {n: _kind(n) for n in redo}
    mms = [n for n in redo if kinds[n] == "mm"]
    flops = 0
    for n in mms:
        (m, k), (_, cols) = n.args[0].meta["val"].shape, n.args[1].meta["val"].shape
        flops += 2 * int(m) * int(k) * int(cols)
    region = {n for n in redo if kinds[n] == "memory"}
    read, written = set(), set()
    for n in region:
        for arg in n.all_input_nodes:
            arg = _base(arg)
            if arg not in region and (arg.op != "placeholder" or s in arg.meta["val"].shape):
                read.add(arg)
        if any(_kind(user) in ("mm", "attention") for user in _consumers_outside(n, region)):
            written.add(n)
    traffic = sum(_bytes(n) for n in read | written)
    return {"linears": sorted(_linear(n, widths) for n in mms), "matmul_flops": flops // (s * b),
            "attention": sum(kinds[n] == "attention" for n in redo), "memory_bytes": traffic // (s * b),
            "memory_ops": len(region)}


def _consumers_outside(node, region: set):
    """The nodes outside ``region`` that read ``node`` (through views)."""
    for user in node.users:
        if _kind(user) == "view" and user.op == "call_function":
            yield from _consumers_outside(user, region)
        elif user not in region:
            yield user


def budget_recompute(h: int, a: int, g: int, f: int, s: int, budgets: tuple[float, ...], b: int = 1) -> dict:
    """``recomputed`` at each budget F for a block of hidden h, heads a, KV heads g, FFN f at sequence length s."""
    from .titan import Shape

    warnings.filterwarnings("ignore")
    shape = Shape(h=h, a=a, g=g, f=f)
    return {budget: recomputed(shape, s, b, budget) for budget in budgets}
