"""Traced inventories against what CUDA's kernels save, with and without attention dropout (issue 22 item 4).

``memplan trace --kernels cuda`` emulates on fake CPU tensors what torch's CUDA kernels save (validation/trace_cuda.py
``CudaKernels``: sdpa's cuDNN / flash / memory-efficient kernels, in torch's H100 order, keep q, k, v, the output,
an fp32 logsumexp and the Philox RNG state, never an s x s tensor; eager dropout a 1-byte bool mask; layer norm's
fp32 statistics). Here
the real models run on a GPU and what they save for the backward is read off the tensors
(``trace_measure.measure_hf_config`` on ``device="cuda"``) and compared layer by layer with the trace's polynomials.

Two halves, so that the GPU runs nothing but the models:
* ``predict``: the ``--kernels cuda`` trace of every case (``CASES``: each family of ``trace_config.FAMILIES`` with
  ``attention_dropout`` 0 and 0.1, sdpa families also eager) evaluated at (S, B); CPU, here.
* ``measure``: the same configs run on the GPU, sdpa with torch's own choice of kernel and with each of the
  flash, memory-efficient and cuDNN kernels forced (``torch.nn.attention.sdpa_kernel``; a kernel that refuses the
  shapes is said so), each layer's saved bytes beside the prediction.

The measured figures are committed (tests/data/cuda_dropout.json) and tests/test_cuda_dropout.py checks the trace
against them in CI. Run:  PYTHONPATH=. python -m validation.cuda_dropout predict --out P.json  (CPU), then
PYTHONPATH=. python -m validation.cuda_dropout measure --predictions P.json --out M.json  (GPU).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

S, B = 64, 2  # multiples of 8 (the kernels' alignment) and past the tiny configs' sliding window of 16
DROPOUTS = (0.0, 0.1)
BACKENDS = ("default", "flash", "efficient", "cudnn")  # default: torch's own choice


def cases() -> dict[str, tuple[dict, str]]:
    """{name: (config, impl)}: each family of trace_config.FAMILIES at each dropout; the sdpa families also eager."""
    from .trace_config import FAMILIES

    out = {}
    for family, (config, impl) in FAMILIES.items():
        impls = [impl] + (["hf-eager"] if impl == "hf-sdpa" and f"{family}-eager" not in FAMILIES else [])
        for this in impls:
            for p in DROPOUTS:
                name = family + ("-eager" if this != impl else "") + (f" p{p}" if p else "")
                out[name] = ({**config, "attention_dropout": p}, this)
    return out


def predict(names: Optional[list[str]] = None) -> dict[str, dict]:
    """{name: the --kernels cuda trace's saved bytes at (S, B): layers, outside, shared, total}."""
    from .trace import trace_hf_config
    from .trace_measure import predicted_bytes

    out = {}
    for name, (config, impl) in cases().items():
        if names is None or name in names:
            out[name] = predicted_bytes(trace_hf_config(config, impl=impl, kernels="cuda", moments=False), S, B)
    return out


def _backend_context(backend: str):
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend == "default":
        return contextlib.nullcontext()
    return sdpa_kernel([{"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                         "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]])


def measure(predictions: dict[str, dict], device: str = "cuda") -> list[dict]:
    """Each predicted case run on `device` with each sdpa backend (eager: once), its saved bytes beside the
    prediction: [{name, backend, measured | error, predicted, layers_equal, total_equal}]."""
    import torch

    from .trace_measure import measure_hf_config

    rows = []
    for name, (config, impl) in cases().items():
        if name not in predictions:
            continue
        pred = predictions[name]
        for backend in BACKENDS if impl == "hf-sdpa" else ("default",):
            row = {"name": name, "impl": impl, "backend": backend, "predicted": pred}
            try:
                with _backend_context(backend):
                    got = measure_hf_config(config, S, B, impl=impl, device=device)
            except (RuntimeError, torch.OutOfMemoryError) as e:  # a forced kernel that refuses the shapes
                row["error"] = str(e).strip().splitlines()[0][:300]
            else:
                row.update(measured=got, layers_equal=got["layers"] == pred["layers"],
                           total_equal=got["total"] == pred["total"])
            rows.append(row)
            print(f"{name:28s} {backend:9s} " + (f"error: {row['error'][:80]}" if "error" in row else
                  f"layers {'=' if row['layers_equal'] else 'DIFFER'} total {got['total']} vs {pred['total']}"),
                  flush=True)
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m validation.cuda_dropout")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("predict")
    p.add_argument("--out", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--predictions", required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    if args.cmd == "predict":
        data = {"s": S, "b": B, "predictions": predict()}
    else:
        import torch

        with open(args.predictions, encoding="utf-8") as f:
            pred = json.load(f)
        rows = measure(pred["predictions"], args.device)
        data = {"s": S, "b": B, "torch": torch.__version__,
                "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                "cudnn": torch.backends.cudnn.version() if args.device == "cuda" else None, "rows": rows}
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
