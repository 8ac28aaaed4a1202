"""Draw the README's pictures (docs/*.png) with memplan's own commands: run `python docs/make_figures.py`.

Needs the plot extra (pip install -e '.[plot]'). Each picture is what the command beside it draws.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from memplan.cli import cli

DOCS = Path(__file__).resolve().parent
LLAMA_8B = ["--model", "llama3-8b", "--impl", "hf-sdpa", "--tp", "1", "--pp", "1", "--no-sp", "--dp", "1",
            "--global-batch", "1", "--seq-len", "4096", "--recompute", "full", "--precision", "bf16-true",
            "--optimizer-impl", "fused", "--gpu", "h100-80gb"]
FIGURES = {
    "step-gpt3-530b.png": ["estimate", "--model", "gpt3-530b"],
    "k22-figure7-gpt3-530b.png": ["estimate", "--model", "gpt3-530b"],
    "step-llama3-8b.png": ["estimate", *LLAMA_8B],
    "search-gpt3-530b.png": ["search", "--model", "gpt3-530b", "--gpus", "2240", "--mem", "80GB"],
    "search-llama3-8b.png": ["search", "--model", "llama3-8b", "--gpus", "64", "--mem", "80GB"],
}


def main() -> None:
    for name, args in FIGURES.items():
        option = "--plot-techniques" if name.startswith("k22-") else "--plot"
        path = DOCS / name
        with contextlib.redirect_stdout(io.StringIO()):  # the tables; only the pictures are wanted here
            cli.main(args=[*args, option, str(path)], prog_name="memplan", standalone_mode=False)
        print(f"{path.relative_to(DOCS.parent)}: {path.stat().st_size / 1e3:.0f} KB  (memplan {' '.join(args)} "
              f"{option} {name})")


if __name__ == "__main__":
    main()
