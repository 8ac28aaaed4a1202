"""--format markdown|csv|json: renderings of the one JSON schema (estimate_dict, search_dict)."""

import csv
import io
import json

import pytest

ESTIMATE = ("estimate", "--model", "gpt3-530b")
SEARCH = ("search", "--model", "gpt3-530b", "--gpus", "2240", "--mem", "80GB", "--top", "4")


def markdown_rows(out):
    """The cells of every table row of a Markdown output (header first, separator dropped)."""
    lines = [line for line in out.splitlines() if line.startswith("|")]
    assert lines, out
    rows = [[c.strip() for c in line.strip().strip("|").split(" | ")] for line in lines]
    assert set(lines[1].replace("|", "")) == {"-"}  # the separator row
    return [rows[0]] + rows[2:]


def test_json_alias(run_cli):
    _, a, _ = run_cli(*ESTIMATE, "--json")
    _, b, _ = run_cli(*ESTIMATE, "--format", "json")
    assert json.loads(a) == json.loads(b)
    assert json.loads(a)["impl"] == "megatron"


def test_estimate_csv(run_cli):
    code, out, _ = run_cli(*ESTIMATE, "--format", "csv")
    assert code == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    terms = [r for r in rows if r["section"] == "activations" and r["item"] != "recompute working set (one layer, transient)"]
    _, js, _ = run_cli(*ESTIMATE, "--json")
    data = json.loads(js)
    assert [r["item"] for r in terms] == [t["name"] for t in data["activations"]["terms"]]
    by_item = {r["item"]: r for r in rows}
    # the GeLU input, 8sbh/t = 8 * 2048 * 1 * 20480 / 8 = 41,943,040 B per layer, x 139 layers in flight on
    # stage 0 (interleaved 1F1B, p=35, m=3: 2(p-1) + (m-1)p + 1 = 68 + 70 + 1 = 139)
    gelu = by_item["GeLU input"]
    assert (gelu["symbolic"], int(gelu["bytes_per_copy"]), int(gelu["copies"]), int(gelu["value"]), gelu["unit"]) == (
        "8sbh/t", 41_943_040, 139, 41_943_040 * 139, "B")
    assert all(r["unit"] for r in rows if r["value"] not in ("True", "False"))
    device = by_item["device memory needed"]
    assert int(device["value"]) == data["memory"]["device_bytes"] and device["unit"] == "B"
    assert by_item["step time"]["unit"] == "s"


def test_estimate_markdown(run_cli):
    code, out, _ = run_cli(*ESTIMATE, "--format", "markdown")
    assert code == 0 and out.startswith("**gpt3-530b** (megatron)")
    rows = markdown_rows(out)
    assert all(len(r) == len(rows[0]) for r in rows)
    assert "41,943,040" in out and "34sbh/t + 16sb/t" in out


@pytest.mark.parametrize("fmt", ["csv", "markdown"])
def test_search_one_row_per_plan(run_cli, fmt):
    code, out, _ = run_cli(*SEARCH, "--format", fmt)
    assert code == 0
    _, js, _ = run_cli(*SEARCH, "--json")
    data = json.loads(js)
    if fmt == "csv":
        rows = list(csv.DictReader(io.StringIO(out)))
    else:
        cells = markdown_rows(out)
        assert all(len(r) == len(cells[0]) for r in cells)
        rows = [dict(zip(cells[0], r)) for r in cells[1:]]
    fits = [r for r in rows if r["status"] == "fits"]
    assert len(fits) == len(data["plans"]) == 4
    assert [r["rank"] for r in fits] == ["1", "2", "3", "4"]
    first = data["plans"][0]
    value = fits[0]["device_bytes"].replace(",", "")
    assert int(value) == first["memory"]["device_bytes"]
    assert "step_time_s" in rows[0] and "device_bytes" in rows[0]


def test_search_every_preset_csv(run_cli):
    code, out, _ = run_cli("search", "--gpus", "64", "--mem", "80GB", "--top", "1", "--format", "csv")
    assert code == 0
    models = {r["model"] for r in csv.DictReader(io.StringIO(out))}
    assert {"gpt-22b", "llama3-8b"} <= models


def test_json_conflicts_with_other_format(run_cli):
    code, _, err = run_cli(*ESTIMATE, "--json", "--format", "csv")
    assert code == 2 and err.strip() == "memplan: error: --json conflicts with --format csv"
