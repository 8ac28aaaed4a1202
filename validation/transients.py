"""The transient tensors of a training step, traced: live storages after every op, symbolic in s and b.

``validation/trace.py`` records what autograd *saves*; the peak of a step also holds tensors nobody
saves: the gradients flowing through the backward, a kernel's fp32 copies, the recomputed forward
of a checkpointed layer.  ``LiveStorages`` is a ``TorchDispatchMode`` that follows every storage an
op creates until it is freed (weakref callbacks on the storage, as ``validation.instruments.LiveTracker``
and torch's ``mem_tracker`` do), with its size as the sympy expression of the fake tensor's
``nbytes`` (a polynomial in s and b).  It never compares sizes (that would guard on s and b).

The trace runs forward, loss and ``loss.backward()`` under the fake mode and labels each op with its
phase and decoder layer (``validation.step._LayerHooks``: forward hooks, and tensor hooks on every
layer's output for the backward).  After each op of the loss phase, of the head's backward (loss,
LM head, final norm) and of a decoder layer's backward it sorts the live storages as the step
timeline (memplan/memory/timeline.py) counts them:

* counted elsewhere: what the layers below still keep (their saves; with gradient checkpointing
  their inputs and the tensors every checkpointed layer is given: rotary tables, masks, position
  ids), storages several layers save (memplan's chunk terms), gradients of other layers and of the
  head (the timeline adds them by parameter group);
* the layer's (or the head's) own saves still alive, by id (the others are freed by now);
* the saves outside the layers still alive, by id (memplan counts the embedding's, and adds the
  head's);
* the gradients of the layer's (head's) own parameters made so far (elements);
* everything else alive: the transients, each with its size, dtype and the op that made it (and,
  unexpectedly alive, a save of a layer above).

Each op gives one candidate moment.  Most are dominated: a candidate whose bytes, per dtype, and
gradient count are at most another's for every s, b >= 2 (coefficients of p(2 + x, 2 + y), a
sufficient test) can never be the peak, so only the non-dominated ones are kept (a Pareto front per
layer; `memplan` takes the maximum over them, as over its hand-written moments).
"""

from __future__ import annotations

import re
import threading
import weakref
from fractions import Fraction
from functools import partial
from math import comb
from typing import Any, Callable

import sympy
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from . import layer_order as order

SYMBOLS = ("s", "b")
LOW = 2  # the traces hold for s, b >= 2


def storage(t: torch.Tensor):
    """``t``'s storage; a DTensor's the local tensor's (its wrapper has none of its own: validation/titan_tp_moments.py)."""
    return getattr(t, "_local_tensor", t).untyped_storage()


class _Rec:
    """One live storage: size (sympy, bytes), dtype, who made it, and where it is counted."""

    __slots__ = ("cdata", "nbytes", "dtype", "what", "bucket", "key", "param", "numel", "size_key", "serial", "stolen",
                 "__weakref__")

    def __init__(self, cdata: int, nbytes: Any, dtype: torch.dtype, what: str) -> None:
        self.cdata, self.nbytes, self.dtype, self.what = cdata, nbytes, dtype, what
        self.bucket: tuple = ("other",)
        self.key = None  # the StorageWeakRef its saves are recorded under
        self.param = ""  # a gradient: the parameter's name
        self.numel = 0
        self.size_key = None  # Polys.key: the sympy expression of nbytes
        self.serial, self.stolen = -1, False  # the log's id (validation/layer_order.py); taken over by an accumulation


