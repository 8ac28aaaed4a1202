"""A family's own parameter tensors beside those ModelSpec's other fields describe (``ExtraTensor``): RoCBERT's
pronunciation and shape tables, X-MOD's per-language adapters, XLM's language embeddings, ... (issue 22:
memplan/presets/hf_encoders.py reads them from a config.json). Each is named, lives on the first stage, in every
layer or on the last stage, and is counted whole on every GPU (not split by tensor parallelism); what such a family
saves in its forward is traced from transformers' code (--impl hf-*), not described here."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, PositiveInt

from memplan.core.spec_base import Spec


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


def check_extra_tensors(extras: tuple[ExtraTensor, ...]) -> None:
    """One group per name: two extra tensors of one name would be two groups the reports cannot tell apart."""
    names = [x.name for x in extras]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"extra_tensors: the name {name!r} is given twice (give one entry with its count)")
