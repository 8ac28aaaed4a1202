"""Model and GPU preset files read as data: where configs/ is, the bounded text and YAML readers, a model file
(`ModelPreset`) and a traced preset's published plan.

A model file holds `model:` (the architecture, a ModelSpec) and optionally the plan it was
trained with (`parallel:`, `training:`) and the GPU it ran on (`gpu:`). A user's own file has the
same shape. Unknown or mistyped keys are refused with the key and the file named.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from memplan.core.datafile import read_yaml
from memplan.core.errors import MemplanError
from memplan.core.model import ModelSpec
from memplan.core.spec_base import build, echo
from memplan.core.specs import ParallelSpec
from memplan.core.training import TrainingSpec


def configs_dir() -> Path:
    """The presets: $MEMPLAN_CONFIGS, else configs/ of the checkout (editable installs, tests), else
    the copy a wheel installs beside the package (memplan/_configs, see pyproject.toml)."""
    env = os.environ.get("MEMPLAN_CONFIGS")
    if env:
        if not (Path(env) / "models").is_dir() or not (Path(env) / "gpus").is_dir():
            raise MemplanError(f"MEMPLAN_CONFIGS={env[:200]!r} is not a presets directory (it needs models/ and "
                               "gpus/); unset it to use memplan's own")
        return Path(env)
    package = Path(__file__).resolve().parent.parent  # memplan/ (this file is memplan/presets/files.py)
    checkout = package.parent / "configs"
    return checkout if (checkout / "models").is_dir() else package / "_configs"


@dataclass(frozen=True)
class ModelPreset:
    """A model and the plan it comes with (dicts, merged with overrides before building)."""

    model: ModelSpec
    parallel: dict[str, Any] = field(default_factory=dict)
    training: dict[str, Any] = field(default_factory=dict)
    gpu: Optional[str] = None
    source: str = ""
    notes: tuple[str, ...] = ()  # what the reader chose for the user (e.g. where s came from)


_PRESET_KEYS = {"model", "parallel", "training", "gpu"}


def read_model_file(path: Path) -> ModelPreset:
    data = read_yaml(path)
    unknown = sorted(set(data) - _PRESET_KEYS)
    if unknown:
        raise MemplanError(f"{path}: unknown field '{unknown[0]}' (expected {', '.join(sorted(_PRESET_KEYS))})")
    if "model" not in data:
        raise MemplanError(f"{path}: missing the 'model:' section")
    model = build(ModelSpec, data["model"], where=f"{path}: model")
    return ModelPreset(model, *_plan_sections(data, path), str(path))


def _plan_sections(data: dict, path: Path) -> tuple[dict, dict, Optional[str]]:
    """A model file's plan (`parallel:`, `training:`, `gpu:`), its keys checked now, so a typo names this file
    rather than surfacing later."""
    parallel = data.get("parallel") or {}
    training = data.get("training") or {}
    for name, section in (("parallel", parallel), ("training", training)):
        if not isinstance(section, dict):
            raise MemplanError(f"{path}: '{name}' must be a mapping of settings")
    build(ParallelSpec, parallel, where=f"{path}: parallel")
    build(TrainingSpec, training, where=f"{path}: training")
    gpu = data.get("gpu")
    if gpu is not None and not isinstance(gpu, str):
        raise MemplanError(f"{path}: gpu: expected a GPU preset name or a YAML file (got {echo(gpu)}); "
                           f"known: {', '.join(gpu_names())}")
    return dict(parallel), dict(training), gpu


def with_plan(preset: ModelPreset, path: Path) -> ModelPreset:
    """A traced preset (configs/traced/<name>/config.json) with the plan it was published with, when its
    directory has one (plan.yaml: `parallel:`, `training:`, `gpu:` as a model file's, and `model:` overrides of
    what the config.json does not say, such as the training sequence length)."""
    data = read_yaml(path)
    unknown = sorted(set(data) - _PRESET_KEYS)
    if unknown:
        raise MemplanError(f"{path}: unknown field '{unknown[0]}' (expected {', '.join(sorted(_PRESET_KEYS))})")
    model = preset.model
    if data.get("model"):
        if not isinstance(data["model"], dict):
            raise MemplanError(f"{path}: 'model' must be a mapping of settings")
        model = build(ModelSpec, {**model.model_dump(exclude_defaults=True), **data["model"]},
                      where=f"{path}: model")
    notes = tuple(n for n in preset.notes if not n.startswith("s = ")) if "seq_length" in (data.get("model") or {}) \
        else preset.notes
    return ModelPreset(model, *_plan_sections(data, path), f"{preset.source} + {path}", notes)


def gpu_names() -> list[str]:
    return sorted(p.stem for p in (configs_dir() / "gpus").glob("*.yaml"))
