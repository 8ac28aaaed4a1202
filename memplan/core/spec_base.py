"""The base every spec builds on: a frozen, strict pydantic model that rejects unknown keys, and the
one-line messages its validation errors become (`build`, `describe_validation_error`, `echo`)."""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from memplan.core.errors import MemplanError


def echo(value: Any, limit: int = 60) -> str:
    """A user's value for an error message, bounded (a YAML alias bomb must not print gigabytes)."""
    text = repr(value) if not isinstance(value, (dict, list, tuple)) else f"a {type(value).__name__}"
    return text if len(text) <= limit else text[:limit] + "..."


class Spec(BaseModel):
    # strict: `hidden_size: true` or `num_layers: 2.5` is refused rather than coerced (to 1, to 2)
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _sequences_as_tuples(cls, data: Any) -> Any:
        """A YAML or JSON file (and a spec's model_dump written to one) gives a sequence as a list; strict mode takes
        only tuples for the tuple fields (extra_tensors, embedding_widths, mla_indexer, ...): the list is taken as one."""
        if not isinstance(data, dict):
            return data
        fields = _TUPLE_FIELDS.get(cls)
        if fields is None:
            fields = _TUPLE_FIELDS[cls] = frozenset(n for n, f in cls.model_fields.items() if "tuple" in str(f.annotation))
        return {k: tuple(v) if k in fields and isinstance(v, list) else v for k, v in data.items()}


_TUPLE_FIELDS: dict[type, frozenset[str]] = {}  # per spec class: its fields annotated as tuples


def describe_validation_error(err: ValidationError, where: str = "", known: tuple[str, ...] = ()) -> str:
    """One line from a pydantic error: the first problem (unknown keys first), naming its field
    (and file), with the closest known field name for a typo."""
    errors = sorted(err.errors(), key=lambda e: e["type"] != "extra_forbidden")
    first = errors[0]
    loc = ".".join(str(p) for p in first["loc"])
    prefix = f"{where}: " if where else ""
    if first["type"] == "extra_forbidden":
        close = difflib.get_close_matches(str(first["loc"][-1]), known, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close and len(first["loc"]) == 1 else ""
        return f"{prefix}unknown field '{loc}'{hint}"
    msg = first["msg"].removeprefix("Value error, ")
    if loc:
        given = first.get("input")
        shown = f" (got {echo(given)})" if not isinstance(given, dict) and given is not None and "(got " not in msg \
            else ""
        return f"{prefix}{loc}: {msg}{shown}"
    return f"{prefix}{msg}"


def build(cls: type[Spec], data: dict, where: str = "") -> Any:
    """Build a spec, turning validation errors into one-line MemplanErrors."""
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise MemplanError(describe_validation_error(err, where, tuple(cls.model_fields))) from None
