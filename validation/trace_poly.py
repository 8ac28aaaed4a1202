"""Sizes of a symbolic trace as exact polynomials in s and b: the ShapeEnv's guards checked (``check_guards``: a
trace that pinned s or b is refused, ``TraceRefused``), a saved storage's size as a polynomial
(``as_poly_expr``, ``exact_divisions``), the polynomials' text in memplan's ``Poly`` syntax (``poly_text``) and its
value (``evaluate``)."""

from __future__ import annotations

import math
import re
from fractions import Fraction
from functools import lru_cache

import sympy
import torch


class TraceRefused(RuntimeError):
    """The trace does not describe every (s, b): a size was specialised or is not a polynomial."""



def merge_divisibility(conditions: list[str]) -> list[str]:
    """Conditions once each; ``s % 8 == 0`` and ``s % 32 == 0`` as ``s % 32 == 0``."""
    out: list[str] = []
    moduli: dict[str, int] = {}
    for c in conditions:
        m = re.fullmatch(r"(\w+) % (\d+) == 0", c)
        if m:
            sym, n = m.group(1), int(m.group(2))
            moduli[sym] = math.lcm(moduli.get(sym, 1), n)
            c = f"{sym} % == 0"  # placeholder at the first position of this symbol's condition
        if c not in out:
            out.append(c)
    return [f"{c.split()[0]} % {moduli[c.split()[0]]} == 0" if c.endswith(" % == 0") else c for c in out]


def sym_expr(x) -> sympy.Expr:
    """A size as a sympy expression, with what ``torch._check`` told the ShapeEnv of a size that depends on data
    (X-MOD's language adapters: validation/trace_saves.py ``_language_adapters``): its replacements (u0 -> b) and
    the checked constants (u1 == 0, an assertion the ShapeEnv keeps without replacing a size by 0)."""
    if isinstance(x, torch.SymInt):
        env = x.node.shape_env
        expr = env.replace(x.node.expr)
        checked = {u: e.rhs if e.lhs == u else e.lhs for u in expr.free_symbols
                   for e in (a.expr for a in env.deferred_runtime_asserts.get(u, ()))
                   if isinstance(e, sympy.Eq) and u in (e.lhs, e.rhs) and (e.rhs if e.lhs == u else e.lhs).is_Integer}
        return expr.xreplace(checked)
    return sympy.Integer(int(x))


def exact_divisions(expr: sympy.Expr, conditions: list[str]) -> sympy.Expr:
    """``CeilToInt(IntTrueDiv(s, 32))``, ``FloorDiv(s, 32)`` -> ``s/32`` with the condition
    ``s % 32 == 0`` (a kernel that pads s to a multiple of 32: exact for such s, an under-estimate
    of at most one block otherwise)."""
    if not expr.args:
        return expr
    name = type(expr).__name__
    inner = None
    if name in ("CeilToInt", "FloorToInt") and type(expr.args[0]).__name__ == "IntTrueDiv":
        inner = expr.args[0].args
    elif name in ("FloorDiv", "CleanDiv", "IntTrueDiv"):
        inner = expr.args
    if inner is not None:
        x, n = (exact_divisions(a, conditions) for a in inner)
        if n.is_Integer and x.is_Symbol:
            conditions.append(f"{x} % {n} == 0")
            return x / n
    return expr.func(*(exact_divisions(a, conditions) for a in expr.args))


def as_poly_expr(nbytes, named: dict, st: dict, conditions: list[str]) -> sympy.Expr:
    expr = sympy.expand(exact_divisions(sym_expr(nbytes).xreplace(named), conditions))
    allowed = set().union(*(v.free_symbols for v in named.values()))  # s and b (s / m: trace_run's s_multiple)
    where = f"{st['module'] or '<model>'}: {st['op']} ({st['dtype']})"
    if not expr.free_symbols <= allowed:
        extra = sorted(map(str, expr.free_symbols - allowed))
        raise TraceRefused(f"the size of a saved tensor depends on data ({where}: {expr}; symbols {extra}, "
                           "e.g. MoE routing or nonzero): not a polynomial in s and b")
    try:
        poly = sympy.Poly(expr, *sorted(allowed, key=str))
    except sympy.PolynomialError:
        raise TraceRefused(f"the size of a saved tensor is not a polynomial in s and b ({where}: {expr})") from None
    if not all(c.is_Rational for c in poly.coeffs()):
        raise TraceRefused(f"non-rational coefficient in the size of a saved tensor ({where}: {expr})")
    return expr


