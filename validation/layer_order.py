"""A decoder layer's allocations and frees in the real code's order, traced (issue 20 items 1 and 5).

``validation.transients.LiveStorages`` follows every storage an op makes until it is freed; with its ``log`` on
(``validation.trace_run.symbolic_run(step={"order": True})``, ``trace_hf_config(layer_order=True)``) it keeps them in
order, each labelled with the phase and decoder layer it happened in (``validation.step._LayerHooks``) and whether a
checkpointed layer's forward was being re-run in the backward (the layer's forward pre-hook firing in the backward).
The sizes are the fake tensors' symbolic ``nbytes``: polynomials in s and b, with the ``--kernels cuda`` emulation
(``validation.trace_cuda.CudaKernels``) where CUDA's kernels make other tensors than CPU's.

* ``step_order``: the whole traced step (forward, loss, backward) as events (``("+", poly text, label)`` or
  ``("-", allocation index, label)``): what validation/layer_match.py aligns with a CUDA recording.
* ``layer_pieces``: of one decoder layer, its forward, its re-run (gradient checkpointing) and its backward in the
  inventory file's compact form (``compact``): an allocation as its size's polynomial text, a free as the index of
  the layer's allocation it frees (counted over forward, re-run and backward in that order), or, for a tensor made
  outside the layer (its input, the gradient coming from the layer above), "-" and the size's text.

What the trace cannot see, it leaves out: the buffers a kernel allocates inside itself through the caching allocator
(cuBLAS's workspace, cuDNN's attention backward workspace); validation/layer_match.py names them.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

PIECES = ("forward", "rerun", "backward")


def allocation_order(func: Any, outputs: list) -> list:
    """An op's outputs in the order its CUDA kernel allocates them: cuDNN attention makes its Philox seed and offset
    before the output and the log-sum-exp (the H100 recordings, tests/data/alloc/cuda: 8 B, 8 B, then b s h and
    4 b a s bytes); every other op as the fake tensor's outputs come."""
    if func is torch.ops.aten._scaled_dot_product_cudnn_attention.default:
        return outputs[6:8] + outputs[:6] + outputs[8:]
    return outputs


def log_made(live: Any, func: Any, args: tuple, rec: Any) -> None:
    """``rec``, a storage an op made, into ``live.log`` (``LiveStorages``), but an empty one (the caching allocator
    is never asked for 0 bytes) and the sum the autograd engine makes when a gradient gets a second contribution:
    ``InputBuffer::accumulate`` (torch/csrc/autograd/input_buffer.cpp) adds in place into the gradient it holds
    (``old_var.add_(var)``) when it holds the last reference to it and to its storage (``can_accumulate_inplace``: not
    a view, whose base shares the storage; dense) and neither is a tensor subclass, such as the fake tensors of the
    trace: the sum takes over that gradient's log id, whose free then waits for the sum's."""
    n = rec.nbytes
    if not isinstance(n, torch.SymInt) and int(n) == 0:
        return
    if live.between_nodes and live.phase == "backward" and func is torch.ops.aten.add.Tensor:
        old = _taken_over(live, args)
        if old is not None:
            old.stolen = True
            rec.serial = old.serial
            return
    rec.serial = live.made
    live.made += 1
    live.log.append(("+", rec.serial, rec, (live.phase, live.layer, live.rerun)))


def _taken_over(live: Any, args: tuple) -> Any:
    x = args[0]
    if not isinstance(x, torch.Tensor) or x._is_view() or not x.is_contiguous():
        return None
    rec = live.record_of(x)
    return rec if rec is not None and rec.serial >= 0 and not rec.stolen else None


def engine_hooks(loss: torch.Tensor, live: Any) -> list:
    """Hooks on every node of ``loss``'s graph telling ``live`` when the engine's own work runs (``between_nodes``:
    after a node's function and its post hooks, before the next node's pre hooks): where it accumulates gradients."""
    handles, seen, stack = [], set(), [loss.grad_fn]

    def before(*_):
        live.between_nodes = False

    def after(*_):
        live.between_nodes = True

    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        handles += [node.register_prehook(before), node.register_hook(after)]
        stack += [nxt for nxt, _ in node.next_functions]
    return handles


def piece_of(label: tuple, layer: int) -> str | None:
    """Which piece of decoder layer ``layer`` an event labelled ``label`` (phase, layer, rerun) belongs to."""
    phase, where, rerun = label
    if where != layer:
        return None
    if phase == "forward":
        return "forward"
    if phase == "backward":
        return "rerun" if rerun else "backward"
    return None


def step_order(log: list, text: Callable) -> list[tuple]:
    """The traced step's events: ("+", size text, label, what made it) and ("-", index of the allocation freed,
    label); a free of a storage made before the log started is left out (the parameters)."""
    index: dict[int, int] = {}
    out: list[tuple] = []
    for op, serial, rec, label in log:
        if op == "+":
            index[serial] = len(index)
            out.append(("+", text(rec.nbytes), label, rec.what))
        else:
            out.append(("-", index[serial], label))
    return out


def layer_pieces(events: list[tuple], layer: int) -> dict[str, list]:
    """Decoder layer ``layer``'s pieces (``PIECES``, those with events) from ``step_order``'s events, compact:
    allocations as size text, frees as the index of the layer's allocation or "-" + size text."""
    sizes: list[str] = []
    numbered = []  # (piece, event, the step's allocation number of an allocation)
    for e in events:
        numbered.append((piece_of(e[2], layer), e, len(sizes)))
        if e[0] == "+":
            sizes.append(e[1])
    own: dict[int, int] = {}
    out: dict[str, list] = {}
    for name in PIECES:
        for piece, e, n in numbered:
            if piece != name:
                continue
            if e[0] == "+":
                own[n] = len(own)
                out.setdefault(name, []).append(e[1])
            else:
                out.setdefault(name, []).append(own[e[1]] if e[1] in own else "-" + sizes[e[1]])
    return out