class LiveStorages(TorchDispatchMode):
    """Every storage first seen as an op output, until freed; samples after every op (``sampler``).

    Buckets: ("other",) transients; ("saved", place) saved by one place (a decoder layer index or
    None: outside the layers); ("shared",) saved by several places; ("grad", place) a parameter's
    .grad; ("input", i) decoder layer i's input kept by gradient checkpointing; ("extra",) another
    tensor given to every checkpointed layer (rotary tables, mask, position ids)."""

    def __init__(self, named: dict, layers_path: str, num_layers: int) -> None:
        super().__init__()
        self.named = named  # torch symbol -> sympy Symbol "s" / "b"
        self.layer_re = re.compile(rf"^{re.escape(layers_path)}\.(\d+)(?:\.(.*))?$")
        self.num_layers = num_layers
        self.lock = threading.Lock()
        self.records: dict[int, _Rec] = {}
        self.buckets: dict[tuple, dict[int, _Rec]] = {}
        self.external: dict[int, weakref.ref] = {}
        self.refs: dict[int, weakref.ref] = {}
        self.phase, self.layer, self.microbatch = "forward", None, 0
        self.rerun = False  # a checkpointed layer's forward re-run in the backward (validation/trace_run.py's hooks)
        # the allocations and frees in order, when a list (validation/layer_order.py): ("+", cdata, record, label)
        # and ("-", cdata, None, label), label = (phase, layer, rerun) when the event happened
        self.log: list | None = None
        self.made = 0  # storages logged
        self.between_nodes = False  # the autograd engine's own work: after a node's function, before the next's
        self.layers_started = False
        self.module: Callable[[], str] = lambda: ""
        self.sampler: Callable[[str], None] | None = None
        self.op = ""
        self.before: Callable[[Any], None] | None = None  # told of every op first (an _AtenLog's note: one mode)

    # labels (validation.step._LayerHooks calls set)
    def set(self, **label) -> None:
        for k, v in label.items():
            setattr(self, k, v)

    def place(self, module: str) -> tuple[int | None, str]:
        m = self.layer_re.match(module.lstrip("."))
        return (int(m.group(1)), m.group(2) or "") if m else (None, module.lstrip("."))

    def move(self, rec: _Rec, bucket: tuple) -> None:
        with self.lock:
            self.buckets.get(rec.bucket, {}).pop(rec.cdata, None)
            rec.bucket = bucket
            self.buckets.setdefault(bucket, {})[rec.cdata] = rec

    def record_of(self, t: torch.Tensor) -> _Rec | None:
        return self.records.get(storage(t)._cdata)

    def _free(self, cdata: int, _ref) -> None:
        with self.lock:
            rec = self.records.pop(cdata, None)
            self.refs.pop(cdata, None)
            if rec is not None:
                self.buckets.get(rec.bucket, {}).pop(cdata, None)
                if self.log is not None and rec.serial >= 0 and not rec.stolen:
                    self.log.append(("-", rec.serial, None, (self.phase, self.layer, self.rerun)))

    def _forget_external(self, cdata: int, _ref) -> None:
        self.external.pop(cdata, None)

    def _what(self) -> str:
        if self.phase == "backward":
            node = torch._C._current_autograd_node()
            where = node.name() if node is not None else "backward"
        else:
            where = self.place(self.module())[1] or "model"
        return f"{where}: {self.op}"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.before is not None:
            self.before(func)
        kwargs = kwargs or {}
        for x in pytree.tree_leaves((args, kwargs)):
            if isinstance(x, torch.Tensor):
                st = storage(x)
                if st._cdata not in self.records and st._cdata not in self.external:
                    self.external[st._cdata] = weakref.ref(st, partial(self._forget_external, st._cdata))
        out = func(*args, **kwargs)
        if func.namespace == "prim":
            return out
        self.op = str(func.overloadpacket).replace("aten.", "")
        leaves = pytree.tree_leaves(out)
        for x in leaves if self.log is None else order.allocation_order(func, leaves):
            if isinstance(x, torch.Tensor):
                st = storage(x)
                cdata = st._cdata
                if cdata in self.external or cdata in self.records:
                    continue
                rec = _Rec(cdata, st.nbytes(), x.dtype, self._what())
                with self.lock:
                    self.records[cdata] = rec
                    self.refs[cdata] = weakref.ref(st, partial(self._free, cdata))
                    self.buckets.setdefault(rec.bucket, {})[cdata] = rec
                if self.log is not None:
                    order.log_made(self, func, args, rec)
        if self.sampler is not None:
            self.sampler(self.op)
        return out

    # what the step's code tells the tracker
    def saved(self, t: torch.Tensor, module: str, key) -> None:
        """A pack hook saw ``t`` saved by ``module``."""
        rec = self.record_of(t)
        if rec is None:
            return
        place = self.place(module)[0]
        rec.key = key
        if rec.bucket == ("other",):
            self.move(rec, ("saved", place))
        elif rec.bucket[0] == "saved" and rec.bucket[1] != place:
            self.move(rec, ("shared",))

    def grad_made(self, p: torch.Tensor, name: str) -> None:
        """A post-accumulate-grad hook: ``p.grad`` is now a gradient of parameter ``name``."""
        if p.grad is None:
            return
        rec = self.record_of(p.grad)
        if rec is None:
            return
        rec.param, rec.numel = name, int(p.numel())
        self.move(rec, ("grad", self.place(name.rsplit(".", 1)[0])[0]))

    def layer_inputs(self, i: int, args, kwargs, checkpointed: bool) -> dict[str, Any]:
        """A decoder layer's forward inputs: the hidden states (first tensor) and the other tensors
        by argument name; with gradient checkpointing they are kept (buckets "input" / "extra")."""
        found: dict[str, Any] = {}
        leaves = pytree.tree_flatten_with_path((args, kwargs))[0]
        first = True
        for path, x in leaves:
            if not isinstance(x, torch.Tensor):
                continue
            rec = self.record_of(x)
            label = "hidden_states" if first else pytree.keystr(path)
            first = False
            found[label] = rec
            if rec is None or not checkpointed:
                continue
            if label == "hidden_states" and rec.bucket == ("other",):
                self.move(rec, ("input", i))
            elif label != "hidden_states" and rec.bucket in (("other",), ("shared",)):
                self.move(rec, ("extra",))
        return found


