"""The wall time of tracing transformers' code (validation/trace.py) at full size, for five families.

    python benchmarks/bench_trace.py [--impl hf-sdpa] [--kernels cpu] [--whole] [--saves-only] [--out DIR] [names...]

Each trace is what `--impl hf-*` runs on first use of a config.json: forward + loss + backward under
FakeTensorMode with symbolic s and b, once as is and once with gradient checkpointing, composed from the first
decoder layer of each kind, one in its middle and the model's last two (validation/compose.py). `--whole` traces every layer instead
(the reference the composition is tested against; about 0.9 s of CPU per decoder layer). Prints one line per
model: its layers, the layers traced, the wall seconds, the CPU seconds of this process and the machine's load
average (1 min) before and after, since wall time on a shared machine depends on it. A figure, not a test.
The first model of a process also pays the one-time warm-up a fresh `memplan trace` pays (torch._dynamo and the
model's module imported, torch's and sympy's caches filled: ~5 s of CPU on this machine); give one name per
process for that figure.
``--out DIR`` writes each inventory to DIR/<model>.yaml (what `memplan trace --out` writes), so a change to the
tracer can be checked byte for byte against the inventories from before it (``cmp``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from validation.trace import to_yaml, trace_hf_config

ROOT = Path(__file__).resolve().parent.parent / "configs" / "traced"

# Meta-Llama-3-70B's config.json (the Hub file's architecture fields; not shipped in configs/traced/)
LLAMA3_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
              "intermediate_size": 28672, "num_attention_heads": 64, "num_key_value_heads": 8,
              "num_hidden_layers": 80, "vocab_size": 128256, "max_position_embeddings": 8192, "hidden_act": "silu",
              "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
              "attention_bias": False, "mlp_bias": False}

# dense; alternating sliding / global attention; MoE; MLA + MoE with dense first layers; a 94-layer MoE
MODELS = {"llama3-70b": LLAMA3_70B, "gemma3-1b": ROOT / "gemma3-1b" / "config.json",
          "mixtral-8x22b": ROOT / "mixtral-8x22b" / "config.json", "deepseek-v3": ROOT / "deepseek-v3" / "config.json",
          "qwen3-235b-a22b": ROOT / "qwen3-235b-a22b" / "config.json"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help=f"models (default: all): {', '.join(MODELS)}")
    p.add_argument("--impl", default="hf-sdpa", choices=("hf-sdpa", "hf-eager"))
    p.add_argument("--kernels", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--whole", action="store_true", help="trace every decoder layer (no composition)")
    p.add_argument("--saves-only", action="store_true", help="no backward: the saved tensors only")
    p.add_argument("--out", type=Path, help="write each inventory to DIR/<model>.yaml")
    a = p.parse_args(argv)
    unknown = sorted(set(a.names) - set(MODELS))
    if unknown:
        p.error(f"unknown model {unknown[0]!r} (known: {', '.join(MODELS)})")
    for name in a.names or list(MODELS):
        config = MODELS[name]
        if isinstance(config, dict):
            path = Path(tempfile.mkdtemp()) / "config.json"
            path.write_text(json.dumps(config))
            config = path
        told: list[str] = []
        load = os.getloadavg()[0]
        wall, cpu = time.perf_counter(), time.process_time()
        with contextlib.redirect_stderr(io.StringIO()):  # transformers' own warnings
            data = trace_hf_config(config, impl=a.impl, kernels=a.kernels, moments=not a.saves_only,
                                   compose=not a.whole, progress=told.append)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        traced = told[0].split(": ")[1].split(" decoder layers")[0] if told else "?"
        print(f"{name:16} {data['num_layers']:3} layers, traced {traced:>9}: {wall:6.1f} s wall, {cpu:6.1f} s CPU "
              f"(load average {load:.1f} -> {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs)", flush=True)
        if a.out is not None:
            a.out.mkdir(parents=True, exist_ok=True)
            (a.out / f"{name}.yaml").write_text(to_yaml(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
