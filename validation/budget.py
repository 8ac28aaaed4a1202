"""torchtitan's memory-budget AC (``MemoryBudgetAC``: ``torch._functorch.config.activation_memory_budget = F``, the
blocks compiled): what AOTAutograd's partitioner saves for the backward of torchtitan 0.3.0's Llama 3 block at a
budget F, at a model's real widths and sequence length.

The partitioner decides by a knapsack over the tensors it could recompute: each candidate's bytes against its
recompute cost (``activation_memory_budget_runtime_estimator = "flops"``, a count of FLOPs, no device timing), so
the saved set depends on the widths, s and F (not on b: every size and every matmul's FLOPs scale with it), and a
tiny block's answer does not carry over to a large one. ``budget_saved`` therefore compiles the real-size block
under ``FakeTensorMode`` (no memory, no compute: the partitioner reads fake shapes) with AOTAutograd and inductor's
partitioner and decompositions (validation/compiled.py ``_aot_backend``) and reads the forward graph's saved
outputs. At F = 1 the partitioner saves what the plain compiled block saves, memplan's ``compiled.TITAN_LAYER`` in
its order (checked: the same bytes per token, row by row); every other F is named by those rows (the graph is the
same joint graph, its nodes named alike), so the answer is a subset of the table's ids. At F = 0 only the block
input is saved. Nothing here is a formula: the knapsack is torch's own.
"""

from __future__ import annotations

import warnings

import torch


def _saved_nodes(shape, s: int, b: int, budget: float) -> list[tuple[str, int]]:
    """(node name, bytes per token) of the forward graph's saved tensors that hold tokens, in order (the block's
    input first; parameters and the RoPE buffer apart)."""
    import torch._functorch.config as fconfig
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .compiled import _aot_backend, _base
    from .titan import build_block, loader_positions

    graphs: list = []
    torch._dynamo.reset()
    with fconfig.patch(activation_memory_budget=budget, enable_autograd_cache=False), FakeTensorMode():
        block = build_block(shape, "none", max_seq_len=s).train()
        x = torch.randn(b, s, shape.h, dtype=torch.bfloat16, requires_grad=True)
        pos = loader_positions(b, s)  # as torchtitan's Trainer calls every block (a batch input: not counted)
        torch.compile(block, backend=_aot_backend(lambda gm, _: graphs.append(gm)), dynamic=False)(x, None, pos)
    if len(graphs) != 1:
        raise RuntimeError(f"expected one forward graph, got {len(graphs)}")
    out, seen = [], set()
    for node in graphs[0].graph.find_nodes(op="output")[0].args[0][1:]:
        node = _base(node)
        val = node.meta.get("val")
        if node in seen or not isinstance(val, torch.Tensor):
            continue
        seen.add(node)
        if node.op == "placeholder" and tuple(val.shape) != (b, s, shape.h):
            continue  # a parameter, the RoPE buffer or the positions
        out.append((node.name, val.numel() * val.element_size() // (s * b)))
    return out


def budget_saved(h: int, a: int, g: int, f: int, s: int, budgets: tuple[float, ...], table: tuple, b: int = 1) -> dict:
    """For each budget F, the ids of ``table``'s rows (memplan's ``compiled.TITAN_LAYER``: id, what, block, elements,
    dtype) the partitioner saves (``saved``) and their bytes per token (``per_token``), for a block of hidden h,
    heads a, KV heads g, FFN f at sequence length s."""
    from .titan import Shape

    warnings.filterwarnings("ignore")
    shape = Shape(h=h, a=a, g=g, f=f)
    full = _saved_nodes(shape, s, b, 1.0)
    d = h // a
    width = {"s b h": h, "s b": 1, "s b q": a * d, "s b g q /a": g * d, "s b a": a, "s b f": f, "s b q /a": d}
    want = [(row[0], width[row[3]] * (4 if row[4] == "fp32" else 2)) for row in table]
    if [n for _, n in full] != [n for _, n in want]:
        raise RuntimeError(f"the compiled block's saved tensors at budget 1 are not the table's: {full}")
    ids = {node: row for (node, _), (row, _) in zip(full, want)}
    out = {}
    for budget in budgets:
        nodes = _saved_nodes(shape, s, b, budget)
        unknown = [n for n, _ in nodes if n not in ids]
        if unknown:
            raise RuntimeError(f"budget {budget}: saved tensors outside TITAN_LAYER: {unknown}")
        out[budget] = {"saved": [ids[n] for n, _ in nodes], "per_token": sum(n for _, n in nodes)}
    return out