# ---------------------------------------------------------------------------------------------
# polynomials


class Polys:
    """Sizes as {(dtype, i, j): coefficient of x^i y^j} with s = 2 + x, b = 2 + y (bytes), cached
    per expression, and {(i, j): coefficient of s^i b^j} for the file."""

    def __init__(self, named: dict, conditions: list[str], exact_divisions: Callable) -> None:
        self.named, self.conditions, self.exact = named, conditions, exact_divisions
        s, b = sympy.Symbol("s", integer=True, positive=True), sympy.Symbol("b", integer=True, positive=True)
        self.s, self.b = s, b
        self._plain: dict[Any, dict] = {}
        self._shift: dict[Any, dict] = {}
        self.texts: dict[tuple, tuple[str, str]] = {}  # entries: (size, dtype) -> (elements, bytes) as text

    def expr(self, nbytes: Any) -> sympy.Expr:
        if isinstance(nbytes, torch.SymInt):
            e = nbytes.node.expr
        else:
            e = nbytes if isinstance(nbytes, sympy.Expr) else sympy.Integer(int(nbytes))
        e = sympy.expand(self.exact(e.xreplace(self.named), self.conditions))
        return e.xreplace({x: (self.s if str(x) == "s" else self.b) for x in e.free_symbols})

    def plain(self, nbytes: Any) -> dict[tuple[int, int], Fraction]:
        hit = self._plain.get(nbytes if not isinstance(nbytes, torch.SymInt) else nbytes.node.expr)
        if hit is not None:
            return hit
        e = self.expr(nbytes)
        extra = {str(x) for x in e.free_symbols} - set(SYMBOLS)
        if extra:
            raise ValueError(f"a live tensor's size depends on data (symbols {sorted(extra)}): {e}")
        poly = sympy.Poly(e, self.s, self.b)
        out = {m: Fraction(int(c.p), int(c.q)) for m, c in poly.terms()}
        self._plain[nbytes if not isinstance(nbytes, torch.SymInt) else nbytes.node.expr] = out
        return out

    def shifted(self, nbytes: Any) -> dict[tuple[int, int], Fraction]:
        key = nbytes if not isinstance(nbytes, torch.SymInt) else nbytes.node.expr
        hit = self._shift.get(key)
        if hit is not None:
            return hit
        out: dict[tuple[int, int], Fraction] = {}
        for (p, q), c in self.plain(nbytes).items():
            for i in range(p + 1):
                for j in range(q + 1):
                    out[i, j] = out.get((i, j), 0) + c * comb(p, i) * LOW ** (p - i) * comb(q, j) * LOW ** (q - j)
        # integral coefficients as ints (the sums over live storages then stay in fast int arithmetic)
        out = {m: int(c) if c.denominator == 1 else c for m, c in out.items()}
        self._shift[key] = out
        return out

    def key(self, rec: "_Rec") -> Any:
        """The cache key of a live storage's size (its sympy expression), kept on the record."""
        if rec.size_key is None:
            rec.size_key = rec.nbytes.node.expr if isinstance(rec.nbytes, torch.SymInt) else rec.nbytes
        return rec.size_key

    def summed(self, recs) -> dict[tuple, Fraction]:
        """The shifted coefficients of the bytes of ``recs``, by (activation dtype or other, i, j): the
        records counted by size first, so each distinct size is expanded once."""
        counts: dict[tuple, int] = {}
        for rec in recs:
            k = ("act" if rec.dtype in ACT else "other", self.key(rec))
            counts[k] = counts.get(k, 0) + 1
        vector: dict[tuple, Fraction] = {}
        for (d, key), n in counts.items():
            for m, c in self.shifted(key).items():
                vector[(d, *m)] = vector.get((d, *m), 0) + n * c
        return vector


