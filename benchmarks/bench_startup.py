"""Start-up time of the `memplan` command as a user gets it: a wheel of this checkout installed into a fresh
virtual environment (bytecode compiled), each command timed end to end (process start to exit), medians of
--runs runs, the commands interleaved round by round so that a busy machine slows them alike.

    python benchmarks/bench_startup.py [--runs 15] [--deps link|install] [--checkout PATH]

Prints each median and its excess over `python -c pass` (the interpreter's own start), against the targets:
`memplan --help` 0.08 s, `memplan estimate --model gpt3-530b` 0.15 s, `memplan search --model gpt3-530b --gpus
2240 --mem 80GB` 0.25 s. --deps link (default) installs the wheel alone and puts this interpreter's
site-packages (click, pydantic, numpy, rich, yaml) on the venv's path; --deps install lets pip install them.
What a command imports: `python -X importtime -c "..."`, or tests/test_api.py's import checks.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = {  # name: (arguments after the venv's bin/, target excess over `python -c pass` in seconds)
    "python -c pass": (["python", "-c", "pass"], None),
    "memplan --help": (["memplan", "--help"], 0.08),
    "memplan estimate --model gpt3-530b": (["memplan", "estimate", "--model", "gpt3-530b"], 0.15),
    "memplan search --model gpt3-530b --gpus 2240 --mem 80GB":
        (["memplan", "search", "--model", "gpt3-530b", "--gpus", "2240", "--mem", "80GB"], 0.25),
}


def install(venv: Path, deps: str, checkout: Path = ROOT) -> Path:
    """Build a wheel of the checkout, install it into a new venv, compile its bytecode; the venv's bin/."""
    dist, source = venv.parent / "dist", venv.parent / "source"  # built from a copy: the checkout gets no build/
    shutil.copytree(checkout, source, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                    str(source)], check=True, capture_output=True, cwd=venv.parent)
    wheel = next(dist.glob("memplan-*.whl"))
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    extra = ["--no-deps"] if deps == "link" else []
    subprocess.run([str(python), "-m", "pip", "install", "-q", *extra, str(wheel)], check=True, capture_output=True,
                   cwd=venv.parent)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    if deps == "link":  # a path line only: the .pth files there (an editable memplan) are not run
        paths = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
        (site / "_bench_startup_deps.pth").write_text("".join(p + "\n" for p in paths))
    subprocess.run([str(python), "-m", "compileall", "-q", str(site / "memplan")], check=True)
    return venv / "bin"


def time_once(argv: list[str], cwd: Path) -> float:
    start = time.perf_counter()
    subprocess.run(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=15, help="runs of each command (the median is reported)")
    parser.add_argument("--deps", choices=["link", "install"], default="link")
    parser.add_argument("--checkout", type=Path, default=ROOT, help="the checkout to build (default: this one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="memplan-startup-") as tmp:
        work = Path(tmp)
        bin_dir = install(work / "venv", args.deps, args.checkout)
        argvs = {name: [str(bin_dir / argv[0]), *argv[1:]] for name, (argv, _) in COMMANDS.items()}
        for argv in argvs.values():  # warm the file cache; check that each command runs
            time_once(argv, work)
        times: dict[str, list[float]] = {name: [] for name in COMMANDS}
        for _ in range(args.runs):
            for name, argv in argvs.items():
                times[name].append(time_once(argv, work))
    medians = {name: statistics.median(t) for name, t in times.items()}
    base = medians["python -c pass"]
    print(f"memplan start-up: medians of {args.runs} runs each (wheel in a fresh venv, bytecode compiled; "
          f"Python {sys.version.split()[0]})")
    for name, (_, target) in COMMANDS.items():
        line = f"  {name:58s} {medians[name]:6.3f} s"
        if target is not None:
            excess = medians[name] - base
            verdict = "meets" if excess <= target else "misses"
            line += f"   excess {excess:6.3f} s  (target {target:.2f} s: {verdict})"
        print(line)


if __name__ == "__main__":
    main()
