"""memplan: activation-memory planning for large transformer training.

The core (specs, inventory, estimate, search) never imports torch; only the
`validation` package does.
"""

import os as _os
import sys as _sys

__version__ = "0.1.0"

# The `memplan` command: its numpy work is elementwise (no BLAS or LAPACK call), but loading numpy
# starts OpenBLAS's pool of one thread per core, about 0.1 s of a command that takes 0.3 s. The
# command's own process gets one BLAS thread unless the user set OPENBLAS_NUM_THREADS; importing
# memplan as a library changes nothing.
if _os.path.basename(_sys.argv[0] if _sys.argv else "") in ("memplan", "memplan.exe", "memplan-script.py"):
    _os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