ACT = (torch.bfloat16, torch.float16)


def dominates(a: dict, b: dict) -> bool:
    """a >= b for every s, b >= 2 (a sufficient test on the shifted coefficients), whatever the
    activations' element size (2 or 4 bytes: the trace's bf16 bytes counted once or twice) and whether
    the layer's gradients count (torch .grad made in this step, up to 4 bytes each) or not (gradient
    accumulation, where every gradient exists already)."""
    keys = {k[1:] for k in a.keys() | b.keys() if k[0] != "grad"} | {(0, 0)}
    for k in keys:
        act = a.get(("act", *k), 0) - b.get(("act", *k), 0)
        other = a.get(("other", *k), 0) - b.get(("other", *k), 0)
        # the least of scale * act + other (scale 1 or 2) plus grad_bytes * the gradients' difference (0 or 4 bytes)
        least = min(act, 2 * act) + other
        if k == (0, 0):
            least += min(0, 4 * (a.get(("grad",), 0) - b.get(("grad",), 0)))
        if least < 0:
            return False
    return True


class Front:
    """The non-dominated candidates of one context (a layer's backward; the head)."""

    def __init__(self) -> None:
        self.items: list[tuple[dict, dict]] = []  # (vector, snapshot)

    def offer(self, vector: dict, snapshot: Callable[[], dict]) -> None:
        if any(dominates(v, vector) for v, _ in self.items):
            return
        self.items = [(v, s) for v, s in self.items if not dominates(vector, v)]
        self.items.append((vector, snapshot()))


# ---------------------------------------------------------------------------------------------
# candidates


