"""memplan: activation-memory planning for large transformer training.

The core (specs, inventory, estimate, search) never imports torch; only the
`validation` package does.
"""

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
