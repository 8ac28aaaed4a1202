"""Keeps the README's and docs/'s examples true.

A runnable example is a ```console block whose first line is `$ memplan ARGS` and whose other lines are the
exact output of that command (stdout and stderr as a terminal shows them, rich tables at their 150 columns,
trailing spaces dropped).
A line `[... N lines cut: WHY]` stands for N lines of the output left out. Each block is run in process
(click's CliRunner on memplan.cli.cli, from the repository root, COLUMNS=120) and compared line by line;
only run-time figures ("evaluated in 0.07 s") are masked. Mark only commands that run in about a second
(estimate / search / explain / the listings with presets); longer examples go in plain ``` blocks.

docs/reference.md's JSON tables (between `<!-- json-schema: ARGS -->` and `<!-- end json-schema -->`) list
every key path and type of `memplan ARGS` (a --json command); the test regenerates them. Relative links and
their #anchors must resolve.

When an output changes on purpose: `PYTHONPATH=. python tests/test_docs.py --update` rewrites every marked
block's output (and the JSON tables) from the current code; review the diff.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path
from unittest import mock

import pytest
from click.testing import CliRunner

from memplan.cli import cli
from memplan.report.search_tables import DelayedProgress

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

BLOCK = re.compile(r"^```console\n\$ memplan (?P<args>[^\n]*)\n(?P<body>.*?)^```$", re.MULTILINE | re.DOTALL)
CUT = re.compile(r"^\[\.\.\. (\d+) lines? cut\b.*\]$")
SCHEMA = re.compile(r"^<!-- json-schema: (?P<args>.*?) -->\n(?P<body>.*?)^<!-- end json-schema -->$",
                    re.MULTILINE | re.DOTALL)
# run-time figures, the only part of an output allowed to differ between runs
MASKS = [(re.compile(r"(?:(?<=evaluated )|^)in \d+(\.\d+)? s\b"), "in <time> s"),  # a wrapped line starts "in"
         (re.compile(r"\b\d+(\.\d+)? seconds\b"), "<time> seconds")]


def run(args: str) -> str:
    """The output of `memplan ARGS`, as a terminal shows it (stdout and stderr in order)."""
    # search's progress bar shows only when a search runs past a second (a slow machine): a run-time artefact
    with mock.patch.object(DelayedProgress, "__call__", lambda self, *a, **k: None):
        result = CliRunner().invoke(cli, shlex.split(args), env={"COLUMNS": "120"}, catch_exceptions=False)
    return result.output


def mask(line: str) -> str:
    line = line.rstrip()  # rich pads centred titles with spaces that editors strip
    for pattern, repl in MASKS:
        line = pattern.sub(repl, line)
    return line


def examples() -> list[tuple[Path, str, str]]:
    found = []
    for path in DOCS:
        for m in BLOCK.finditer(path.read_text()):
            found.append((path, m.group("args"), m.group("body")))
    return found


def compare(expected: str, actual: str) -> list[str]:
    """Differences between a block's lines (with cut markers) and the command's output; empty if equal."""
    want = expected.rstrip("\n").split("\n")
    got = actual.rstrip("\n").split("\n")
    problems, i = [], 0
    for line in want:
        cut = CUT.match(line)
        if cut:
            i += int(cut.group(1))
            continue
        if i >= len(got):
            problems.append(f"output ends before: {line!r}")
            return problems
        if mask(line) != mask(got[i]):
            problems.append(f"line {i + 1}:\n  doc: {line!r}\n  now: {got[i]!r}")
        i += 1
    if i != len(got):
        problems.append(f"the output has {len(got)} lines, the block accounts for {i}")
    return problems


def rewrite(expected: str, actual: str) -> str:
    """The block's body for a new output: cut markers keep their position from both ends."""
    want = expected.rstrip("\n").split("\n")
    got = [line.rstrip() for line in actual.rstrip("\n").split("\n")]
    cuts = [k for k, line in enumerate(want) if CUT.match(line)]
    if not cuts:  # a line equal but for its run-time figure stays as it was
        kept = [w if k < len(want) and mask(w := want[k]) == mask(g) else g for k, g in enumerate(got)]
        return "\n".join(kept) + "\n"
    assert len(cuts) == 1, "one cut per block"
    k = cuts[0]
    head, tail = k, len(want) - k - 1
    n = len(got) - head - tail
    marker = CUT.sub(lambda m: m.group(0).replace(m.group(1), str(n), 1), want[k])
    marker = re.sub(r"lines? cut", "line cut" if n == 1 else "lines cut", marker, count=1)
    return "\n".join(got[:head] + [marker] + got[len(got) - tail:]) + "\n"


