"""Run a function on t spawned ranks of a torch.distributed process group; collect the results.

Every multi-process path of the package (``measure._spawn``, ``equivalence``) goes through
``run_ranks``, which owns the whole life of the processes:

* rendezvous through a ``FileStore`` in a fresh temporary directory (``init_method=file://``), not
  a TCP port: a port found free and released by the parent can be taken by another process before
  rank 0 binds it again (parallel test runs, consecutive spawns);
* each rank writes its result to ``rank<r>.pkl`` in that directory; the parent reads the files
  only after ``mp.spawn`` has joined every process;
* each rank ends with ``dist.barrier()`` (no rank tears down its connections while a peer still
  communicates) and then ``dist.destroy_process_group()`` in a ``finally``, and returns normally.

Why the teardown must really *free* the process group (not only unregister it)
-------------------------------------------------------------------------------
ProcessGroupGloo runs collectives on its own worker threads.  Such a thread drops its reference
to a finished collective (and to the Python-visible tensors it holds) a moment *after*
``wait()`` has returned in Python, and dropping a tensor that has a Python object needs the GIL.
If the main thread has meanwhile returned from the rank function and entered interpreter
shutdown, the worker thread cannot take the GIL: CPython ends it with ``pthread_exit``, whose
forced unwind hits a ``noexcept`` C++ destructor, and the process dies with SIGABRT
("terminate called without an active exception").

The process group's destructor prevents this: it waits for the work queue and joins the worker
threads (with the GIL released).  But ``destroy_process_group`` only drops the *registry's*
references, and torch itself can keep the default group alive:
``torch/distributed/nn/functional.py`` has ten functions declared ``def f(..., group=group.WORLD)``,
default arguments evaluated at import time.  Nothing imports that module eagerly, but the first
``torch.utils.checkpoint`` call (selective / full recompute) imports ``torch._dynamo``, which
imports it (via ``torch.distributed.fsdp`` -> ``torch.distributed._shard``).  Imported after
``init_process_group``, it pins the default group for good: its gloo threads outlive
``destroy_process_group`` and race with interpreter shutdown.  So each
rank imports ``torch.distributed.nn`` *before* creating the group (its defaults then capture
``None``, i.e. "the default group at call time"), and after ``destroy_process_group`` checks that
it held the last reference, so that dropping it joins the gloo threads while Python is alive.
"""

from __future__ import annotations

import gc
import importlib
import os
import pickle
import sys
import tempfile
import time
import warnings
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = timedelta(seconds=120)  # collectives and rendezvous


def _result_path(outdir: str, rank: int) -> str:
    return os.path.join(outdir, f"rank{rank}.pkl")


def _teardown() -> None:
    """Destroy the default group and free it now, joining its worker threads (see above)."""
    pg = dist.group.WORLD
    dist.destroy_process_group()
    if pg is None:
        return
    # references: the local ``pg`` and getrefcount's argument.  Anything else pins the group
    # (and its worker threads) past interpreter shutdown, see the module docstring.
    leaked = sys.getrefcount(pg) > 2
    del pg  # last reference: ~ProcessGroupGloo drains its queue and joins its threads
    if leaked:
        warnings.warn("validation.ranks: the default process group is still referenced after "
                      "destroy_process_group; waiting for its worker threads to go idle", RuntimeWarning)
        time.sleep(0.2)  # releases the GIL: finished collectives drop their tensors now


def _entry(rank: int, world: int, backend: str, store: str, outdir: str,
           fn: Callable[..., Any], args: tuple) -> None:
    torch.set_num_threads(1)
    # Before the default group exists: see the module docstring (default args = group.WORLD).
    importlib.import_module("torch.distributed.nn")
    # The imports (torch, the harness, what unpickling `fn` loaded) stay alive to the end: out of gc's way, so the
    # gc.collect() before each measurement walks only what the rank made since (~0.2 s of CPU less per collection).
    gc.collect()
    gc.freeze()

    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=TIMEOUT)
    try:
        result = fn(rank, world, *args)
        tmp = _result_path(outdir, rank) + ".tmp"
        with open(tmp, "wb") as fh:
            pickle.dump(result, fh)
        os.replace(tmp, _result_path(outdir, rank))
        del result
        dist.barrier()
    finally:
        _teardown()


def run_ranks(fn: Callable[..., Any], world: int, args: tuple = (), backend: str = "gloo") -> list[Any]:
    """``[fn(r, world, *args) for r in range(world)]``, each call in its own process, rank r of a
    ``backend`` process group.  ``fn`` must be a picklable (module-level) function and its result
    picklable.  Raises (``torch.multiprocessing.ProcessRaisedException`` / ``ProcessExitedException``)
    if a rank fails."""
    with tempfile.TemporaryDirectory(prefix="memplan-validation-") as outdir:
        store = os.path.join(outdir, "store")  # created by the FileStore; must not exist yet
        mp.spawn(_entry, args=(world, backend, store, outdir, fn, args), nprocs=world, join=True)
        per_rank = []
        for r in range(world):
            with open(_result_path(outdir, r), "rb") as fh:
                per_rank.append(pickle.load(fh))
    return per_rank


def sum_reductions(model) -> list:
    """The model's FSDP2 modules, each set to sum and then divide: gloo (these ranks' backend) has no PREMUL_SUM (the
    reduction's op, not its buffers)."""
    modules = [m for m in model.modules() if hasattr(m, "_get_fsdp_state")]
    for m in modules:
        m.set_force_sum_reduction_for_comms(True)
    return modules
