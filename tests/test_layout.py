"""Every rich table fits the console: at 80 columns (a terminal) the compact layout keeps a table
row on one line in the common case, at 150 (piped output, cli._console) the wide layout is kept;
and the source column's citations are short."""

import functools
import io
import json
import re
from unittest import mock

import pytest
from click.testing import CliRunner
from rich.console import Console

import memplan.cli
from memplan.core.errors import MemplanError
from memplan.presets.catalog import load_model, model_names
from memplan.report.tables import WIDE_MIN_WIDTH, _cite, _short_cite, compact, make_table
from memplan.report.validate_tables import render_peak_validation, render_validation
from memplan.inventory.assemble import IMPLEMENTATIONS, inventory_for

ESTIMATE_FLASH = ("estimate", "--model", "llama3-8b", "--attention", "flash")
ESTIMATE_530B = ("estimate", "--model", "gpt3-530b")
SEARCH = ("search", "--model", "gpt3-175b", "--gpus", "1024", "--mem", "80GB")
SEARCH_ALL = ("search", "--gpus", "64", "--mem", "80GB")
COMMANDS = (ESTIMATE_FLASH, ESTIMATE_530B, SEARCH, SEARCH_ALL, ("models",), ("gpus",))
pytestmark = pytest.mark.usefixtures("one_run_per_search")  # tests/conftest.py: a search's two widths, one search
# The compact estimate table at 80 columns: the other columns take at most 10 (a per-layer formula
# folds past that at its '+') + 3 (copies) + 7 (bytes, 3 digits) + 5 (share) + 11 (a shortened
# source) and 5 one-space gaps, 41 in all, which leaves the component column 39: an indented name
# (2 columns) of up to 37 characters takes one line, a longer one (at most 67) two.
COMPONENT_ONE_LINE = 80 - (10 + 3 + 7 + 5 + 11 + 5) - 2


@functools.lru_cache(maxsize=None)
def render(width, *args):
    """`memplan ARGS` as printed on a console `width` columns wide."""
    with mock.patch.object(memplan.cli, "_console", lambda: Console(width=width)):
        result = CliRunner().invoke(memplan.cli.cli, list(args))
    assert result.exit_code == 0, (result.output, result.exception)
    return result.output


