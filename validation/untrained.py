"""Which parameters a real training step trains (issue 22): a tiny transformers model (validation/registry.py
tiny_config) built in bf16, one forward + backward of the causal-LM loss and one torch AdamW step (foreach, as
validation/step.py's torch loop); then which parameters have a ``.grad`` and which have optimizer state, and their
bytes (each storage once; AdamW's ``step`` counters left out, as validation/step.py does).

RoFormer's rotary table and Pegasus' / Marian's sinusoidal positions are ``nn.Embedding(..., _freeze=True)``
(requires_grad false); DeepSeek-V3.2's and GLM-5's lightning indexer runs under ``@torch.no_grad()``, so its
parameters (requires_grad true) get no ``.grad`` and AdamW (which skips a parameter whose ``.grad`` is None) makes no
state for them. memplan counts both as weights only (ParamGroup.trained, memplan/memory/states.py).

    OMP_NUM_THREADS=1 PYTHONPATH=. /work/venv/bin/python -m validation.untrained roformer pegasus deepseek_v32
"""

from __future__ import annotations

import sys

import torch

from .registry import text_model, tiny_config
from .trace_config import build_model


def measure_untrained(config: dict, s: int = 8, b: int = 1) -> dict:
    """The tiny model's parameters, those with a gradient after backward and with AdamW state after its step."""
    config = text_model(config)
    torch.manual_seed(0)
    model = build_model(config, "hf-eager")
    named = list(model.named_parameters())  # each tensor once (a tied weight once)
    ids = torch.randint(0, config.get("vocab_size", 64), (b, s))
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    opt = torch.optim.AdamW([p for _, p in named if p.requires_grad], lr=1e-4, weight_decay=0.01, foreach=True)
    opt.step()
    states = [v for p in opt.state.values() for k, v in p.items() if k != "step" and isinstance(v, torch.Tensor)]
    return {
        "params": sum(p.numel() for _, p in named),
        "grad_params": sum(p.numel() for _, p in named if p.grad is not None),
        "state_params": sum(p.numel() for _, p in named if p in opt.state),
        "grad_bytes": sum(p.grad.untyped_storage().nbytes() for _, p in named if p.grad is not None),
        "state_bytes": sum(t.untyped_storage().nbytes() for t in states),
        "untrained": sorted(n for n, p in named if p.grad is None),
    }


def main(argv: list[str] | None = None) -> None:
    for model_type in (argv if argv is not None else sys.argv[1:]):
        m = measure_untrained(tiny_config(model_type))
        names = sorted({n.split(".")[-2] if n.count(".") else n for n in m["untrained"]})
        print(f"{model_type}: {m['params']:,} parameters, {m['grad_params']:,} with a gradient "
              f"({m['grad_bytes']:,} B), {m['state_params']:,} with AdamW state ({m['state_bytes']:,} B); "
              f"no gradient: {len(m['untrained'])} tensors ({', '.join(names)})")


if __name__ == "__main__":
    main()
