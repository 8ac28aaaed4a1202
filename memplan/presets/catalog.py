"""The presets by name: the model YAMLs of configs/models, the transformers configs shipped with traced inventories
(configs/traced/<name>/config.json, with their published plan) and the GPU YAMLs of configs/gpus."""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from pathlib import Path
from typing import Optional

from memplan.core.datafile import read_yaml
from memplan.core.errors import MemplanError
from memplan.core.spec_base import build
from memplan.core.model import ModelSpec
from memplan.core.specs import GpuSpec
from memplan.inventory.traced_file import file_name
from memplan.presets.files import ModelPreset, configs_dir, gpu_names, read_model_file, with_plan
from memplan.presets.hf_config import read_hf_config


def model_names() -> list[str]:
    """The presets: configs/models/*.yaml, and the transformers configs shipped with traced inventories
    (configs/traced/<name>/config.json)."""
    return sorted([p.stem for p in (configs_dir() / "models").glob("*.yaml")] +
                  [p.parent.name for p in (configs_dir() / "traced").glob("*/config.json")])


def load_model(name_or_path: str) -> ModelPreset:
    """A preset by name, or a YAML file by path."""
    path = Path(name_or_path)
    if path.suffix == ".json":
        raise MemplanError(f"{name_or_path} is JSON: a transformers config.json goes with --hf-config; "
                           "--model takes a preset name or a YAML file")
    if path.is_dir() and (path / "config.json").is_file():
        raise MemplanError(f"{name_or_path} is a model directory: its config.json goes with --hf-config "
                           f"{name_or_path}; --model takes a preset name or a YAML file")
    if path.suffix in (".yaml", ".yml"):
        if not path.exists():
            raise MemplanError(f"no such model file: {name_or_path}")
        return read_model_file(path)
    preset = configs_dir() / "models" / f"{name_or_path}.yaml"
    hf = configs_dir() / "traced" / name_or_path / "config.json"
    if not preset.is_file() and hf.is_file() and "/" not in name_or_path:
        read = read_hf_config(str(hf))
        read = dataclasses.replace(read, model=read.model.model_copy(update={"name": name_or_path}))
        plan = hf.parent / "plan.yaml"
        return with_plan(read, plan) if plan.is_file() else read
    if not preset.is_file():
        raise MemplanError(f"unknown model preset '{name_or_path}'; known: {', '.join(model_names())}")
    return read_model_file(preset)


@lru_cache(maxsize=None)
def _preset_model(name: str) -> ModelSpec:
    return read_model_file(configs_dir() / "models" / f"{name}.yaml").model


def shipped_trace(model: ModelSpec, impl: str, kernels: str) -> Optional[Path]:
    """The traced inventory file shipped for a model YAML preset (configs/traced/<name>/<impl>-<kernels>.yaml in a
    directory without a config.json: the architecture is the preset's, configs/models/<name>.yaml; today llama3-8b's
    hf-sdpa cuda trace with its step's order), when `model` is that preset's architecture (every field but the
    sequence length the preset's) and names no inventory of its own; else None. Whether a plan uses it is the
    plan's to decide (memplan/plan/estimate.py `traced_default`)."""
    name = model.name
    if model.inventory is not None or not name or Path(name).name != name or name.startswith("."):
        return None
    path = configs_dir() / "traced" / name / file_name(impl, kernels)
    if (not path.is_file() or (path.parent / "config.json").is_file()
            or not (configs_dir() / "models" / f"{name}.yaml").is_file()):
        return None
    preset = _preset_model(name)
    if any(getattr(model, f) != getattr(preset, f) for f in type(model).model_fields if f != "seq_length"):
        return None
    return path


def load_gpu(name_or_path: str) -> GpuSpec:
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = configs_dir() / "gpus" / f"{name_or_path}.yaml"
        if not path.is_file():
            raise MemplanError(f"unknown GPU preset '{name_or_path}'; known: {', '.join(gpu_names())}")
    return build(GpuSpec, read_yaml(path), where=str(path))
