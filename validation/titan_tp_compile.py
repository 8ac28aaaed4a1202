"""torchtitan 0.3.0's Llama 3 block with tensor parallelism AND torch.compile: what each rank's compiled block saves.

``compiled_tp_rank`` runs torchtitan's own ``parallelize_llama`` (validation/titan.py ``tp_model``: its sharding
configs with sequence parallelism, the ``partial_dtensor`` backend (DTensor TP), FSDP2 over a size-1 mesh, then its
``apply_compile`` on each block: ``block.compile(backend=..., fullgraph=True)``, the order torchtitan applies them:
TP, AC, compile, FSDP). The backend is AOTAutograd with inductor's partitioner and decompositions
(validation/compiled.py ``_aot_backend``, registered under a name because torchtitan's CompileConfig takes one), its
graphs run by torch: the saved set is the partitioner's, as under inductor (tests/test_compile.py checks the two
routes agree on the unsharded block), without a C++ compile per rank. AOTAutograd unwraps the DTensors, so the
forward graph runs on each rank's local tensors and its outputs after the block's are what it saves, local shapes.

Two readings per rank, which must agree: ``graph`` (each saved output of layer 0's forward graph: its node's
storage, dtype and bytes, views of one storage once, parameters apart) and ``saved`` (the storages the compiled
block hands to autograd, read by a saved-tensors hook around layer 0's forward in the real run, parameters apart).
The model is called with the dataloader's positions, as torchtitan's Trainer calls it (validation/titan.py
``loader_positions``; a batch input, left out of both readings). The backward then runs once (the compiled block
works under TP).  sdpa stands in for FlexAttention as everywhere in
validation/titan.py.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .compiled import _aot_backend, _base
from .titan import Shape, loader_positions, local_tensor, tp_model

BACKEND = "memplan_aot_partitioner"


def compiled_tp_rank(rank: int, world: int, shape: Shape, layers: int, vocab: int, s: int, b: int,
                     ac: str = "none", route: str = "aot", float8: str | None = None) -> dict:
    """One rank: ``graph`` (node, dtype, bytes) and ``saved`` ((dtype, bytes)), layer 0's, parameters apart;
    ``input_bytes`` the block input's local bytes; ``graphs`` the forward graphs compiled."""
    import warnings

    from torch._dynamo import register_backend
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed import utils as dist_utils

    warnings.filterwarnings("ignore")
    graphs: list = []
    register_backend(name=BACKEND)(_backend(route, graphs))
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        model, dims = tp_model(world, shape, layers, vocab, ac, compile_backend=BACKEND, float8=float8)
        block = model.layers["0"]
        found: dict = {}
        out: dict = {}

        def pack(t):
            # the parameters as the block holds them now (FSDP2's unsharded bf16 copies inside its forward)
            # and the positions (a batch input the training loop holds: memplan's held ``positions``)
            params = {StorageWeakRef(local_tensor(p).untyped_storage()) for p in (*block.parameters(), *block.buffers())}
            params.add(StorageWeakRef(positions.untyped_storage()))
            st = local_tensor(t).untyped_storage()
            if StorageWeakRef(st) not in params:
                found.setdefault(StorageWeakRef(st), (str(t.dtype).removeprefix("torch."), st.nbytes()))
            return t

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

        class Around(torch.nn.Module):
            """Layer 0 called inside the hook (a module hook on a compiled block would be traced by dynamo)."""

            def __init__(self) -> None:
                super().__init__()
                self.block = block

            def forward(self, x, *args):
                out["input_bytes"] = local_tensor(x).untyped_storage().nbytes()
                with hooks:
                    return self.block(x, *args)

        model.layers["0"] = Around()
        tokens = torch.randint(0, vocab, (b, s))
        positions = loader_positions(b, s)  # as torchtitan's Trainer passes them (a model kwarg; whole under TP)
        with dist_utils.get_spmd_context(parallel_dims=dims)():
            logits = model(tokens, positions=positions)
            cross_entropy_loss(logits, tokens.clone(), global_vocab_size=vocab).backward()
    if not graphs:
        raise RuntimeError("the compile backend was not called")
    gm = graphs[0]
    rows, seen = [], set()
    for node in gm.graph.find_nodes(op="output")[0].args[0][1:]:  # the block's output first
        node = _base(node)
        val = node.meta.get("val")
        if node in seen or not isinstance(val, torch.Tensor):
            continue
        seen.add(node)
        if node.op == "placeholder" and val.dim() < 3:
            continue  # a parameter, a buffer or the positions (the block input is the graph's one 3-d input)
        rows.append((node.name, str(val.dtype).removeprefix("torch."), val.numel() * val.element_size()))
    return {"graph": rows, "saved": list(found.values()), "input_bytes": out["input_bytes"],
            "graphs": len(graphs)}


def _backend(route: str, graphs: list):
    """"aot": AOTAutograd with inductor's partitioner, graphs run by torch; "inductor": torch.compile's default
    backend with an inner_compile that notes each forward graph (validation/compiled.py)."""
    if route == "aot":
        return _aot_backend(lambda gm, example_inputs: graphs.append(gm))
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner(gm, example_inputs, **kw):
        if not kw.get("is_backward"):
            graphs.append(gm)
        return compile_fx_inner(gm, example_inputs, **kw)
    return lambda gm, ex: compile_fx(gm, ex, inner_compile=inner)


def measure_compiled_tp(shape: Shape, layers: int, vocab: int, world: int = 2, s: int = 16, b: int = 2,
                        ac: str = "none", route: str = "aot", float8: str | None = None) -> list[dict]:
    """``compiled_tp_rank`` on ``world`` spawned ranks over gloo (TP degree ``world``; ``float8``: the blocks' linears
    torchao's Float8Linear, validation/titan.py ``build_model``)."""
    from .ranks import run_ranks
    return run_ranks(compiled_tp_rank, world, (shape, layers, vocab, s, b, ac, route, float8))


if __name__ == "__main__":
    import sys

    ac = sys.argv[1] if sys.argv[1:] else "none"
    route = sys.argv[2] if sys.argv[2:] else "aot"
    float8 = sys.argv[3] if sys.argv[3:] else None
    for r in measure_compiled_tp(Shape(h=64, a=4, g=2, f=160), layers=2, vocab=256, s=16, b=2, ac=ac, route=route,
                                 float8=float8):
        print(r)
