"""The only place where byte and token counts are parsed from and formatted to text.

Bytes are Python ints (or int64 numpy arrays) everywhere else. GB means 10^9
bytes, GiB means 2^30 bytes; a size without a unit is refused, because
"80" could mean either.
"""

from __future__ import annotations

import re

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

_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]+)\s*$")


def parse_size(text: str) -> int:
    """Parse '80GB', '80 GiB', '1.5TB', '512MiB' into bytes (an int)."""
    match = _SIZE.match(str(text))
    if not match:
        raise MemplanError(
            f"cannot read size {text!r}: give a number and a unit, e.g. 80GB (10^9 bytes) or 80GiB (2^30 bytes)"
        )
    number, unit = match.groups()
    if unit.endswith("b") and unit != "b":
        raise MemplanError(f"{text!r} reads as {unit[:-1]}bits; memory is in bytes: write {number}{unit[:-1].upper()}B "
                           f"(10^n bytes) or {number}{unit[:-1].upper()}iB (2^n bytes)")
    factor = UNITS.get(unit.upper())
    if factor is None:
        raise MemplanError(f"unknown unit {unit!r} in {text!r}: use one of {', '.join(_display_units())}")
    return round(float(number) * factor)


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
        raise MemplanError(f"cannot read token count {text!r}: give a number, optionally with K, M, B (10^3, 10^6, "
                           f"10^9) or Ki, Mi, Gi (2^10, 2^20, 2^30), e.g. 4M or 4Mi")
    count = round(float(match.group(1).replace(",", "").replace("_", "")) * factor)
    if count <= 0:
        raise MemplanError(f"a token count must be positive (got {text!r})")
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