def representative(layers: list[int], traced: list[int], num_layers: int) -> int:
    """The layer of a group whose order the file keeps: a traced one neither the model's first nor among its last
    two (whose neighbours are the embedding and the head) where there is one, else the group's first traced."""
    candidates = [i for i in layers if i in traced]
    middle = [i for i in candidates if 0 < i < num_layers - 2]
    return (middle or candidates)[0]


def file_rows(runs: list[dict], groups: list[dict], traced: list[int], num_layers: int, text: Callable,
              steps: dict | None = None) -> list[dict]:
    """The inventory file's ``layer_order``: for each layer group and each of the runs (without gradient
    checkpointing, then with it), one layer's pieces (``layer_pieces``); ``traced``: the whole model's index of each
    traced layer (validation/compose.py), ``text``: a sympy size as the file's polynomial text; ``steps``: a dict
    given each run's ``step_order`` events by recompute."""
    rows = []
    for recompute, run in zip(("none", "full"), runs):
        events = step_order(run["log"], lambda nbytes, polys=run["polys"]: text(polys.expr(nbytes)))
        if steps is not None:
            steps[recompute] = events
        for k, group in enumerate(groups):
            layer = representative(group["layers"], traced, num_layers)
            rows.append({"group": k, "layer": layer, "recompute": recompute,
                         **layer_pieces(events, traced.index(layer))})
    return rows


MATMULS = ("mm", "addmm", "bmm", "matmul", "_scaled_mm")
WORKSPACES = {"forward": "W1", "backward": "W2"}  # in step_order: cuBLAS's workspace of the thread (its first matmul)


def _section(events: list[tuple]) -> list:
    """Each event's place in the file's step order: "before", "middle" or "after" (outside the decoder layers:
    before the first layer's forward; between the last layer's forward and the first backward; after the last
    layer's backward), or (piece, position of the layer in the traced model); an event outside the layers between
    two layers' pieces (the freed input of the layer before, when the model's loop drops it) goes with the piece
    before it."""
    keys = [None if layer is None else ("forward" if phase == "forward" else "rerun" if rerun else "backward", layer)
            for phase, layer, rerun in (e[2] for e in events)]
    inside = [k for k, key in enumerate(keys) if key is not None]
    if not inside:
        raise ValueError("no decoder layer in the traced step")
    forwards = [k for k in inside if keys[k][0] == "forward"]
    backwards = [k for k in inside if keys[k][0] != "forward"]
    out, previous = [], None
    for k, key in enumerate(keys):
        if key is not None:
            previous = key
        elif k < inside[0]:
            key = "before"
        elif k > inside[-1]:
            key = "after"
        elif k < forwards[-1] or (backwards and k > backwards[0]):
            key = previous
        else:
            key = "middle"
        out.append(key)
    return out


def step_row(events: list[tuple], recompute: str, traced: list[int], copies: dict[int, int],
             num_layers: int) -> dict:
    """The whole traced step (``step_order``'s events) in the inventory file's compact form (``step_order``, read
    by memplan/inventory/step_order.py, which joins it into the model's step): the pieces outside the decoder layers
    (``before``, ``middle``, ``after``) once, each traced layer's ``forward``, ``rerun`` and ``backward`` as a
    template (identical ones once), and ``layers``, the template of each of the model's layers (a layer not traced:
    the one whose terms it has, ``copies``). An allocation is its size's polynomial text; a free is the index of an
    allocation of its own piece's owner (a layer's, counted over its three pieces in order; the outside's, over its
    three), or "O:i" (the outside's i-th, freed in a layer), "L-1:i" / "L+1:i" (a neighbour layer's, freed in a
    layer: the traced model's neighbours are the model's), "L@j:i" (layer j's, freed outside); ``WORKSPACES`` after
    the output of the first matmul of the forward and of the backward (where cuBLAS makes each thread's 32 MiB
    workspace: tests/test_layer_order.py ``test_workspaces_as_recorded``)."""
    sections = _section(events)
    owner: list = []  # allocation number -> (owner, index in its owner)
    counts: dict = {}
    pieces: dict = {}
    matmul = {"forward": False, "backward": False}
    for e, key in zip(events, sections):
        who = "out" if isinstance(key, str) else key[1]
        piece = pieces.setdefault(key, [])
        if e[0] == "+":
            owner.append((who, counts.get(who, 0)))
            counts[who] = counts.get(who, 0) + 1
            piece.append(e[1])
            phase = e[2][0]
            if phase in matmul and not matmul[phase] and e[3].rsplit(": ", 1)[-1] in MATMULS:
                matmul[phase] = True
                piece.append(WORKSPACES[phase])
            continue
        target, index = owner[e[1]]
        if target == who:
            piece.append(index)
        elif target == "out":
            piece.append(f"O:{index}")
        elif who == "out":
            piece.append(f"L@{traced[target]}:{index}")
        else:
            piece.append(f"L{target - who:+d}:{index}")
    templates: list[dict] = []
    of_traced = []
    for k in range(len(traced)):
        template = {name: pieces[name, k] for name in PIECES if (name, k) in pieces}
        if template not in templates:
            templates.append(template)
        of_traced.append(templates.index(template))
    layers = [of_traced[traced.index(i if i in traced else copies[i])] for i in range(num_layers)]
    return {"recompute": recompute, "layers": layers, "templates": templates,
            **{name: pieces.get(name, []) for name in ("before", "middle", "after")}}