def json_paths(args: str) -> list[tuple[str, str]]:
    """Every key path of a --json document with the JSON type(s) it has there, in document order."""
    names = {dict: "object", list: "array", str: "string", int: "integer", float: "number", bool: "boolean",
             type(None): "null"}
    seen: dict[str, set[str]] = {}

    def walk(value, path):
        seen.setdefault(path, set()).add(names[type(value)])
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}.{key}" if path else key)
        elif isinstance(value, list):
            for item in value:
                walk(item, path + "[]")

    walk(json.loads(run(args)), "")
    return [(p, " or ".join(sorted(t))) for p, t in seen.items() if p]


def schema_rows(body: str) -> list[tuple[str, str]]:
    rows = []
    for line in body.split("\n"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].startswith("`"):
            rows.append((cells[0].strip("`"), cells[1]))
    return rows


@pytest.mark.parametrize("path,args,body", examples(), ids=[f"{p.name}: {a}" for p, a, _ in examples()])
def test_example_output(path: Path, args: str, body: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    problems = compare(body, run(args))
    assert not problems, f"{path.name}: `memplan {args}` no longer prints what the doc shows:\n" + "\n".join(
        problems[:10]) + "\n(on purpose? PYTHONPATH=. python tests/test_docs.py --update)"


def test_examples_are_marked() -> None:
    """The README answers its questions with runnable examples; the docs keep theirs."""
    readme = [a for p, a, _ in examples() if p.name == "README.md"]
    assert len(readme) >= 5
    assert len(examples()) >= 12


@pytest.mark.parametrize("args", [m.group("args") for m in SCHEMA.finditer((ROOT / "docs/reference.md").read_text())])
def test_json_schema_tables(args: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    body = next(m.group("body") for m in SCHEMA.finditer((ROOT / "docs/reference.md").read_text())
                if m.group("args") == args)
    assert schema_rows(body) == json_paths(args)


def anchors(text: str) -> set[str]:
    text = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    headings = re.findall(r"^#+ (.*)$", text, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_relative_links_resolve() -> None:
    for path in DOCS:
        text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, frag = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            assert dest.exists(), f"{path.name}: link to {target} (no such file)"
            assert not target.startswith("/"), f"{path.name}: absolute link {target}"
            if frag and dest.suffix == ".md":
                assert frag in anchors(dest.read_text()), f"{path.name}: link to {target} (no such heading)"


def update() -> None:
    """Rewrite every marked block's output and every JSON table from the current code."""
    import os

    os.chdir(ROOT)
    for path in DOCS:
        text = path.read_text()

        def block(m):
            return f"```console\n$ memplan {m.group('args')}\n{rewrite(m.group('body'), run(m.group('args')))}```"

        def table(m):
            meaning = {}
            for line in m.group("body").split("\n"):
                cells = [c.strip() for c in line.strip().strip("|").split("|")]
                if len(cells) >= 3 and cells[0].startswith("`"):
                    meaning[cells[0].strip("`")] = cells[2]
            rows = "".join(f"| `{p}` | {t} | {meaning.get(p, '')} |\n" for p, t in json_paths(m.group("args")))
            return (f"<!-- json-schema: {m.group('args')} -->\n| key | type | meaning |\n|---|---|---|\n{rows}"
                    "<!-- end json-schema -->")

        new = SCHEMA.sub(table, BLOCK.sub(block, text))
        if new != text:
            path.write_text(new)
            print("updated", path.relative_to(ROOT))


if __name__ == "__main__":
    if sys.argv[1:] == ["--update"]:
        update()
    else:
        sys.exit("usage: PYTHONPATH=. python tests/test_docs.py --update")
