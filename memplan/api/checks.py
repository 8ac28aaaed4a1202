"""`memplan validate` as calls: real torch layers (and transformers' and megatron-core's, when installed) run and
measured against memplan's prediction, case by case or whole training steps. Needs torch (loaded only here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Optional

from memplan.check.allocator import ALLOCATOR_CASES, allocator_summary, max_seq_checks, run_allocator
from memplan.check.cases import SHAPES, grid, hf_grid, mcore_available, mcore_grid, traced_grid
from memplan.check.peak import peak_grid, peak_summary, run_peak
from memplan.check.validate import run, run_traced, summary
from memplan.core.errors import MemplanError


def _need_torch(device: str) -> bool:
    """Refuse a machine without torch (or without CUDA for device "cuda"); whether transformers is installed."""
    try:
        import torch
    except ImportError:
        raise MemplanError("validate needs torch: pip install torch==2.13.0 && pip install -e '.[validate]'") from None
    if device == "cuda" and not torch.cuda.is_available():
        raise MemplanError("--device cuda: no CUDA device is available")
    return importlib.util.find_spec("transformers") is not None


def check_tps(tps: tuple[int, ...]) -> None:
    """Refuse a tensor-parallel size the validation shapes cannot split (t must divide every shape's heads and
    width), before torch loads or any worker process starts."""
    heads = [a for _, _, _, a, _ in SHAPES]
    usable = [d for d in range(1, min(heads) + 1) if all(a % d == 0 for a in heads)]
    for t in tps:
        if t not in usable:
            raise MemplanError(f"--tp {t}: the validation shapes have {' and '.join(map(str, heads))} heads; t must "
                               f"divide them (one of {', '.join(map(str, usable))})")


def validate(device: str = "cpu", tps: tuple[int, ...] = (1, 2, 4),
             recomputes: tuple[str, ...] = ("none", "selective", "full"), fake: bool = True,
             hf: Optional[bool] = None, mcore: Optional[bool] = None) -> tuple[list[Any], dict[str, Any]]:
    """Every case's saved activations measured against memplan: (results, totals); hf / mcore None = when
    transformers / megatron-core is installed (CPU only)."""
    check_tps(tps)
    have_hf = _need_torch(device)
    if hf and not have_hf:
        raise MemplanError("--hf needs transformers: pip install -e '.[test]'")
    cases = grid(device, tps, recomputes, fake and device == "cpu")
    if (have_hf if hf is None else hf) and device == "cpu":
        cases += hf_grid(fake)
    if mcore and not mcore_available():
        raise MemplanError("--mcore needs megatron-core: pip install -e '.[test]'")
    if (mcore_available() if mcore is None else mcore) and device == "cpu":
        cases += mcore_grid(tuple(t for t in tps if t <= 2), recomputes)
    results = run(cases, device)
    if (have_hf if hf is None else hf) and device == "cpu":
        results += run_traced(traced_grid())  # the traced families against real runs
    return results, summary(results)


def validate_peak(device: str = "cpu", fake: bool = True) -> tuple[list[Any], dict[str, Any]]:
    """Whole training steps: the measured allocated peak against memplan's, (results, totals). Needs
    transformers."""
    if not _need_torch(device):
        raise MemplanError("--peak needs transformers: pip install -e '.[test]'")
    results = run_peak(peak_grid(fake, device))
    return results, peak_summary(results)


def validate_allocator(device: str = "cpu", record_dir: Optional[str] = None,
                       max_seq: bool = True) -> tuple[list[Any], list[Any], dict[str, Any]]:
    """Real runs' allocation streams through memplan's caching-allocator model, against memplan's own streams and
    (CUDA) the allocator's own figures; on CUDA with `max_seq`, memplan's longest sequence against real runs:
    (results, max-seq results, totals). Needs transformers."""
    if not _need_torch(device):
        raise MemplanError("--allocator needs transformers: pip install -e '.[test]'")
    if record_dir is not None and not Path(record_dir).is_dir():
        raise MemplanError(f"--record {record_dir}: not a directory")
    results = run_allocator(ALLOCATOR_CASES, device, record_dir)
    checks = max_seq_checks() if device == "cuda" and max_seq else []
    return results, checks, allocator_summary(results, checks)
