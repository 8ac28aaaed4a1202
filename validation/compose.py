"""Trace a model from a few of its decoder layers: one set per kind of layer, composed back into every layer.

Running a 70B model's whole forward and backward under fake tensors costs ~0.9 s of CPU per decoder layer,
twice (as is and with gradient checkpointing), though most layers are copies of one another.  ``reduce`` sorts
a built model's decoder layers into *kinds* (``layer_kinds``): layers whose modules (class and path), parameter
shapes and dtypes and per-layer settings (every plain attribute of every module, ``attention_type``,
``sliding_window``, ``is_sliding``..., except the layer's own index) are the same, plus the config's per-layer
list entries (``layer_types``).  It keeps, of each kind, the first layer and one in the middle, and the model's
last two (``representatives``: the ends differ in the step's moments: the top layer's gradient comes from the head,
the bottom ones free the checkpoint's tensors they were the last to use; validation/trace.py samples exactly
these) and swaps the
decoder layers' ModuleList for those alone, in their order; the config's per-layer lists and its layer count
are cut to match, and the kept layers' own indices (``layer_idx``) are their new positions, so a model that reads
those lists by position or by ``self.layer_idx`` reads the entry of the layer that runs.  The embedding, the final norm, the head and the loss run once, as in the whole model.

The traced run then speaks of the kept layers by their new positions; ``renumber`` gives them back their
indices in the whole model, and every layer not traced takes the terms of the second traced layer of its kind
(``copies``: its kind's traced middle layer), as the whole trace's moments repeat that layer for the middle of
a kind; a kind's second layer that the model's second-last stands in for (``stand_ins``) has that layer's moments
less the tensors layers above it are the first to be given (validation/trace.py).  Tests compare
the composed inventory with the whole model's, term by term, on dense, alternating-attention and MoE families
(tests/test_trace.py).
"""

from __future__ import annotations

import torch

_INDEX_NAMES = ("layer_idx", "layer_id", "layer_number", "layer_index", "idx")
# config keys of tables packed over all the layers: Gemma 4's per-layer inputs (hidden_size_per_layer_input p, an
# L p-wide embedding and projection reshaped by num_hidden_layers): with one set, the layer count stays the model's,
# so the table and what is saved of it are the whole model's, and the kept layers read their inputs by position
_PACKED = ("hidden_size_per_layer_input",)
_PLAIN = (int, float, str, bool, type(None))


def _plain(value) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def _signature(layer: torch.nn.Module, settings: tuple) -> tuple:
    rows = []
    for name, module in layer.named_modules():
        params = tuple((p, tuple(t.shape), str(t.dtype)) for p, t in module.named_parameters(recurse=False))
        attrs = tuple(sorted((k, repr(v)) for k, v in vars(module).items()
                             if not k.startswith("_") and k not in _INDEX_NAMES and k != "training" and _plain(v)))
        rows.append((name, type(module).__name__, params, attrs))
    return tuple(rows) + settings


def _per_layer_lists(config, n: int) -> list[str]:
    """The config's attributes that hold one entry per decoder layer (``layer_types``)."""
    return [k for k, v in vars(config).items() if isinstance(v, list) and len(v) == n and not k.startswith("_")]


def layer_kinds(model: torch.nn.Module, path: str, n: int) -> list[list[int]]:
    """The decoder layers (of the ModuleList at ``path``, ``n`` of them) by kind, in order of first layer."""
    lists = _per_layer_lists(model.config, n)
    kinds: dict[tuple, list[int]] = {}
    for i, layer in enumerate(model.get_submodule(path)):
        settings = tuple((k, repr(getattr(model.config, k)[i])) for k in lists)
        kinds.setdefault(_signature(layer, settings), []).append(i)
    return list(kinds.values())


def _middles(kinds: list[list[int]]) -> tuple[set[int], dict[int, int]]:
    """The layers traced, and the kinds' second layers that the model's second-last stands for (``stand_ins``)."""
    n = 1 + max((i for layers in kinds for i in layers), default=-1)
    firsts = sorted(layers[0] for layers in kinds)
    kept = set(range(max(n - 2, 0), n))
    stand: dict[int, int] = {}
    for layers in kinds:
        kept.add(layers[0])
        if len(layers) < 2 or layers[1] in kept:
            continue
        if n - 2 not in layers:
            kept.add(layers[1])
        elif any(layers[1] < f < n - 2 for f in firsts):  # another kind starts between the two
            stand[layers[1]] = n - 2
    return kept, stand


