"""Checks of ModelSpec's fields that involve one group of them alone, called by its validator (memplan/core/model.py):
a mixture-of-experts model's routing loads (moe_expert_loads) and multi-head latent attention's fields; and a
family's own parameter tensors (``ExtraTensor``, ModelSpec.extra_tensors), their type and check.

An extra tensor is one a family adds beside those ModelSpec's other fields describe: RoCBERT's pronunciation and shape
tables, X-MOD's per-language adapters, XLM's language embeddings, ... (issue 22: memplan/presets/hf_encoders.py and
hf_own_keys.py read them from a config.json). Each is named, lives on the first stage, in every layer or on the last
stage, and is counted whole on every GPU (not split by tensor parallelism); what such a family saves in its forward is
traced from transformers' code (--impl hf-*), not described here."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import AfterValidator, Field, PositiveInt

from memplan.core.spec_base import Spec

EXTRA_TENSORS = ("a family's own parameter tensors beside the other fields' (RoCBERT's pronunciation / shape tables, "
                 "X-MOD's adapters): core/spec_checks.py ExtraTensor")


class ExtraTensor(Spec):
    """``count`` parameter tensors of ``rows`` x ``cols`` (cols None: a vector of rows) named ``name``, in ``scope``:
    first (the embeddings' stage), layer (each layer) or last (the output head's stage)."""

    name: str = Field(min_length=1, max_length=80, description="the group's name (the tensors transformers names)")
    scope: Literal["first", "layer", "last"]
    rows: PositiveInt
    cols: Optional[PositiveInt] = None
    count: PositiveInt = 1

    @property
    def numel(self) -> int:
        """Its parameters, all ``count`` tensors together."""
        return self.rows * (self.cols or 1) * self.count


def _one_name_each(extras: tuple[ExtraTensor, ...]) -> tuple[ExtraTensor, ...]:
    """One group per name: two extra tensors of one name would be two groups the reports cannot tell apart."""
    names = [x.name for x in extras]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"extra_tensors: the name {name!r} is given twice (give one entry with its count)")
    return extras


ExtraTensors = Annotated[tuple[ExtraTensor, ...], AfterValidator(_one_name_each)]


def check_expert_loads(loads: Optional[tuple[float, ...]], imbalance: float, E: int, k: int) -> None:
    """moe_expert_loads: the loads of E/ep experts (a count dividing E), none negative or above E / k times the
    average (an expert receives each token at most once), in place of moe_imbalance."""
    if not loads or E % len(loads) or min(loads) < 0:
        raise ValueError(f"moe_expert_loads takes the loads of E/ep experts (a count dividing num_experts={E}), "
                         f"none negative (got {len(loads or ())})")
    if imbalance != 1.0:
        raise ValueError("moe_expert_loads and moe_imbalance both give the routing's imbalance: give one")
    if max(loads) > E / k:
        raise ValueError(f"moe_expert_loads: an expert's load {max(loads):g} x the average exceeds E / k = "
                         f"{E / k:g} (each token goes to an expert at most once)")


def check_latent(model: Any) -> None:
    """Multi-head latent attention's fields come together (kv_lora_rank and the three head widths; q_lora_rank
    optional), without biases (``model``: the ModelSpec being validated)."""
    fields = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    if not model.is_mla:
        given = [name for name in ("q_lora_rank",) + fields if getattr(model, name) is not None]
        if given:
            raise ValueError(f"{given[0]} is a multi-head latent attention field: it needs kv_lora_rank")
        return
    missing = [name for name in fields if getattr(model, name) is None]
    if missing:
        raise ValueError(f"kv_lora_rank={model.kv_lora_rank} (multi-head latent attention) needs {missing[0]}")
    if model.bias:
        raise ValueError("bias: memplan models multi-head latent attention without biases (DeepSeek-V3); set "
                         "bias: false")