def table_body(out, first_row, indented=True):
    """The lines of the first table whose first data row starts with `first_row`, up to its last row
    (the first line that is neither a table row nor a folded part of one: a blank, a footnote, the
    next table's centred title where no row is `indented`)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"[│ ]*{re.escape(first_row)}", line))
    end = start
    while (end < len(lines) and lines[end].strip() and (indented or not lines[end].startswith(" "))
           and not lines[end].startswith(("*", "└", "note", "best plan", "default plan", "sources", "did"))):
        end += 1
    return [line for line in lines[start:end] if not line.startswith("└")]


@pytest.mark.parametrize("args", COMMANDS, ids=" ".join)
@pytest.mark.parametrize("width", (80, 150))
def test_no_line_wider_than_the_console(args, width):
    out = render(width, *args)
    too_wide = [line for line in out.splitlines() if len(line) > width]
    assert not too_wide, "\n".join(too_wide)
    assert "…" not in out  # nothing cut: every column that does not fold fits
    if args[0] != "gpus":  # a list, not a table
        assert ("┏" in out) is (width >= WIDE_MIN_WIDTH)  # the wide layout's heavy box, or the compact one


def estimate_rows(args):
    """How many rows the estimate's activation table has, and its terms' names as shown."""
    data = json.loads(render(150, *args, "--json"))
    terms = [t["name"] + ("" if t["in_k22"] else " *") for t in data["activations"]["terms"]]
    working = ["recompute working set (one layer, transient) *"] * bool(data["activations"]["recompute_working_bytes"])
    # weights, gradients, optimizer, activations, the terms, the working set, the total
    return 4 + len(terms) + len(working) + 1, terms + working


@pytest.mark.parametrize("args", (ESTIMATE_FLASH, ESTIMATE_530B), ids=" ".join)
def test_estimate_table_one_line_per_row_at_80(args):
    out = render(80, *args)
    rows, names = estimate_rows(args)
    body = table_body(out, "weights")
    assert body[-1].startswith("retained at the first backward")
    long_names = [n for n in names if len(n) > COMPONENT_ONE_LINE]
    # a row takes one line but for a long name (two) and a per-layer formula wider than 10 columns
    # (two, on the same row as a long name or not: 2sbh/t + 2sbhg/(at) of flash attention)
    long_formulas = 1 if "flash" in args else 0
    assert len(body) <= rows + len(long_names) + long_formulas, "\n".join(body)
    assert len(long_names) + long_formulas < rows / 2  # never every row
    # the activations row leaves its formula to the heading line; each term keeps its formula, copies,
    # bytes, share and source
    heading = next(line for line in out.splitlines() if line.startswith("activations per layer"))
    assert "sbh/t" in heading and "sbh/t" not in body[3]
    assert re.search(r"2sbh/t +\d+ +[\d.]+ [KMG]B +[\d.]+% K22 4\.1$", body[4].rstrip()), body[4]


def test_estimate_wide_layout_at_150():
    out = render(150, *ESTIMATE_FLASH)
    rows, names = estimate_rows(ESTIMATE_FLASH)
    body = [line for line in table_body(out, "│ weights") if line.startswith("│")]
    assert "4asb/t + 12sbh/t" in body[3]  # the activations row's formula, in the table
    assert "FlashAttention-2 (Dao 2023)" in out and "Transformer Engine / apex" in out
    assert len(body) <= rows + sum(len(n) > 42 for n in names) + 1  # the wide columns fit more


def test_compact_source_names_are_explained():
    out = render(80, *ESTIMATE_FLASH)
    assert "FlashAttn-2" in out and "TE / apex" in out
    assert "sources: FlashAttn-2 = FlashAttention-2 (Dao 2023); TE = Transformer Engine" in out


def test_search_tables_at_80():
    out = render(80, *SEARCH)
    body = table_body(out, " 1 ")
    assert len(body) == 10  # --top 10, one line each
    assert " sel " in body[0] and "rec" in out and "memory" in out
    out = render(80, *SEARCH_ALL)
    body = table_body(out, model_names()[0])
    # a preset per line (multi-head latent attention is modelled for the default --impl megatron: none skipped);
    # a nearest miss of full recompute over part of a chunk ('full 2/32') may fold
    searched = model_names()
    assert len(searched) <= len(body) <= len(searched) + 2, "\n".join(body)
    assert "skipped deepseek-v3" not in out
    assert "best plan: t, p, d tensor, pipeline, data parallel" in out


def test_models_at_80():
    out = render(80, "models")
    body = table_body(out, model_names()[0])
    assert len(body) == len(model_names()), "\n".join(body)
    assert re.search(r"gpt3-530b .* 529\.6 t8 p35 d1 m3 SP b1 B280 sel\s*$", out, re.M)
    assert re.search(r"llama3\.1-405b .* t8 p16\* d128 SP Z2 b1 B2048\s*$", out, re.M)  # m1, no recompute
    wide = render(150, "models")
    assert "tp=8 pp=35 dp=1 vpp=3 sp=True micro_batch=1 global_batch=280" in wide


def validation_results():
    """Results of the validation grid without running torch: measured = memplan, but for one case
    whose first term is 5,000 bytes off (it fails and shows its term-by-term table)."""
    from memplan.check import cases as c, peak as p, validate as v

    results = []
    for i, case in enumerate(c.grid() + c.hf_grid()):
        predicted = v.predict(case)
        measured = dict(predicted)
        if i == 5:
            measured[next(iter(measured))] += 5000
        results.append(v.CaseResult(case, predicted, measured, sum(v.predict(case, paper_only=True).values()),
                                    None, None))
    peaks = [p.PeakResult(case, 2_000_000 * (i + 1), 2_001_000 * (i + 1), "backward 1", "loss" if i == 3 else
                          "backward 1") for i, case in enumerate(p.peak_grid())]
    return results, v.summary(results), peaks, p.peak_summary(peaks)


@pytest.mark.parametrize("width", (80, 150))
def test_validate_tables(width):
    results, summary, peaks, peak_summary = validation_results()
    console = Console(file=io.StringIO(), width=width, record=True)
    render_validation(results, summary, console)
    render_peak_validation(peaks, peak_summary, console)
    out = console.export_text()
    assert all(len(line) <= width for line in out.splitlines())
    if width < WIDE_MIN_WIDTH:
        # saved tensors: a row per case, the implementation's name above its cases, and two lines
        # for a case name past the case column (llama ... head_dim24)
        body = table_body(out, "torch", indented=False)
        impls = len({r.case.impl for r in results})
        long_names = sum(len(r.case.name) > 25 for r in results)
        assert len(body) <= len(results) + impls + long_names, "\n".join(body)
        assert long_names < len(results) / 2  # never most rows
        assert re.search(r"^s64 b2 h64 a4 +layer 1 off none ledger +447 KB 0\.0000% +442 KB +PASS", out, re.M)
        assert "FAIL" in out and "difference" in out  # the failing case's term table
        # peak: a row per case, case names past 19 columns on two, and so the 'peak at' of one where
        # memplan and the measurement disagree ('bwd 1 /' over 'loss')
        body = table_body(out, peaks[0].case.name, indented=False)
        long_names = sum(len(r.case.name) > 19 for r in peaks)
        assert len(body) <= len(peaks) + long_names + 1, "\n".join(body)
        assert long_names <= len(peaks) / 2  # never most rows
        assert re.search(r" bwd 1   PASS\n", out) and re.search(r" bwd 1 / PASS\n +loss", out)


def test_layout_threshold():
    assert compact(Console(width=WIDE_MIN_WIDTH - 1)) and not compact(Console(width=WIDE_MIN_WIDTH))
    narrow = make_table(Console(width=80), ())
    wide = make_table(Console(width=150), ())
    assert narrow.box is not wide.box and not narrow.show_edge and wide.show_edge


def test_cite_of_the_fixed_sources():
    assert _cite("Transformer Engine / apex: RMSNorm saves rstd (fp32)") == "Transformer Engine / apex"
    assert _cite("Megatron-LM: bias_swiglu_impl saves its input; linear_fc2 its input") == "Megatron-LM"
    assert _cite("K22 section 4.1 without the dropout terms") == "K22 4.1"
    assert _cite("FlashAttention-2 (Dao 2023) forward saves q, k, v, out, softmax_lse") == "FlashAttention-2 (Dao 2023)"
    assert _short_cite("transformers 5.23.0") == "HF 5.23.0"


def every_source():
    """Every term's source of the presets gpt-22b and llama3-8b, run by every implementation with
    eager and flash attention, on CUDA and CPU (the combinations memplan accepts)."""
    sources = set()
    for name in ("gpt-22b", "llama3-8b"):
        model = load_model(name).model
        for impl in IMPLEMENTATIONS:
            for attention in ("eager", "flash"):
                for device in ("cuda", "cpu"):
                    try:
                        inv = inventory_for(model.model_copy(update={"attention": attention}), impl, device)
                    except MemplanError:
                        continue  # e.g. the reference torch layer is the GPT layer only
                    sources |= {t.source for t in inv.terms}
    return sources


def test_every_citation_is_short():
    sources = every_source()
    assert {"Transformer Engine / apex: RMSNorm saves rstd (fp32)",
            "Megatron-LM: bias_swiglu_impl saves its input; linear_fc2 its input"} <= sources
    cites = {_cite(s) for s in sources}
    assert all(len(c) <= 28 for c in cites), sorted(cites, key=len)[-3:]
    assert {"K22 4.1", "Megatron-LM", "measured", "Transformer Engine / apex", "FlashAttention-2 (Dao 2023)"} <= cites
    # the compact layout's source column is 11 wide at most: no citation is cut there
    assert all(len(_short_cite(c)) <= 11 for c in cites), sorted(map(_short_cite, cites), key=len)[-3:]
