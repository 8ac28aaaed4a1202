"""What memplan knows: the model and GPU presets (`memplan models`, `memplan gpus`), the implementations and
techniques it models (`memplan impls`), and transformers config.json files read as models."""

from __future__ import annotations

from typing import Any

from memplan.core.specs import GpuSpec
from memplan.inventory.assemble import IMPLEMENTATIONS
from memplan.inventory.chunked_loss import INFO as CHUNKS_INFO
from memplan.inventory.fp8 import INFO as FP8_INFO
from memplan.inventory.liger import INFO as LIGER_INFO
from memplan.inventory.lora import LORA_INFO
from memplan.inventory.fusions import INFO as FUSIONS_INFO
from memplan.inventory.mst import TECHNIQUES
from memplan.memory.optimizers import OPTIMIZER_INFO
from memplan.memory.parallel import IMPLS_TEXT
from memplan.memory.states import total_params
from memplan.presets.catalog import load_gpu, load_model, model_names
from memplan.presets.files import ModelPreset, gpu_names
from memplan.presets.hf_config import read_hf_config


def models() -> list[dict[str, Any]]:
    """The model presets, one dict each (`memplan models --json`): name, L, h, a, g, s, v, params and the
    preset's plan."""
    rows = []
    for name in model_names():
        p = load_model(name)
        m = p.model
        plan = " ".join(f"{k}={v}" for k, v in {**p.parallel, **p.training}.items())
        rows.append(dict(name=name, L=m.num_layers, h=m.hidden_size, a=m.num_attention_heads, g=m.g,
                         s=m.seq_length, v=m.vocab_size, params=total_params(m), plan=plan))
    return rows


def gpus() -> dict[str, GpuSpec]:
    """The GPU presets by name (each: memory_bytes, peak_bf16_flops, gpus_per_node, ...)."""
    return {name: load_gpu(name) for name in gpu_names()}


def load_hf_config(path: str) -> ModelPreset:
    """A transformers config.json read as data (no weights, no transformers needed): a preset whose .model is
    the ModelSpec; pass the path as hf_config= to estimate / search."""
    return read_hf_config(path)


def impls_lines() -> list[str]:
    """`memplan impls`: the implementations whose saved tensors memplan models, the optimizers, and how each
    technique is known."""
    lines = [f"{name:10s} {text}" for name, text in IMPLEMENTATIONS.items()]
    lines.append("\noptimizers (--optimizer; implementations for --optimizer-impl, the default first):")
    lines += [f"{name:14s} {info.title} [{', '.join(info.impls)}]: {info.source}" for name, info in OPTIMIZER_INFO.items()]
    lines.append("\ntechniques (how each is known):")
    return lines + [IMPLS_TEXT, FP8_INFO, CHUNKS_INFO, LORA_INFO, LIGER_INFO, FUSIONS_INFO,
                    *(f"{name}: {text}" for name, text in TECHNIQUES.items())]
