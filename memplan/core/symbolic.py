"""Polynomials in the K22 symbols (a, s, b, h, f, g, v, t, ...; q the attention width), exact and printable.

A size such as 5as^2b or sbh(10 + 24/t) is a sum of monomials with rational
coefficients. The same object gives the number (for Python ints or numpy int64
arrays alike, by exact integer arithmetic) and the text K22 would print.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Mapping

from memplan.core.errors import MemplanError

# Display order of the symbols, as K22 writes them: "5as^2b", "34sbh", "sbhL/t".
ORDER = ("a", "s", "b", "h", "q", "f", "g", "v", "L", "p", "t")

Monomial = tuple[tuple[str, int], ...]  # sorted (symbol, power) pairs, power != 0

# Bounds on what a parsed size may say (sizes come from files: an `s^100000000` or a coefficient of `1e99999999`
# must be refused, not evaluated): real sizes have powers of at most 3 and coefficients of a few digits.
MAX_POWER = 16
MAX_COEF_CHARS = 40
_COEF = re.compile(r"-?[0-9]+(\.[0-9]+)?(/[0-9]+)?")  # a fitted trace's constant may be negative


def _canon(powers: Mapping[str, int]) -> Monomial:
    return tuple(sorted(((k, v) for k, v in powers.items() if v), key=lambda kv: _rank(kv[0])))


def _rank(sym: str) -> tuple[int, str]:
    return (ORDER.index(sym) if sym in ORDER else len(ORDER), sym)


@dataclass(frozen=True)
class Poly:
    """A sum of monomials: {monomial: coefficient}.

    A Poly is immutable, so what is derived from it (its product with a number, the integer form
    `evaluate` runs) is computed once and kept in the instance (`_derived`, outside the dataclass
    fields: equality, hashing and printing see only `terms`)."""

    terms: tuple[tuple[Monomial, Fraction], ...]

    def _memo(self) -> dict:
        memo = self.__dict__.get("_derived")
        if memo is None:
            memo = self.__dict__["_derived"] = {}
        return memo

    # -- construction ---------------------------------------------------------------------
    @staticmethod
    @functools.lru_cache(maxsize=4096)
    def parse(text: str) -> "Poly":
        """Parse a product such as '2 s b h', 'a s^2 b', 's b h g /a', '1/2 s b', '-4096 b'."""
        coef = Fraction(1)
        powers: dict[str, int] = {}
        for token in text.split():
            divide = token.startswith("/")
            token = token.lstrip("/")
            if token[0].isdigit() or token[0] == "-" and token[1:2].isdigit():
                if len(token) > MAX_COEF_CHARS or not _COEF.fullmatch(token):
                    raise MemplanError(f"coefficient {token[:40]!r}: a decimal or fraction of at most "
                                       f"{MAX_COEF_CHARS} digits")
                value = Fraction(token)
                coef = coef / value if divide else coef * value
                continue
            sym, _, power = token.partition("^")
            if power and not (power.isascii() and power.isdigit() and int(power) <= MAX_POWER):
                raise MemplanError(f"power {token[:40]!r}: a symbol's power is a whole number from 1 to {MAX_POWER}")
            p = int(power) if power else 1
            powers[sym] = powers.get(sym, 0) + (-p if divide else p)
            if abs(powers[sym]) > MAX_POWER:
                raise MemplanError(f"{sym}^{powers[sym]}: a symbol's power is at most {MAX_POWER}")
        return Poly(((_canon(powers), coef),)).simplified()

    @staticmethod
    @functools.lru_cache(maxsize=4096)
    def parse_sum(text: str) -> "Poly":
        """Parse a sum of products: 's b h + s b h g /a'."""
        total = Poly(())
        for part in text.split("+"):
            total = total + Poly.parse(part)
        return total

    def simplified(self) -> "Poly":
        acc: dict[Monomial, Fraction] = {}
        for mono, coef in self.terms:
            acc[mono] = acc.get(mono, Fraction(0)) + coef
        return Poly(tuple((m, c) for m, c in acc.items() if c != 0))

    # -- algebra ----------------------------------------------------------------------------
    def __add__(self, other: "Poly") -> "Poly":
        return Poly(self.terms + other.terms).simplified()

    def __mul__(self, other: "Poly | int | Fraction") -> "Poly":
        if not isinstance(other, Poly):
            key = ("scaled", other)
            memo = self._memo()
            if key not in memo:
                memo[key] = Poly(tuple((m, c * Fraction(other)) for m, c in self.terms)).simplified()
            return memo[key]
        out = []
        for m1, c1 in self.terms:
            for m2, c2 in other.terms:
                powers = dict(m1)
                for sym, p in m2:
                    powers[sym] = powers.get(sym, 0) + p
                out.append((_canon(powers), c1 * c2))
        return Poly(tuple(out)).simplified()

    __rmul__ = __mul__

    def divide_by(self, symbol: str) -> "Poly":
        return self * Poly.parse(f"/{symbol}")

    def substitute(self, symbol: str, value: "Poly") -> "Poly":
        """Replace a symbol that appears with non-negative powers by a polynomial."""
        total = Poly(())
        for mono, coef in self.terms:
            rest = {k: v for k, v in mono if k != symbol}
            power = dict(mono).get(symbol, 0)
            if power < 0:
                raise ValueError(f"cannot substitute {symbol} with a negative power")
            piece = Poly(((_canon(rest), coef),))
            for _ in range(power):
                piece = piece * value
            total = total + piece
        return total

    def assign(self, symbol: str, value: int) -> "Poly":
        """Give one symbol a number (e.g. t = 1 when there is no tensor parallelism)."""
        out = []
        for mono, coef in self.terms:
            power = dict(mono).get(symbol, 0)
            rest = tuple((k, v) for k, v in mono if k != symbol)
            out.append((rest, coef * Fraction(value) ** power))
        return Poly(tuple(out)).simplified()

    def rename(self, symbol: str, other: str) -> "Poly":
        """Replace one symbol by another (e.g. g by a when a model has as many K/V heads as heads)."""
        out = []
        for mono, coef in self.terms:
            powers: dict[str, int] = {}
            for sym, p in mono:
                key = other if sym == symbol else sym
                powers[key] = powers.get(key, 0) + p
            out.append((_canon(powers), coef))
        return Poly(tuple(out)).simplified()

    @property
    def is_zero(self) -> bool:
        return not self.terms

    # -- evaluation -------------------------------------------------------------------------
    def evaluate(self, values: Mapping[str, Any]) -> Any:
        """Exact value for ints or int64 numpy arrays (each monomial divides exactly when the
        spec's divisibility checks hold; otherwise it is floored): the sum over monomials of
        coefficient numerator x positive powers // (denominator x negative powers)."""
        total: Any = 0
        for num_coef, num_syms, den_coef, den_syms in self._compiled():
            num: Any = num_coef
            for sym in num_syms:  # a power p is its symbol p times: no `** 1` on arrays
                num = num * values[sym]
            if den_coef == 1 and not den_syms:  # nothing to divide by
                total = total + num
                continue
            den: Any = den_coef
            for sym in den_syms:
                den = den * values[sym]
            total = total + num // den
        return total

    def _compiled(self) -> tuple[tuple[int, tuple[str, ...], int, tuple[str, ...]], ...]:
        """Each monomial as (numerator, symbols to multiply it by, denominator, symbols to multiply
        that by), Python ints and names, built once."""
        memo = self._memo()
        if "compiled" not in memo:
            memo["compiled"] = tuple(
                (coef.numerator, tuple(sym for sym, p in mono if p > 0 for _ in range(p)),
                 coef.denominator, tuple(sym for sym, p in mono if p < 0 for _ in range(-p)))
                for mono, coef in self.terms)
        return memo["compiled"]

    # -- text -------------------------------------------------------------------------------
    def text(self) -> str:
        """'34sbh + 5as^2b' style text."""
        if not self.terms:
            return "0"
        parts = [_mono_text(m, c) for m, c in sorted(self.terms, key=sort_key)]
        return " + ".join(parts).replace("+ -", "- ")

    def factored(self, common: str = "s b h") -> str:
        """'sbh(34 + 5as/h)' style text: the sum with a common monomial factored out."""
        factor = Poly.parse(common)
        if len(self.terms) < 2:
            return self.text()
        inner = self * Poly.parse(" ".join(f"/{tok}" for tok in common.split()))
        # Factor only when every term keeps the factor whole or reads as a ratio (K22's 5as/h, 4f/h);
        # small per-token terms (16sb) read better outside: '34sbh + 16sb', not 'sbh(34 + 16/h)'.
        for mono, _ in inner.terms:
            powers = dict(mono)
            if any(p < 0 for k, p in powers.items() if k in ("s", "b")) or (
                    powers.get("h", 0) < 0 and not any(p > 0 for p in powers.values())):
                return self.text()
        return f"{_mono_text(factor.terms[0][0], Fraction(1))}({inner.text()})"


def sort_key(item: tuple[Monomial, Fraction]) -> tuple:
    mono, coef = item
    neg = sum(-p for _, p in mono if p < 0)
    pos = sum(p for _, p in mono if p > 0)
    syms = {s for s, p in mono if p > 0}
    per_token = bool(syms & {"s", "b"}) and not (syms & {"h", "q", "f", "a", "v"})  # sb terms go last
    return (per_token, pos + neg, pos, tuple(_rank(s) for s, _ in mono))


def _sym_text(sym: str, p: int) -> str:
    return sym if p == 1 else f"{sym}^{p}"


def _mono_text(mono: Monomial, coef: Fraction) -> str:
    num = "".join(_sym_text(s, p) for s, p in mono if p > 0)
    den = "".join(_sym_text(s, -p) for s, p in mono if p < 0)
    n, d = coef.numerator, coef.denominator
    lead = "" if (n == 1 and num) else ("-" if (n == -1 and num) else str(n))
    top = f"{lead}{num}" or "1"
    if d != 1:
        den = f"{d}{den}"
    if not den:
        return top
    bottom = den if len(den) == 1 else f"({den})"
    return f"{top}/{bottom}"
