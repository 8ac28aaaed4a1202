"""Regenerate the traced inventories shipped in configs/traced/ (one directory per model, holding
the transformers config.json it was traced from and one file per implementation and kernel set).

    python -m validation.traced_presets            # trace every config.json, write the files
    python -m validation.traced_presets --check    # exit 1 when a shipped file differs from a new trace
    python -m validation.traced_presets qwen2.5-7b # one model

Tracing the transients runs the backward twice more (as is and with gradient checkpointing); the trace runs
the first two decoder layers of each kind and the model's last two only (validation/compose.py), so a file takes seconds
(benchmarks/bench_trace.py). Files of format
/1 (no transients: memplan derives them, memplan/inventory/traced.py) still load, and --check re-traces them as they
were made.

An implementation transformers does not offer for an architecture (Gemma 2 has no sdpa path in
transformers 5.x: its attention soft-caps the scores) is skipped and said so. tests/test_traced.py
re-traces some of the files and fails when they drift from the code.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from .trace import to_yaml, trace_hf_config

ROOT = Path(__file__).resolve().parent.parent / "configs" / "traced"
IMPLS = ("hf-sdpa", "hf-eager")
KERNELS = ("cuda", "cpu")  # CUDA's kernels emulated on fake CPU tensors (validation/trace.py), and CPU's


def file_name(impl: str, kernels: str) -> str:
    """As memplan.traced.file_name (validation/ does not import memplan)."""
    return f"{impl}-{kernels}.yaml"


def trace_one(directory: Path, impl: str, kernels: str, moments: bool = True) -> str | None:
    """The file text of one trace (``moments``: with the step's transients, validation/transients.py), or
    None when transformers has no such implementation for it."""
    try:
        data = trace_hf_config(directory / "config.json", impl=impl, kernels=kernels, moments=moments)
    except ValueError as err:
        if "does not support an attention implementation" in str(err):
            return None
        raise
    return to_yaml(data)


def same_trace(shipped: dict, traced: dict) -> bool:
    """A shipped file equals a new trace; one of format /1 (made before the transients were traced) is
    compared without the format line."""
    if shipped.get("format") == "memplan-traced-inventory/1":
        traced = {k: v for k, v in traced.items() if k != "format"}
        shipped = {k: v for k, v in shipped.items() if k != "format"}
    return shipped == traced


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the shipped files, write nothing")
    parser.add_argument("names", nargs="*", help="model directories (default: all)")
    args = parser.parse_args(argv)
    dirs = [ROOT / n for n in args.names] if args.names else sorted(p.parent for p in ROOT.glob("*/config.json"))
    drift = 0
    for directory in dirs:
        for impl in IMPLS:
            for kernels in KERNELS:
                path = directory / file_name(impl, kernels)
                # --check re-traces a file as it was made: with the transients if it has them (format /2)
                old = yaml.safe_load(path.read_text()) if (args.check and path.is_file()) else None
                text = trace_one(directory, impl, kernels, moments=old is None or "moments" in old)
                if text is None:
                    print(f"{directory.name}: {impl}: not offered by transformers for this architecture, skipped")
                    continue
                if args.check:
                    same = old is not None and same_trace(old, yaml.safe_load(text))
                    drift += not same
                    print(f"{directory.name}: {path.name}: {'same' if same else 'DRIFTED'}")
                else:
                    path.write_text(text)
                    print(f"{directory.name}: wrote {path.name}")
    return 1 if drift else 0


if __name__ == "__main__":
    sys.exit(main())
