"""Saved tensors fitted from concrete traces, for code whose Python loop over s specialises a symbolic trace.

transformers' torch fallback of the chunked gated delta rule (``torch_chunk_gated_delta_rule``: Qwen3-Next, Qwen3.5,
OLMo-hybrid; ``chunk_kimi_delta_attention``: Kimi Linear, Bailing-hybrid) pads s to a multiple of its chunk (64) and
loops over the chunks in Python, so a symbolic s cannot run it (``range(num_chunks)`` pins the chunk count:
validation/trace.py refuses such a trace). ``fitted_run`` traces the model instead under FakeTensorMode at several
concrete (s, b), s multiples of the chunk (``POINTS``: s = 2, 3, 4 chunks, b = 2, 3), records what autograd saves as the
symbolic trace does (validation/trace_saves.py), groups the saved storages whose ids differ only in the counter k of
their op's call (``<module>.<op>#k.<j>``: the loop's iterations, and the other calls of that op in that module, summed),
fits each group's bytes as a polynomial in s and b with s^0..2 and b^0..1 (six terms, exactly determined by the six
points, rational arithmetic) and checks the fit at a held-out (s, b) (``HELD_OUT``: 5 chunks, b = 4): a group whose
bytes there differ from the polynomial's refuses the trace (``TraceRefused``). Its result has the shape of
``symbolic_run``'s (``storages`` with ``nbytes`` a sympy polynomial in s and b, ``conditions``), saved tensors only (no
backward, no moments), and its conditions say that the terms were fitted (memplan's estimate prints them with the
trace's origin)."""

from __future__ import annotations

import contextlib
from fractions import Fraction
from typing import Any, Callable, NamedTuple, Optional

import sympy
import torch

from .trace_cuda import SDPA_ORDER, CudaKernels
from .trace_poly import TraceRefused
from .trace_run import data_dependence_refused
from .trace_saves import Saves, eager_decisions, with_python_dispatcher

# the fitted terms s^i b^j and the points (in chunks of s, b) that determine them, and the point that checks them
MONOMIALS = ((0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1))
POINTS = tuple((c, b) for c in (2, 3, 4) for b in (2, 3))
HELD_OUT = (5, 4)


# the families whose code slices a buffer max_position_embeddings wide to s (GPT-Neo's and GPT-1's causal mask, MPT's
# ALiBi bias from max(0, max_seq_len - s)): a symbolic s cannot index it; fitted at s in steps of 16, any s
SLICED = ("gpt_neo", "openai-gpt", "mpt")
# the families whose torch path loops over s one token at a time in Python (RecurrentGemma's RG-LRU, _rnn_scan; RWKV's
# rwkv_linear_attention_cpu): fitted at s in steps of 4, any s
SCANNED = ("recurrent_gemma", "rwkv")


class Fit(NamedTuple):
    """How a config's saves are fitted: s in steps of ``step`` (1: traced symbolically), a multiple of it or not, from
    ``start`` on (the points are start + 2, 3, 4 steps; the held-out start + 5 steps), and why (the trace's
    conditions say it); ``overrides``: config fields the traced model is built with instead of the file's, and
    ``least`` the least s the fit then holds for (0: its least point), both said in the conditions."""
    step: int
    multiple: bool
    start: int = 0
    why: str = ""
    overrides: Optional[dict] = None
    least: int = 0


# the attention window a SCANNED family's model is traced with (its loop over s costs a few ms of CPU per token and
# layer: past a 2048-token window, a full-size trace would run for half an hour)
TRACED_WINDOW = 16


