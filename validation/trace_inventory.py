"""A traced run's saved storages as the inventory file's body (``inventory_from_saves``: decoder-layer groups and the
outside, each storage a term with a stable id), and its ``checkpoint`` and ``moments`` sections from the plain and the
checkpointed runs (``moments_sections``, validation/transients.py)."""

from __future__ import annotations

import json
import re
from collections import Counter

import sympy
import torch

from .trace_poly import poly_text
from .trace_saves import short_op

def _term_id(module: str, op: str, k: int, j: int) -> str:
    head = ".".join(p for p in (module, short_op(op)) if p)
    return f"{head}{f'#{k}' if k else ''}.{j}"


def inventory_from_saves(storages: list[dict], layers_path: str, num_layers: int, ids: dict | None = None,
                         copies: dict[int, int] | None = None) -> dict:
    """Group saved storages into decoder-layer groups and the outside (the file's body); ``ids``, when
    given, receives each storage's term id by its ``key``; ``copies``: layers not traced -> the traced
    layer whose terms they have (validation/compose.py)."""
    layer_re = re.compile(rf"^{re.escape(layers_path)}\.(\d+)(?:\.(.*))?$")

    def place(module: str) -> tuple[int | None, str]:
        m = layer_re.match(module)
        return (int(m.group(1)), m.group(2) or "") if m else (None, module)

    # (sequence number of the place's first save of the storage, term) per place: a storage
    # shared by the layers sits where each layer saved it
    per_layer: list[list[tuple[int, dict]]] = [[] for _ in range(num_layers)]
    outside: list[tuple[int, dict]] = []
    shared_ids: set[str] = set()
    for st in storages:
        layer, rel = place(st["module"])
        places: dict[int | None, int] = {}
        for module, seq in st["savers"].items():
            p = place(module)[0]
            places[p] = min(places.get(p, seq), seq)
        itemsize = torch.empty((), dtype=st["dtype"]).element_size()
        elements = sympy.expand(st["nbytes"] / itemsize)
        term_id = _term_id(rel, st["op"], st["k"], st["j"])
        if len(places) > 1:
            # a shared storage is one storage for the whole file: its id is unique in the file (Gemma 3's
            # local and global rope tables are saved by the same op of different layers)
            if term_id in shared_ids:
                term_id = f"{term_id}@{layer if layer is not None else 'model'}"
            shared_ids.add(term_id)
        if ids is not None and "key" in st:
            ids[st["key"]] = term_id
        term = {
            "id": term_id,
            "module": rel,
            "op": st["op"],
            "dtype": str(st["dtype"]).replace("torch.", ""),
            "elements": poly_text(elements),
            "bytes": poly_text(st["nbytes"]),
            "shared": len(places) > 1,
        }
        for p, seq in places.items():
            (outside if p is None else per_layer[p]).append((seq, dict(term)))
    groups: list[dict] = []
    index: dict[str, int] = {}
    for i in range(num_layers):
        terms = [t for _, t in sorted(per_layer[(copies or {}).get(i, i)], key=lambda x: x[0])]
        ids = [t["id"] for t in terms]
        dup = [x for x, n in Counter(ids).items() if n > 1]
        if dup:
            raise RuntimeError(f"layer {i}: term ids not unique: {dup}")
        key = json.dumps(terms, sort_keys=True)
        if key not in index:
            index[key] = len(groups)
            groups.append({"layers": [], "terms": terms})
        groups[index[key]]["layers"].append(i)
    return {"num_layers": num_layers, "layer_groups": groups,
            "outside": [t for _, t in sorted(outside, key=lambda x: x[0])]}



def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def moments_sections(runs: list[dict], body: dict, ids: dict, path: str, num_layers: int,
                      copies: dict[int, int], stand_ins: dict[int, int]) -> dict:
    """The file's ``checkpoint`` and ``moments`` from the plain run and the checkpointed one; ``stand_ins``
    (validation/compose.py): a layer not traced -> the traced layer whose moments it has, less the kept tensors
    that layers above it are the first to be given."""
    from . import transients

    plain, ckpt = runs
    ckpt_ids: dict = {}
    inventory_from_saves(ckpt["storages"], path, num_layers, ckpt_ids, copies)
    polys = ckpt["polys"]

    def sized(rec, **fields) -> dict:
        e = polys.expr(rec.nbytes)
        return {**fields, "dtype": str(rec.dtype).replace("torch.", ""),
                "elements": poly_text(sympy.expand(e / _itemsize(rec.dtype))), "bytes": poly_text(e)}

    # a tensor every checkpointed layer is given is counted already when the run without checkpointing saves it
    # (a storage several layers save: the rotary tables), matched by argument and first layer
    plain_args = {(label, i): rec for label, i, rec in plain["args"].values()}
    kept = []
    for rec in ckpt["kept"]["extras"]:
        label, i, _ = ckpt["args"][rec.cdata]
        twin = plain_args.get((label, i))
        saved_as = ids.get(twin.key) if twin is not None and twin.bucket == ("shared",) else None
        kept.append(sized(rec, arg=label, layer=i, saved_as=saved_as))
    kept_index = {rec.cdata: k for k, rec in enumerate(ckpt["kept"]["extras"])}
    checkpoint = {"layer_input": sized(ckpt["kept"]["inputs"][0]) if ckpt["kept"]["inputs"] else None, "kept": kept}
    moments = []
    for run, run_ids, recompute in ((plain, ids, "none"), (ckpt, ckpt_ids, "full")):
        fronts = run["sampler"].fronts
        if recompute == "none" and ("last",) in fronts:
            moments += transients.entries(fronts[("last",)], run_ids, run["polys"], poly_text, _itemsize, scope="last")
        for k, group in enumerate(body["layer_groups"]):
            # each sampled layer's own candidates (the ends of a group differ: the top layer's gradient comes
            # from the head, the bottom ones free the checkpoint's tensors they were the last to use); a layer
            # not sampled repeats the second and the second-last sampled ones
            source = {i: i for i in group["layers"] if ("layer", i) in fronts}
            source.update({j: i for j, i in stand_ins.items() if i in source and j in group["layers"]})
            sampled = sorted(source)
            if not sampled:
                continue
            middle = {sampled[1], sampled[-2]} if len(sampled) >= 2 else {sampled[0]}
            rows: dict[str, tuple[dict, set]] = {}
            for i in sampled:
                where = {i} | ({j for j in group["layers"] if j not in sampled} if i in middle else set())
                for row in transients.entries(fronts[("layer", source[i])], run_ids, run["polys"], poly_text,
                                              _itemsize, kept_index if recompute == "full" else None, scope="layer",
                                              group=k, recompute=recompute):
                    if source[i] != i and "kept" in row:  # freed by then: what a layer above i is given first
                        row["kept"] = [x for x in row["kept"] if kept[x]["layer"] <= i]
                    key = json.dumps(row, sort_keys=True)
                    rows.setdefault(key, (row, set()))[1].update(where)
            for row, where in rows.values():
                moments.append({**row, "layers": sorted(where)})
    return {"checkpoint": checkpoint, "moments": moments}