class Sampler:
    """After each op: the candidate moment of the current context, offered to its front.

    ``checkpointed``: the trace runs with gradient checkpointing (its layers' own saves are re-made
    in the backward and are transients here; their inputs are kept); ``head``: also sample the loss
    phase and the head's backward."""

    def __init__(self, live: LiveStorages, polys: Polys, checkpointed: bool, head: bool) -> None:
        self.live, self.polys, self.checkpointed, self.head = live, polys, checkpointed, head
        self.fronts: dict[tuple, Front] = {}
        self.layers: set[int] | None = None  # the decoder layers whose backward is sampled (None: all)

    def context(self) -> tuple | None:
        live = self.live
        if live.phase == "loss":
            return ("last",) if self.head else None
        if live.phase != "backward":
            return None
        if live.layer is None:
            return ("last",) if (self.head and not live.layers_started) else None
        live.layers_started = True
        return ("layer", live.layer) if self.layers is None or live.layer in self.layers else None

    def __call__(self, op: str) -> None:
        ctx = self.context()
        if ctx is None:
            return
        live = self.live
        i = ctx[1] if ctx[0] == "layer" else None
        own: list[_Rec] = []
        outside: list[_Rec] = []
        grads: list[_Rec] = []
        transients: list[_Rec] = []
        kept: list[_Rec] = []  # checkpointing: the tensors the layers are given, until the last layer using one is done
        for bucket, recs in list(live.buckets.items()):
            if not recs:
                continue
            kind = bucket[0]
            if kind == "other":
                transients += recs.values()
            elif kind in ("saved", "input"):
                where = bucket[1]
                if where is None:
                    (own if i is None else outside).extend(recs.values())
                elif i is None:
                    continue  # every layer is still saved at the head
                elif where == i:
                    own += recs.values()
                elif where > i:
                    transients += recs.values()  # a layer above that should have freed it: not counted anywhere
            elif kind == "grad" and bucket[1] == i:
                grads += recs.values()
            elif kind == "extra" and i is not None:
                kept += recs.values()
        vector = self.polys.summed(own + outside + transients + kept)
        vector[("grad",)] = sum(r.numel for r in grads)

        def snapshot() -> dict:
            return {"op": op, "phase": live.phase, "own": [r.key if r.bucket[0] == "saved" else "layer_input" for r in own],
                    "outside": [r.key for r in outside], "kept": [r.cdata for r in kept],
                    "transients": [(r.what if r.bucket == ("other",) else f"saved by a layer above: {r.what}",
                                    r.dtype, r.nbytes) for r in transients],
                    "grad_elements": sum(r.numel for r in grads), "grads": sorted(r.param for r in grads)}

        self.fronts.setdefault(ctx, Front()).offer(vector, snapshot)


def merge(fronts: list[Front]) -> Front:
    """One front of the candidates of several layers (a layer group)."""
    out = Front()
    for f in fronts:
        for vector, snap in f.items:
            out.offer(vector, lambda snap=snap: snap)
    return out


def entries(front: Front, ids: dict, polys: Polys, text: Callable, itemsize: Callable, kept: dict | None = None,
            **fields) -> list[dict]:
    """A front's candidates as the inventory file's moments (ids of the saves, transients with sizes);
    the largest at s = 4096, b = 1 first (then by position in the step)."""
    rows = []
    for vector, snap in front.items:
        transients = []
        for what, dtype, nbytes in snap["transients"]:
            key = (nbytes.node.expr if isinstance(nbytes, torch.SymInt) else nbytes, dtype)
            if key not in polys.texts:  # (elements, bytes) of a size, written once
                e = polys.expr(nbytes)
                polys.texts[key] = (text(sympy.expand(e / itemsize(dtype))), text(e))
            elements, nbytes_text = polys.texts[key]
            transients.append({"what": what, "dtype": str(dtype).replace("torch.", ""),
                               "elements": elements, "bytes": nbytes_text})
        transients.sort(key=lambda t: (t["what"], t["dtype"], t["bytes"]))
        row = {**fields, **({"phase": snap["phase"]} if fields.get("scope") == "last" else {}), "at": snap["op"],
               "alive": [k if isinstance(k, str) else ids.get(k, "?") for k in snap["own"]],
               "outside": [ids.get(k, "?") for k in snap["outside"]]}
        if kept is not None:
            row["kept"] = sorted(kept[c] for c in snap["kept"])
        if snap["grads"] and "scope" in fields and fields["scope"] == "last":
            row["grads"] = snap["grads"]
        row["grad_elements"] = snap["grad_elements"]
        row["transients"] = transients
        rows.append((-_at(vector, 4096, 1), row))
    return [r for _, r in sorted(rows, key=lambda x: x[0])]


def _at(vector: dict, s: int, b: int) -> Fraction:
    """A candidate's bytes at (s, b) (shifted coefficients: x = s - 2, y = b - 2), gradients at 2 bytes."""
    total = Fraction(0)
    for k, c in vector.items():
        if k == ("grad",):
            total += 2 * c
        else:
            total += c * (s - LOW) ** k[1] * (b - LOW) ** k[2]
    return total