def fit_step(config: dict) -> Fit:
    """How a config's saves are fitted (``Fit``; step 1: traced symbolically). A gated DeltaNet
    (``linear_num_value_heads``, in the config or its text_config) or Kimi Delta Attention (``linear_num_heads``: Kimi
    Linear, Bailing-hybrid; chunk_kimi_delta_attention): the chunk its torch path pads s to and loops over (64, its
    default: no caller passes another); MiniMax's lightning attention: its block_size, s a multiple of it (a last
    block shorter saves less than a polynomial in s says); SLICED: steps of 16, any s; SCANNED: steps of 4, any s, from
    the attention window on (RecurrentGemma's local attention builds its sliding-window mask only for s past the
    window: the points are past it, where a training run's s is, so the mask's s^2 b is in the fit). A window wider
    than TRACED_WINDOW is traced at TRACED_WINDOW: past the window, transformers' sliding-window mask is b x s x s
    whatever its width, and nothing else of the model depends on it (tests/test_recurrent.py: a 64-token window's
    model traced at 16 equals its real CPU run); the fit then holds from the file's window on."""
    text = config.get("text_config")
    if any(key in config or isinstance(text, dict) and key in text
           for key in ("linear_num_value_heads", "linear_num_heads")):
        return Fit(64, True, 0, "the chunked loop over s runs in Python")
    if config.get("model_type") == "minimax":  # the lightning attention's loop over blocks of s (MiniMaxConfig's 256)
        block = config.get("block_size", 256)
        return Fit(block if isinstance(block, int) and block > 0 else 256, True, 0,
                   "the lightning attention's loop over blocks of s runs in Python")
    if config.get("model_type") in SCANNED:
        why = "the recurrence's loop over s runs in Python, a token at a time"
        window = config.get("attention_window_size", 0) if config.get("model_type") == "recurrent_gemma" else 0
        if not isinstance(window, int) or window <= TRACED_WINDOW:
            return Fit(4, False, max(window, 0) if isinstance(window, int) else 0, why)
        return Fit(4, False, TRACED_WINDOW, f"{why}; the model traced with attention_window_size {TRACED_WINDOW}, not "
                   f"{window}: past the window the saves do not depend on its width",
                   {"attention_window_size": TRACED_WINDOW}, window + 1)
    return Fit(16, False, 0, "a buffer sliced to s") if config.get("model_type") in SLICED else Fit(1, False)


def concrete_saves(model: torch.nn.Module, mode: Any, forward: Callable[..., torch.Tensor],
                   make_inputs: Callable[[int, int], tuple], s: int, b: int, python_dispatcher: bool = True,
                   kernels: str = "cpu", sdpa: tuple[str, ...] = SDPA_ORDER,
                   assumed: list[str] | None = None) -> list[dict]:
    """What one forward + loss of ``model`` (built in the FakeTensorMode ``mode``, no ShapeEnv) saves at a concrete
    (s, b): ``Saves.storages``, ``nbytes`` an int; the same set-up as trace_run's symbolic run (``assumed`` receives
    the CUDA kernels' emulation's assumptions)."""
    cuda = CudaKernels({}, sdpa) if kernels == "cuda" else None
    with mode:
        saves = Saves(model)
        with eager_decisions(), saves.recording(aten=True):
            with with_python_dispatcher(python_dispatcher, cuda.overrides() if cuda else None), \
                    (cuda.norm_stats() if cuda else contextlib.nullcontext()), data_dependence_refused():
                loss = forward(model, *make_inputs(s, b))
                del loss
    if cuda is not None and assumed is not None:
        assumed += [c for c in cuda.assumed if c not in assumed]
    return [dict(st, nbytes=int(st["nbytes"])) for st in saves.storages()]


def _grouped(storages: list[dict]) -> dict[tuple, dict]:
    """The storages by their id without the call counter k (module, op, j, dtype, the modules that save it): the
    first one's fields (its k, its place in the order of saves) with the group's bytes summed."""
    out: dict[tuple, dict] = {}
    for st in storages:
        key = (st["module"], st["op"], st["j"], str(st["dtype"]), tuple(sorted(st["savers"])))
        if key in out:
            out[key]["nbytes"] += st["nbytes"]
        else:
            out[key] = {k: v for k, v in st.items() if k != "key"} | {"nbytes": st["nbytes"]}
    return out