def check_guards(env, symbols: dict, scale: dict | None = None) -> list[str]:
    """Refuse a trace that pinned s or b; return the conditions it holds under: the ranges of s and
    b the guards left (``s >= 2``; ``s >= 4096`` after a sliding window's ``kv_length >= window``)
    and any other guard on them, as text in s and b; ``scale``: a symbol's multiple of the ShapeEnv's own (s = m c:
    trace_run's s_multiple)."""
    scale = scale or {}
    names = {sym: sympy.Symbol(n) / scale.get(n, 1) for sym, n in symbols.items()}
    pinned = []
    for sym, value in env.replacements.items():
        if sym in symbols:
            pinned.append(f"replacement {symbols[sym]} -> {value.xreplace(names)}")
    others = []
    for g in env.guards:
        free = g.expr.free_symbols & set(symbols)
        if not free:
            continue
        text = str(g.expr.xreplace(names))
        if isinstance(g.expr, sympy.Eq):
            pinned.append(f"guard {text} at {g.sloc}")
        elif len(g.expr.free_symbols) == 1 and isinstance(g.expr, (sympy.Ge, sympy.Gt, sympy.Le, sympy.Lt)):
            continue  # a bound of one symbol: in its range below
        else:
            others.append(text)
    ranges = []
    for sym, name in symbols.items():
        vr = env.var_to_range.get(sym)
        lo, hi = (vr.lower, vr.upper) if vr is not None else (2, None)
        if vr is not None and vr.lower == vr.upper:
            pinned.append(f"the range of {name} is [{vr.lower}, {vr.upper}]")
        m = scale.get(name, 1)
        ranges.append(f"{name} >= {lo * m}")
        if isinstance(hi, sympy.Integer) and hi < 2 ** 62:  # not int_oo, nor the int64 bound of an unbacked size
            # that a torch._check equated with b (X-MOD's adapters)
            ranges.append(f"{name} <= {hi * m}")
    if pinned:
        raise TraceRefused("the trace specialised the sequence length s or the micro-batch b, so its sizes hold "
                           "only for the traced values: " + "; ".join(pinned))
    return ranges + list(dict.fromkeys(others))

# ---------------------------------------------------------------------------------------------
# polynomials in memplan's Poly syntax




@lru_cache(maxsize=4096)
def poly_text(expr: sympy.Expr) -> str:
    """'12 s^2 b + 64 s b' for 12*s**2*b + 64*s*b (memplan's ``Poly.parse_sum`` syntax; cached: a trace writes
    the same few sizes many times)."""
    expr = sympy.expand(expr)
    if expr == 0:
        return "0"
    s, b = sympy.Symbol("s", integer=True, positive=True), sympy.Symbol("b", integer=True, positive=True)
    expr = expr.xreplace({x: (s if str(x) == "s" else b) for x in expr.free_symbols})
    poly = sympy.Poly(expr, s, b)
    parts = []
    for (ps, pb), coef in sorted(poly.terms(), key=lambda t: (-(t[0][0] + t[0][1]), -t[0][0])):
        c = Fraction(int(coef.p), int(coef.q))
        tokens = []
        if c.numerator != 1 or (ps == 0 and pb == 0):
            tokens.append(str(c.numerator))
        tokens += [f"s^{ps}" if ps > 1 else "s"] if ps else []
        tokens += [f"b^{pb}" if pb > 1 else "b"] if pb else []
        if c.denominator != 1:
            tokens.append(f"/{c.denominator}")
        parts.append(" ".join(tokens))
    return " + ".join(parts)


def evaluate(text: str, s: int, b: int) -> int:
    """A polynomial of an inventory file (memplan's ``Poly`` syntax) at (s, b), exactly.  Parsed
    here: validation/ never imports memplan."""
    total = Fraction(0)
    for product in text.split("+"):
        value = Fraction(1)
        for token in product.split():
            divide = token.startswith("/")
            token = token.lstrip("/")
            if token[0].isdigit() or token[0] == "-":  # a fitted constant may be negative ('-4096 b')
                factor = Fraction(token)
            else:
                sym, _, power = token.partition("^")
                factor = Fraction({"s": s, "b": b}[sym]) ** int(power or 1)
            value = value / factor if divide else value * factor
        total += value
    if total.denominator != 1:
        raise ValueError(f"{text} is not an integer at s={s}, b={b}")
    return int(total)


def symbolic_sizes(s_hint: int = 256, b_hint: int = 3) -> tuple:
    """A ShapeEnv with s and b symbolic: (env, {torch symbol: sympy s / b}, {"s": SymInt, "b": SymInt})."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    env = ShapeEnv(duck_shape=False)
    names, sizes = {}, {}
    for name, hint in (("s", s_hint), ("b", b_hint)):
        sym = env.create_symbol(hint, source=ConstantSource(f"memplan_{name}"), dynamic_dim=DimDynamic.DYNAMIC)
        names[sym] = sympy.Symbol(name, integer=True, positive=True)
        sizes[name] = env.create_symintnode(sym, hint=hint)
    return env, names, sizes
