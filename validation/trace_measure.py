"""Measurement with real tensors, the check of a trace: what a real model saves for backward at (s, b)
(``measure_hf_config``, ``saves_at``: labelled as a trace is) and the same figures from an inventory file's
polynomials (``predicted_bytes``)."""

from __future__ import annotations

import re
from pathlib import Path

from . import hf as _hf  # noqa: F401  (sets HF_HUB_OFFLINE before transformers is imported)

import sympy  # noqa: E402
import torch  # noqa: E402
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402

from .measure import Ledger, _ModuleStack, _OpRecorder  # noqa: E402
from .trace_config import build_model, decoder_layers_path, load_config, num_hidden_layers  # noqa: E402
from .trace_inventory import inventory_from_saves  # noqa: E402
from .trace_poly import evaluate  # noqa: E402
from .trace_saves import Saves, forward_loss  # noqa: E402



def measure_hf_config(config: dict | str | Path, s: int, b: int, impl: str = "hf-sdpa", dtype: str = "bfloat16",
                      seed: int = 0, device: str = "cpu") -> dict:
    """What the real model (real tensors on ``device``, random weights) saves for backward at (s, b), in bytes:
    ``layers[i]`` every storage layer i's modules saved (shared ones included), ``outside`` the
    storages saved outside the layers only, ``shared`` the storages saved by more than one layer
    (once), ``total`` every saved non-parameter storage once.  Read off tensors with
    ``validation.measure.Ledger``; nothing here knows the trace."""
    cfg = load_config(config)
    torch.manual_seed(seed)
    model = build_model(cfg, impl, dtype).to(device)
    num_layers = num_hidden_layers(model)
    layer_re = re.compile(rf"^{re.escape(decoder_layers_path(model, num_layers))}\.(\d+)(?:\.|$)")
    modules = _ModuleStack(model, "")
    ops = _OpRecorder()
    ledger = Ledger(list(model.parameters()) + list(model.buffers()), ops, modules)
    savers: dict[StorageWeakRef, set] = {}

    def pack(t):
        key = StorageWeakRef(t.untyped_storage())
        m = layer_re.match(modules.current.lstrip("."))
        savers.setdefault(key, set()).add(int(m.group(1)) if m else None)
        return ledger.pack(t)

    vocab = int(model.config.vocab_size)
    ids = torch.randint(0, vocab, (b, s), device=device)
    targets = torch.randint(0, vocab, (b, s), device=device)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, ledger.unpack), ops:
            loss = forward_loss(model, ids, targets)
    finally:
        modules.close()
    out = {"layers": [0] * num_layers, "outside": 0, "shared": 0, "total": 0}
    for key, r in ledger.records.items():
        if r.is_param:
            continue
        where = savers[key]
        out["total"] += r.nbytes
        for i in where - {None}:
            out["layers"][i] += r.nbytes
        if where == {None}:
            out["outside"] += r.nbytes
        if len(where) > 1:
            out["shared"] += r.nbytes
    del loss
    return out


def saves_at(config: dict | str | Path, s: int, b: int, impl: str = "hf-sdpa", dtype: str = "bfloat16",
             seed: int = 0) -> dict:
    """The inventory of one real CPU run at (s, b), labelled as a trace is (same ids; every size a
    number): to compare a trace with reality term by term."""
    cfg = load_config(config)
    torch.manual_seed(seed)
    model = build_model(cfg, impl, dtype)
    num_layers = num_hidden_layers(model)
    saves = Saves(model)
    vocab = int(model.config.vocab_size)
    ids, targets = torch.randint(0, vocab, (b, s)), torch.randint(0, vocab, (b, s))
    with saves.recording():
        loss = forward_loss(model, ids, targets)
    storages = saves.storages()
    del loss
    for st in storages:
        st["nbytes"] = sympy.Integer(int(st["nbytes"]))
    return inventory_from_saves(storages, decoder_layers_path(model, num_layers), num_layers)


def predicted_bytes(inventory: dict, s: int, b: int) -> dict:
    """The same figures as ``measure_hf_config`` from an inventory file's polynomials."""
    layers = [0] * inventory["num_layers"]
    shared: dict[str, int] = {}
    total = 0
    for g in inventory["layer_groups"]:
        per = sum(evaluate(t["bytes"], s, b) for t in g["terms"])
        own = sum(evaluate(t["bytes"], s, b) for t in g["terms"] if not t["shared"])
        for i in g["layers"]:
            layers[i] = per
        total += own * len(g["layers"])
        for t in g["terms"]:
            if t["shared"]:
                shared[t["id"]] = evaluate(t["bytes"], s, b)
    outside = sum(evaluate(t["bytes"], s, b) for t in inventory["outside"] if not t["shared"])
    for t in inventory["outside"]:
        if t["shared"]:
            shared[t["id"]] = evaluate(t["bytes"], s, b)
    total += outside + sum(shared.values())
    return {"layers": layers, "outside": outside, "shared": sum(shared.values()), "total": total}
