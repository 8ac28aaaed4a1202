"""Byte-identical verdicts before / after a speed change (issue 20 item 4): runs a fixed set of `memplan search` and
`memplan estimate` commands with `--json`, drops the only field that is a measured time (`seconds`), and either
writes the documents to a file or compares them with one written before.

    python benchmarks/compare_verdicts.py --write /tmp/before.json     # on the commit before the change
    python benchmarks/compare_verdicts.py --check /tmp/before.json     # on the commit after it: exit 1 on any change

Each command runs in this process through the CLI's `main` (the same JSON a user gets). The set: the 530B / 2240
GPU search (default margin, --frag-margin 0, expandable segments, and its --max-seq), smaller searches whose
listings replay near the budget, `estimate --max-seq` / `--max-micro-batch` on Megatron-LM and transformers plans,
with the flat margin and with the replay alone deciding (--frag-margin 0), a run history (--first-step-seq-len), and
llama3-8b's traced stream (one GPU, one micro-batch per step).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys

from memplan.cli import main as cli_main

MEGATRON_8B = ["--model", "llama3-8b", "--gpus", "8", "--tp", "2", "--pp", "2", "--dp", "2", "--vpp", "1", "--sp",
               "--zero", "0", "--micro-batch", "1", "--recompute", "selective", "--gpu", "h100-80gb"]
ONE_GPU_8B = ["--model", "llama3-8b", "--impl", "hf-sdpa", "--precision", "bf16-true", "--gpus", "1",
              "--micro-batch", "1", "--recompute", "full", "--gpu", "h100-80gb"]
COMMANDS = [
    ["search", "--model", "gpt3-530b", "--gpus", "2240", "--mem", "80GB"],
    ["search", "--model", "gpt3-530b", "--gpus", "2240", "--mem", "80GB", "--frag-margin", "0"],
    ["search", "--model", "gpt3-530b", "--gpus", "2240", "--mem", "80GB", "--allocator", "expandable"],
    ["search", "--model", "gpt3-530b", "--gpus", "2240", "--mem", "80GB", "--max-seq"],
    ["search", "--model", "llama3-8b", "--gpus", "8", "--mem", "40GB", "--frag-margin", "0"],
    ["search", "--model", "llama3-70b", "--gpus", "64", "--mem", "80GB", "--frag-margin", "0", "--top", "5"],
    ["search", "--model", "gpt3-175b", "--gpus", "1024", "--mem", "80GB", "--frag-margin", "0.02"],
    ["search", *MEGATRON_8B, "--seq-len", "4096", "--frag-margin", "0", "--max-seq", "--all-variants"],
    ["estimate", "--model", "gpt3-530b", "--max-seq"],
    ["estimate", "--model", "gpt3-530b", "--max-seq", "--frag-margin", "0"],
    ["estimate", *MEGATRON_8B, "--seq-len", "4096", "--max-seq", "--frag-margin", "0"],
    ["estimate", *MEGATRON_8B, "--seq-len", "4096", "--max-micro-batch", "--frag-margin", "0"],
    ["estimate", *ONE_GPU_8B, "--max-seq"],
    ["estimate", *ONE_GPU_8B, "--max-seq", "--frag-margin", "0"],
    ["estimate", *ONE_GPU_8B, "--max-seq", "--frag-margin", "0", "--allocator", "expandable"],
    ["estimate", *ONE_GPU_8B, "--seq-len", "8192", "--frag-margin", "0", "--first-step-seq-len", "2048"],
    # one micro-batch per step: llama3-8b's shipped trace by default, its stream the traced order
    ["estimate", *ONE_GPU_8B, "--global-batch", "1", "--optimizer-impl", "fused", "--max-seq"],
    ["estimate", *ONE_GPU_8B, "--global-batch", "1", "--recompute", "none", "--allocator", "expandable", "--max-seq"],
]


def _drop_seconds(doc):
    if isinstance(doc, dict):
        return {k: _drop_seconds(v) for k, v in doc.items() if k != "seconds"}
    if isinstance(doc, list):
        return [_drop_seconds(v) for v in doc]
    return doc


def run(args: list[str]) -> dict:
    """One command's `--json` document (its exit code and stderr kept too), without measured times."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli_main([*args, "--json"])
        except SystemExit as exc:
            code = exc.code
    text = out.getvalue()
    try:
        doc = _drop_seconds(json.loads(text))
    except ValueError:
        doc = text
    return {"command": " ".join(args), "exit": code, "json": doc, "stderr": err.getvalue()}


def main() -> int:
    parser = argparse.ArgumentParser()
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--write", help="write the documents to this file")
    what.add_argument("--check", help="compare with the documents in this file")
    args = parser.parse_args()
    docs = []
    for command in COMMANDS:
        docs.append(run(command))
        print(f"exit {docs[-1]['exit']}: memplan {docs[-1]['command']}", file=sys.stderr, flush=True)
    if args.write:
        with open(args.write, "w") as f:
            json.dump(docs, f, indent=1, sort_keys=True)
        return 0
    with open(args.check) as f:
        before = json.load(f)
    now = json.loads(json.dumps(docs, sort_keys=True))
    changed = [b["command"] for b, a in zip(before, now) if b != a]
    if len(before) != len(now):
        changed.append(f"{len(before)} commands before, {len(now)} now")
    for command in changed:
        print(f"CHANGED: memplan {command}")
    print(f"{len(now) - len(changed)} of {len(now)} documents identical")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
