"""The only place where byte and token counts are parsed from and formatted to text.

Bytes are Python ints (or int64 numpy arrays) everywhere else. GB means 10^9
bytes, GiB means 2^30 bytes; a size without a unit is refused, because
"80" could mean either.
"""

from __future__ import annotations

import re
from fractions import Fraction

from memplan.core.errors import MemplanError

UNITS: dict[str, int] = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}

# The largest size or count memplan reads (1 EiB; 2^60 tokens): far above any machine, and far enough below 2^63
# that sums of a few such figures stay exact in int64 arithmetic. Numbers are parsed exactly (no float), and at most
# MAX_DIGITS characters long, so "1" followed by 500 zeros is refused in microseconds.
MAX_BYTES = 2**60
MAX_DIGITS = 40


def exact_number(text: str, what: str) -> Fraction:
    """A decimal number's text ('80', '1.5', '.5'; ASCII digits only, at most MAX_DIGITS characters) read exactly."""
    if len(text) > MAX_DIGITS:
        raise MemplanError(f"cannot read {what} {text[:20]!r}...: more than {MAX_DIGITS} digits")
    return Fraction(text)


def _shown(text: object) -> str:
    """A user's text in an error message: quoted, bounded."""
    text = str(text)
    return repr(text) if len(text) <= 40 else repr(text[:40]) + "..."


def check_bytes(n: int, text: object) -> int:
    """A byte count no larger than MAX_BYTES (budgets and GPU sizes above 2^63 B would wrap in int64 arithmetic)."""
    if n > MAX_BYTES:
        raise MemplanError(f"{_shown(text)}: more than {MAX_BYTES:,} B (1 EiB), the most memplan plans for")
    return n


_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]+)\s*$")


def parse_size(text: str) -> int:
    """Parse '80GB', '80 GiB', '1.5TB', '512MiB' into bytes (an int)."""
    match = _SIZE.match(str(text))
    if not match:
        raise MemplanError(
            f"cannot read size {_shown(text)}: give a number and a unit, e.g. 80GB (10^9 bytes) or 80GiB (2^30 bytes)"
        )
    number, unit = match.groups()
    exact = exact_number(number, "size")
    if unit == "b":
        raise MemplanError(f"{_shown(text)} is ambiguous (bits or bytes?): write {number}B for bytes")
    if unit.endswith("b"):
        raise MemplanError(f"{_shown(text)} reads as {unit[:-1]}bits; memory is in bytes: write {number}{unit[:-1].upper()}B "
                           f"(10^n bytes) or {number}{unit[:-1].upper()}iB (2^n bytes)")
    factor = UNITS.get(unit.upper())
    if factor is None:
        raise MemplanError(f"unknown unit {unit!r} in {_shown(text)}: use one of {', '.join(_display_units())}")
    return check_bytes(round(exact * factor), text)


TOKEN_UNITS: dict[str, int] = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9,
                               "KI": 2**10, "MI": 2**20, "GI": 2**30}
_COUNT = re.compile(r"^\s*([0-9][0-9_,]*(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")


def parse_tokens(text: str) -> int:
    """Parse a token count: '4194304', '4,194,304', '4M' (10^6), '4Mi' (2^20), '0.5B'; an optional
    trailing 'tokens' is allowed ('4M tokens')."""
    cleaned = re.sub(r"\s*tokens?\s*$", "", str(text), flags=re.IGNORECASE)
    match = _COUNT.match(cleaned)
    factor = TOKEN_UNITS.get(match.group(2).upper()) if match else None
    if match is None or factor is None:
        raise MemplanError(f"cannot read token count {_shown(text)}: give a number, optionally with K, M, B (10^3, 10^6, "
                           f"10^9) or Ki, Mi, Gi (2^10, 2^20, 2^30), e.g. 4M or 4Mi")
    count = round(exact_number(match.group(1).replace(",", "").replace("_", ""), "token count") * factor)
    if count <= 0:
        raise MemplanError(f"a token count must be positive (got {_shown(text)})")
    if count > MAX_BYTES:
        raise MemplanError(f"a token count of more than 2^60 ({_shown(text)}) is not a training step")
    return count


def format_batch(sequences: int, seq_length: int) -> str:
    """A global batch with both units: '512 sequences = 4.19 M tokens'."""
    tokens = sequences * seq_length
    return f"{sequences:,} sequence{'s' if sequences != 1 else ''} = " + (f"{tokens / 1e6:,.2f} M tokens" if tokens >= 10**6 else f"{tokens:,} tokens")


def _display_units() -> list[str]:
    return [u if u in ("B",) else u.replace("IB", "iB") for u in UNITS]


def format_bytes(n: int | float, unit: str = "GB", digits: int = 2) -> str:
    """Format a byte count in a fixed unit, e.g. format_bytes(80e9) == '80.00 GB'."""
    factor = UNITS[unit.upper()]
    return f"{n / factor:,.{digits}f} {unit}"


def format_bytes_auto(n: int | float, binary: bool = False) -> str:
    """Format with the largest decimal (or binary) unit that keeps the number >= 1."""
    units = ["TiB", "GiB", "MiB", "KiB"] if binary else ["TB", "GB", "MB", "KB"]
    for unit in units:
        if abs(n) >= UNITS[unit.upper()]:
            return format_bytes(n, unit)
    return f"{int(n):,} B"


def format_flops(n: float) -> str:
    """Format a FLOP/s figure in TFLOP/s."""
    return f"{n / 1e12:,.1f} TFLOP/s"