def representatives(kinds: list[list[int]]) -> list[int]:
    """The layers traced: of each kind its first layer and one in the middle of the model, and the model's last two.

    A layer's trace differs from its kind's only at the model's ends and with the kinds that start below it:
    the bottom layers (the first of each kind) are the last to use, in the backward, what the layers of their
    kind share (rotary tables of their kind, checkpointed inputs), so those tensors are alive in the backward
    of every layer above that first one and freed below it; the top layer sees the head's gradient.  A layer
    in the middle traces as any other layer of its kind with the same kinds' first layers below it: a kind's
    last layer in the middle of the model (Gemma 3's global layer 23 of 26, DeepSeek-V3's last dense layer 2
    under the MoE ones) as its second layer, and the model's second-last layer as its kind's second one (a
    dense model traces layers 0, n - 2 and n - 1; DeepSeek-V3 0, 1, 3, 59, 60).  Where other kinds start
    between the two (Gemma 3's global layers at 5, between its sliding layers 1 and 24), the second layer's
    moments are the second-last's without the tensors the checkpointed layers are given first by a layer above
    it (``stand_ins``; validation/trace.py): Gemma 3 1B traces 0, 5, 11, 24, 25.  The five full-size traces
    of benchmarks/bench_trace.py are byte-identical to the ones that traced every kind's first two and last
    two layers; tests/test_trace.py compares with the whole model."""
    return sorted(_middles(kinds)[0])


def stand_ins(kinds: list[list[int]]) -> dict[int, int]:
    """A kind's second layer not traced -> the model's second-last layer, whose moments it has less the tensors
    that the checkpointed layers are given first by a layer above it (other kinds' rotary tables)."""
    return _middles(kinds)[1]


def copies(kinds: list[list[int]]) -> dict[int, int]:
    """Each layer not traced -> the traced layer whose terms it has: its kind's first traced middle layer (neither
    the kind's first nor the model's top)."""
    n = 1 + max((i for layers in kinds for i in layers), default=-1)
    kept = set(representatives(kinds))
    out = {}
    for layers in kinds:
        middle = [i for i in layers[1:] if i in kept and i != n - 1]
        out.update({i: middle[0] for i in layers if i not in kept})
    return out


def reduce(model: torch.nn.Module, path: str, n: int) -> tuple[list[int], list[list[int]]]:
    """Keep only the representative decoder layers of ``model`` (in place): returns the kept layers' indices in
    the whole model (position -> index) and the kinds."""
    kinds = layer_kinds(model, path, n)
    kept = representatives(kinds)
    if len(kept) == n:
        return list(range(n)), kinds
    parent, _, attr = path.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    layers = getattr(owner, attr)
    setattr(owner, attr, torch.nn.ModuleList([layers[i] for i in kept]))
    for j, i in enumerate(kept):  # code that reads the config's per-layer lists by self.layer_idx reads the cut ones
        for module in layers[i].modules():
            for name in _INDEX_NAMES:
                if getattr(module, name, None) == i and isinstance(getattr(module, name), int):
                    setattr(module, name, j)
    config = model.config
    for k in _per_layer_lists(config, n):
        setattr(config, k, [getattr(config, k)[i] for i in kept])
    if not any(getattr(config, k, None) for k in _PACKED):
        config.num_hidden_layers = len(kept)
    return kept, kinds


def renumber_module(module: str, path: str, index: list[int]) -> str:
    """A module path of the reduced model with the decoder layer's index in the whole model."""
    prefix = path + "."
    if not module.startswith(prefix):
        return module
    head, _, rest = module[len(prefix):].partition(".")
    if not head.isdigit():
        return module
    return prefix + str(index[int(head)]) + ("." + rest if rest else "")


def renumber(run: dict, path: str, index: list[int]) -> None:
    """A reduced model's traced run (validation/trace_run.py ``symbolic_run``) in the whole model's layer indices:
    the saved storages' modules, the sampled layers' moments, the layers' inputs."""
    for st in run["storages"]:
        st["module"] = renumber_module(st["module"], path, index)
        st["savers"] = {renumber_module(m, path, index): seq for m, seq in st["savers"].items()}
    if "sampler" in run:
        fronts = run["sampler"].fronts
        run["sampler"].fronts = {(k[0], index[k[1]]) if k[0] == "layer" else k: v for k, v in fronts.items()}
        run["args"] = {c: (label, index[i], rec) for c, (label, i, rec) in run["args"].items()}

