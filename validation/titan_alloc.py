"""The allocation stream of a real torchtitan 0.3.0 FSDP2 training step, recorded (issues 20 and 24): validation/
titan_step.py's step (torchtitan's ``parallelize_llama``, fused AdamW, its loss, ``clip_grad_norm_``, zero_grad; 2 gloo
CPU ranks, 2 steps, the second recorded) with every storage made and freed in order, sizes in bytes, for memplan's
caching-allocator model to replay and for memplan's own torchtitan stream to be compared with
(tests/test_titan_alloc.py, memplan/check/stream_match.py).

What is an event (``_StepEvents``, a titan_step ``_StepStorages``):

* the storages alive at the step's start (the fp32 sharded parameters, gradients, AdamW's moments and step counters,
  the buffers; FSDP2's unsharded parameters have 0 bytes there), one allocation each, labelled "start";
* each storage an op outputs (or, made outside the dispatcher, first uses) with bytes: an allocation of its bytes then;
  its death (a weakref callback on the storage): a free;
* FSDP2's ``alloc_storage`` / ``free_storage`` (torch/distributed/fsdp/_fully_shard/_fsdp_param.py: the unsharded
  parameters' storages resized back to their size before a unit's all-gather copy-out and to 0 at its reshard, outside
  the dispatcher): a free of the old bytes and an allocation of the new, as the caching allocator sees them (a resize
  is a new block and the old one's free), labelled with the aten op ``fsdp.alloc_storage`` / ``fsdp.free_storage``;
* an out= op that resizes a storage in place: the same.

Left apart: ProcessGroupGloo's own copy of a reduce-scatter's input (``_StepStorages._see_input``: NCCL makes none);
temporaries an op makes and frees inside itself (fused AdamW's, the CPU kernels'); on CUDA FSDP2 issues the next
block's all-gather ahead on its own stream, which CPU cannot show.  Each event carries where it happened (phase, layer
from 0, the aten op).  Nothing here predicts: every size is read off a storage.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import torch

from .titan import Shape, local_tensor
from .titan_step import _StepStorages, step_rank

FORMAT = 1


class _StepEvents(_StepStorages):
    """``_StepStorages`` keeping the order of allocations and frees (module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.events: list[tuple[str, int, int, int]] = []
        self.where: list[str] = []
        self.ids: dict[int, tuple[int, int]] = {}  # storage id -> (event id, bytes) of its live allocation
        self.next_id = 0
        self.started = False
        self._patched: list = []

    def _emit(self, op: str, key: int, size: int) -> None:
        phase, layer = self.label[:2] if self.started else ("start", None)
        if op == "alloc":
            self.ids[key] = (self.next_id, size)
            self.events.append(("alloc", self.next_id, size, 0))
            self.next_id += 1
        else:
            self.events.append(("free", self.ids.pop(key)[0], 0, 0))
        self.where.append(f"{phase}/{'-' if layer is None else layer}/{self._op}")

    def _resized(self, st) -> None:
        """The storage's bytes now (a resize: the old block freed, a new one allocated)."""
        key, n = st._cdata, st.nbytes()
        with self.lock:
            if key in self.gloo or self.ids.get(key, (0, 0))[1] == n:
                return
            if key in self.ids:
                self._emit("free", key, 0)
            if n:
                self._emit("alloc", key, n)

    def _follow(self, t: torch.Tensor, kind: str | None = None) -> None:
        super()._follow(t, kind)
        self._resized(local_tensor(t).untyped_storage())

    def _gone(self, key: int, _ref) -> None:
        with self.lock:
            if key in self.ids:
                self._emit("free", key, 0)
        super()._gone(key, _ref)  # takes the lock itself

    def _fsdp(self, fn):
        """FSDP2's resize (``fn``: alloc_storage / free_storage), its events labelled ``fsdp.<fn>``."""
        def wrapped(tensor: torch.Tensor) -> None:
            fn(tensor)
            op, self._op = self._op, f"fsdp.{fn.__name__}"
            try:
                self._follow(tensor)
            finally:
                self._op = op
        return wrapped

    def __enter__(self):
        from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

        self.started = True
        for mod, name in ((_fsdp_param, "alloc_storage"), (_fsdp_param, "free_storage"),
                          (_fsdp_param_group, "alloc_storage")):
            self._patched.append((mod, name, getattr(mod, name)))
            setattr(mod, name, self._fsdp(getattr(mod, name)))
        return super().__enter__()

    def __exit__(self, *exc):
        for mod, name, fn in reversed(self._patched):
            setattr(mod, name, fn)
        self._patched = []
        return super().__exit__(*exc)

    def result(self) -> dict:
        with self.lock:
            return {"events": list(self.events), "where": list(self.where)}


def record_rank(rank: int, world: int, shape: Shape, layers: int, vocab: int, s: int, b: int, ac: str) -> dict:
    """One rank's recording: titan_step.step_rank with ``_StepEvents``; the events, where each happened, the peak."""
    m = step_rank(rank, world, shape, layers, vocab, s, b, ac, False, _StepEvents)
    return {**m["tracker"], "peak": m["peak"], "start": m["start"]}


def record(shape: Shape, layers: int, vocab: int, s: int, b: int, ac: str, world: int = 2) -> dict:
    """Rank 0's recording (both ranks run the same step) and the run it is of."""
    from .ranks import run_ranks
    rec = run_ranks(record_rank, world, (shape, layers, vocab, s, b, ac))[0]
    return {"format": FORMAT, "torch": torch.__version__, "run": {"h": shape.h, "a": shape.a, "g": shape.g,
            "f": shape.f, "layers": layers, "vocab": vocab, "s": s, "b": b, "ac": ac, "world": world}, **rec}


def save(rec: dict, path: str | Path) -> None:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump(rec, f, separators=(",", ":"))


def load(path: str | Path) -> dict:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rec = json.load(f)
    rec["events"] = [tuple(e) for e in rec["events"]]
    return rec


# the recorded runs (tests/data/alloc/titan/NAME_AC.json.gz): the tiny model of validation/titan_step.py (h 64, a 4,
# g 2, f 160, 2 layers, v 256, s 32, b 2: every block in the caching allocator's small pool) and a mid one whose
# activations and states are large-pool blocks (h 512, a 8, g 4, f 1408, 2 layers, v 8,192, s 1,024, b 1: s b h fp32
# is 2 MiB, the fp32 logits 32 MiB); 2 gloo ranks, AC none / full / selective-op
RUNS = {"tiny": (Shape(), 2, 256, 32, 2), "mid": (Shape(h=512, a=8, g=4, f=1408), 2, 8192, 1024, 1)}
ACS = ("none", "full", "selective-op")


def main(argv: list[str] | None = None) -> None:
    """python -m validation.titan_alloc DIR [NAME ...]: record the runs (``RUNS`` x ``ACS``) into DIR (about a minute
    each on 2 CPU cores)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m validation.titan_alloc")
    ap.add_argument("out")
    ap.add_argument("names", nargs="*", default=list(RUNS))
    args = ap.parse_args(argv)
    for name in args.names:
        for ac in ACS:
            rec = record(*RUNS[name], ac)
            save(rec, Path(args.out) / f"{name}_{ac}.json.gz")
            print(f"{name} {ac}: {len(rec['events'])} events, live peak {rec['peak']:,} B")


if __name__ == "__main__":
    main()
