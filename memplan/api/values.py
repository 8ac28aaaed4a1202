"""Option values as the API and the CLI read them: memory sizes, token counts, --mst, and the checks of --emit
that need no model. Light (core.units and core.errors only): the CLI's option callbacks use it."""

from __future__ import annotations

from typing import Optional, Union

from memplan.core.errors import MemplanError
from memplan.core.units import parse_size, parse_tokens

Size = Union[int, str, None]


def budget_bytes(value: Size, what: str) -> Optional[int]:
    """A memory budget: an int in bytes or a size such as "80GB" (10^9 bytes) / "80GiB" (2^30 bytes); positive."""
    if value is None:
        return None
    size = value if isinstance(value, int) and not isinstance(value, bool) else parse_size(value)
    if size <= 0:
        raise MemplanError(f"{what}: a memory budget must be positive (got {value!r})")
    return size


def token_count(value: Union[int, str, None]) -> Optional[int]:
    """A token count: an int, or text such as "4M" (4 x 10^6) or "4Mi" (4 x 2^20)."""
    if value is None:
        return None
    return parse_tokens(str(value))


def mst_pieces(value: Union[int, str, None]) -> Union[int, str, None]:
    """--mst: a number of mini-sequences >= 1, or "auto"."""
    if value is None:
        return None
    text = str(value).strip().lower()
    if text != "auto" and not (text.isdigit() and int(text) >= 1):
        raise MemplanError(f"--mst takes a number of mini-sequences >= 1 or 'auto', not {value!r}")
    return text if text == "auto" else int(text)


def check_emit(emit: Optional[str], mst: Union[int, str, None], impl: str) -> None:
    """Refuse an --emit that cannot give a launch block for this plan, before any work."""
    if emit and mst not in (None, 1):
        raise MemplanError("--emit megatron cannot express --mst: Megatron-LM has no mini-sequence MLP / LM head "
                           "(MsT is modelled for transformers models, --impl hf-*)")
    if emit and impl != "megatron":
        raise MemplanError(f"--emit megatron launches Megatron-LM: plan it with --impl megatron (got --impl "
                           f"{impl}, whose memory differs)")