def fit(values: dict[tuple[int, int], int]) -> dict[tuple[int, int], Fraction]:
    """The coefficients of MONOMIALS through the six (s, b) -> bytes of ``values`` (exact, rational)."""
    points = list(values)
    rows = [[Fraction(s ** i * b ** j) for i, j in MONOMIALS] + [Fraction(values[(s, b)])] for s, b in points]
    n = len(MONOMIALS)
    for col in range(n):  # Gauss-Jordan elimination over the rationals
        pivot = next(r for r in range(col, n) if rows[r][col] != 0)
        rows[col], rows[pivot] = rows[pivot], rows[col]
        rows[col] = [x / rows[col][col] for x in rows[col]]
        for r in range(n):
            if r != col and rows[r][col] != 0:
                rows[r] = [x - rows[r][col] * y for x, y in zip(rows[r], rows[col])]
    return {m: rows[k][n] for k, m in enumerate(MONOMIALS)}


def _evaluate(coefs: dict[tuple[int, int], Fraction], s: int, b: int) -> Fraction:
    return sum((c * s ** i * b ** j for (i, j), c in coefs.items()), Fraction(0))


def fitted_run(model: torch.nn.Module, mode: Any, forward: Callable[..., torch.Tensor],
               make_inputs: Callable[[int, int], tuple], chunk: int, python_dispatcher: bool = True,
               kernels: str = "cpu", sdpa: tuple[str, ...] = SDPA_ORDER, multiple: bool = True, start: int = 0,
               why: str = "", least: int = 0) -> dict:
    """The saved storages of ``model`` fitted from concrete traces at POINTS (s = ``start`` + chunks of ``chunk``)
    and checked at HELD_OUT (and, when s need not be a multiple of ``chunk``, at 3 past it, b = 3 too):
    ``symbolic_run``'s result without the backward (``model``, ``storages`` with ``nbytes`` a sympy polynomial in s
    and b, ``conditions``, which say ``why`` the saves were fitted and that they hold from s = ``least`` on, else from
    the least point)."""
    runs, assumed = {}, []
    why = why or ("the chunked loop over s runs in Python" if multiple else "a buffer sliced to s")
    held_out = start + HELD_OUT[0] * chunk
    checks = [(held_out, HELD_OUT[1])] + ([] if multiple else [(held_out + 3, 3)])
    points = ", ".join(str(start + c * chunk) for c in dict.fromkeys(c for c, _ in POINTS))  # the fit's s
    for s, b in [(start + c * chunk, b) for c, b in POINTS] + checks:
        runs[(s, b)] = _grouped(concrete_saves(model, mode, forward, make_inputs, s, b, python_dispatcher, kernels,
                                               sdpa, assumed))
    keys = list(dict.fromkeys(k for run in runs.values() for k in run))
    s_sym, b_sym = sympy.Symbol("s", integer=True, positive=True), sympy.Symbol("b", integer=True, positive=True)
    storages = []
    for key in keys:
        values = {p: run[key]["nbytes"] if key in run else 0 for p, run in runs.items()}
        coefs = fit({p: v for p, v in values.items() if p not in checks})
        held = next((p for p in checks if _evaluate(coefs, *p) != values[p]), None)
        if held is not None:
            module, op, j, dtype, _ = key
            raise TraceRefused(f"the saved bytes of {module or '<model>'}: {op} ({dtype}, j = {j}) fitted at s = "
                               f"{points}, b = 2, 3 miss the held-out s = "
                               f"{held[0]}, b = {held[1]} ({values[held]:,} B, the fit {float(_evaluate(coefs, *held)):,.0f})"
                               ": not a polynomial of degree 2 in s and 1 in b")
        template = next(run[key] for run in runs.values() if key in run)
        nbytes = sum((sympy.Rational(c.numerator, c.denominator) * s_sym ** i * b_sym ** j
                      for (i, j), c in coefs.items()), sympy.Integer(0))
        if nbytes != 0:
            storages.append(dict(template, nbytes=sympy.expand(nbytes)))
    conditions = assumed + ([f"s % {chunk} == 0"] if multiple else []) + [
        f"s >= {least or start + 2 * chunk}", "b >= 2", f"fitted: the saved tensors traced at s = {points} and b = 2, 3 "
        f"({why}), fitted as polynomials (s^2 b at most) and checked at "
        f"{' and '.join(f's = {s}, b = {b}' for s, b in checks)}"]
    return {"model": model, "storages": storages, "conditions": conditions}
