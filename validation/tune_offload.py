"""torchtune's activation offloading measured on CPU: which saved tensors its OffloadActivations (torchtune 0.6.1,
torchtune/training/_activation_offloading.py) copies to the host and which it keeps, in a real forward of its Llama
with every layer checkpointed, as its recipes set it up (``get_act_offloading_ctx_manager``: the output projection
under NoOpManager).

Its CUDA side stream cannot run here: ``measure_tune_offload`` makes the context with ``use_streams=False`` (the
single-stream path) and ``use_pin_memory=False`` (no pinned memory without CUDA), ``torch.cuda.default_stream``
(read in its constructor) stubbed; ``tune_offload_stash`` runs its stream path with the streams and events stubbed
(what its forward stash keeps alive is plain Python bookkeeping). Its module is loaded from its file: ``torchtune.training``'s package imports torchao APIs that torchao 0.18
no longer has. What needs CUDA, the copies' timing and the backward's stream hand-offs, and the power-of-two pinned
blocks are derived (memplan/memory/offload.py).
"""

from __future__ import annotations

import contextlib
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


class _NoStream:
    """Stands for a CUDA stream or event: the waits and records do nothing (one CPU 'device')."""

    def wait_event(self, *args) -> None:
        pass

    def wait_stream(self, *args) -> None:
        pass

    def record_event(self, *args) -> None:
        return None


def tune_offload_stash(s: int, b: int, vocab: int, layers: int, heads: int, kv_heads: int, hidden: int, ffn: int,
                       lora: dict | None = None) -> dict[str, int]:
    """Its stream path (the recipes' ``use_streams=True``) in one forward, the streams and events stubbed: how many
    layer inputs (bf16 (b, s, h) packs) its forward stash keeps on the 'GPU' at most (``most``) and when the forward
    ends (``at_end``, i.e. at the loss)."""
    module = _offloading_module()
    torch.manual_seed(0)
    model = _build(vocab, layers, heads, kv_heads, hidden, ffn, True, lora)
    real = module.OffloadActivations
    with mock.patch.object(torch.cuda, "default_stream", lambda *a, **k: _NoStream()), \
            mock.patch.object(torch.cuda, "Stream", lambda *a, **k: _NoStream()), \
            mock.patch.object(module, "OffloadActivations", lambda: real(use_pin_memory=False, use_streams=True)):
        ctx = module.get_act_offloading_ctx_manager(model, True)
    layer_inputs: set[int] = set()
    most = 0
    pack = ctx.pack_hook

    def counting_pack(t):
        nonlocal most
        tensor_id = pack(t)
        if t.dtype == torch.bfloat16 and tuple(t.shape) == (b, s, hidden):
            layer_inputs.add(tensor_id)
        most = max(most, len(layer_inputs & set(ctx.fwd_stash)))
        return tensor_id

    ctx.pack_hook = counting_pack
    with mock.patch.object(torch.cuda, "stream", lambda stream: contextlib.nullcontext()), ctx:
        logits = model(torch.randint(0, vocab, (b, s)))
    del logits
    return {"most": most, "at_end": len(layer_inputs & set(ctx.fwd_stash))}


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
