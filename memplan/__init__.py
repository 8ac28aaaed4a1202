"""memplan: activation-memory planning for large transformer training.

The core (specs, inventory, estimate, search) never imports torch; only the
`validation` package does.

`import memplan` gives the Python API (docs/api.md) and loads nothing else: memplan.estimate, search, max_seq,
max_micro_batch, explain, models, gpus, load_hf_config and PlanOptions load their module of memplan.api on first
use (PEP 562).
"""

import importlib as _importlib
import os as _os
import sys as _sys

__version__ = "0.1.0"

# The `memplan` command's own process (not memplan imported as a library), two costs of start and
# exit that buy nothing here:
# - its numpy work is elementwise (no BLAS or LAPACK call), but loading numpy starts OpenBLAS's pool
#   of one thread per core, ~0.1 s: one BLAS thread, unless the user set OPENBLAS_NUM_THREADS;
# - at exit the interpreter runs a last garbage collection over every object the imports made
#   (pydantic, numpy, rich: ~0.1 s); freezing them first skips it. Output is written and flushed
#   before; only the collection of unreachable cycles at exit is left out.
if _os.path.basename(_sys.argv[0] if _sys.argv else "") in ("memplan", "memplan.exe", "memplan-script.py"):
    import atexit as _atexit
    import gc as _gc

    _os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    _atexit.register(_gc.freeze)

# name -> the memplan.api module that defines it
_API = {
    "estimate": "memplan.api.estimating",
    "max_seq": "memplan.api.estimating",
    "max_micro_batch": "memplan.api.estimating",
    "explain": "memplan.api.explaining",
    "EstimateResult": "memplan.api.estimating",
    "search": "memplan.api.searching",
    "SearchResults": "memplan.api.searching",
    "models": "memplan.api.catalog",
    "gpus": "memplan.api.catalog",
    "load_hf_config": "memplan.api.catalog",
    "PlanOptions": "memplan.api.options",
    "MemplanError": "memplan.core.errors",
}
__all__ = sorted(_API)


def __getattr__(name: str):
    """The API's names, imported on first use (the `memplan` command imports only what its command needs)."""
    if name in _API:
        value = getattr(_importlib.import_module(_API[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'memplan' has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(_API))
