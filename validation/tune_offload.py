"""torchtune's activation offloading measured on CPU: which saved tensors its OffloadActivations (torchtune 0.6.1,
torchtune/training/_activation_offloading.py) copies to the host and which it keeps, in a real forward of its Llama
with every layer checkpointed, as its recipes set it up (``get_act_offloading_ctx_manager``: the output projection
under NoOpManager).

Its CUDA side stream cannot run here: the context is made with ``use_streams=False`` (the single-stream path) and
``use_pin_memory=False`` (no pinned memory without CUDA); ``torch.cuda.default_stream`` (read in its constructor) is
stubbed. Its module is loaded from its file: ``torchtune.training``'s package imports torchao APIs that torchao 0.18
no longer has. What the recipes' default (streams, pinned) changes, the GPU stash and the power-of-two pinned
blocks, is derived (memplan/memory/offload.py).
"""

from __future__ import annotations

import importlib.util
import os
from unittest import mock

import torch

from validation.torchtune import _build, import_torchtune


def _offloading_module():
    tune = import_torchtune()
    path = os.path.join(os.path.dirname(tune.__file__), "training", "_activation_offloading.py")
    spec = importlib.util.spec_from_file_location("torchtune_activation_offloading", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure_tune_offload(s: int, b: int, vocab: int, layers: int, heads: int, kv_heads: int, hidden: int,
                         ffn: int, lora: dict | None = None) -> dict[str, list[int]]:
    """One forward of torchtune's checkpointed Llama under its activation offloading. Returns ``offloaded`` (the
    bytes of each host copy its pack hook made, in pack order) and ``kept`` (of each pack it left as it is,
    parameters included); ``lora``: torchtune's LoRA / QLoRA model (validation/torchtune.py ``_build``)."""
    module = _offloading_module()
    torch.manual_seed(0)
    model = _build(vocab, layers, heads, kv_heads, hidden, ffn, True, lora)
    real = module.OffloadActivations
    with mock.patch.object(torch.cuda, "default_stream", lambda *a, **k: None), \
            mock.patch.object(module, "OffloadActivations",
                              lambda: real(use_pin_memory=False, use_streams=False)):
        ctx = module.get_act_offloading_ctx_manager(model, True)
    tokens = torch.randint(0, vocab, (b, s))
    with ctx:
        logits = model(tokens)
    out: dict[str, list[int]] = {"offloaded": [], "kept": []}
    for _, (tensor, modified) in sorted(ctx.tracker.items()):
        out["offloaded" if modified else "kept"].append(tensor.untyped_storage().nbytes())
    del logits
    return out
