"""Shared fixtures of the test suite, and how it runs in parallel (pytest-xdist, `python -m pytest -q -n 2`).

The suite measures real torch code for minutes; each measurement is made once per test run:
- a module-scoped fixture is computed once per worker that runs a test using it, so each test file runs on one
  worker (pyproject's addopts: --dist loadfile): one worker measures a file's grid while the other goes on with
  other files (a file lock and a cache shared by the workers would make the second worker wait for the first);
- the whole training steps of `memplan validate --peak` (tests/test_validate_peak.py's grid, ~200 s; the subsets
  tests/test_chunked_loss.py, tests/test_mst.py and tests/test_optimizers.py measure) are measured once through the
  session fixture `peak_steps`: those four files are one unit of work (PEAK_FILES, pytest_xdist_make_scheduler below);
- the workers are handed that unit first (the longest), then the files with a module-scoped fixture of their own
  (the other measurements), then the rest, which fills both workers up to the end (pyproject's addopts:
  --no-loadscope-reorder keeps this order, pytest_collection_modifyitems makes it).
(xdist's --dist loadgroup / xdist_group marks would say the same, but pytest 9.2 ignores the node id suffix
they work by: pytest-xdist issue 1386.) Run one file as usual: `python -m pytest tests/test_x.py`, one process.
Two things make the measurements cheaper without changing one byte they count: each worker runs torch on its share
of the cores (OMP_NUM_THREADS below), and the objects alive after collection are frozen out of gc's walks
(pytest_collection_finish; validation/ranks.py does the same in each spawned rank).
"""

import gc
import json
import os
import subprocess
import sys
import tempfile

import pytest
from hypothesis import settings

# Inventories traced on first use (memplan/inventory/traced.py) go to a scratch cache, never the user's home.
os.environ.setdefault("MEMPLAN_CACHE", tempfile.mkdtemp(prefix="memplan-cache-"))
# On an xdist worker: torch's intra-op threads share the cores with the other workers (-n 2 on 2 cores: 1 each).
# More threads than the worker's share spin in OpenMP's barriers while the other worker holds the core (the tiny
# steps measured here got 5-7x slower in CPU time under load); set before any test module imports torch, and
# inherited by the processes the tests spawn. The measurements count tensors' bytes, which no thread count changes.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _share = (os.cpu_count() or 1) // max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), 1)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(_share, 1)))

from memplan.cli import main  # noqa: E402
from memplan.inventory import traced as traced_module  # noqa: E402

# The fuzz targets (hypothesis) draw the same examples on every run: a red CI is the change's bug, not a draw.
# HYPOTHESIS_PROFILE=explore draws new ones (what to run when hunting; a failure found there becomes an @example).
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

PEAK_FILES = ("tests/test_chunked_loss.py", "tests/test_mst.py", "tests/test_optimizers.py",
              "tests/test_validate_peak.py")
PEAK_UNIT = "peak steps"


@pytest.fixture(autouse=True)
def fresh_traced_inventories(monkeypatch):
    """Each test starts with none of the traced inventories memplan/inventory/traced.py keeps built (`_BUILT`, one
    per file, model and impl for a process's commands): a test that patches how one is built (e.g.
    tests/test_validate_peak.py removing a traced moment's transients) gets its patch, whatever ran before it on
    its worker."""
    monkeypatch.setattr(traced_module, "_BUILT", {})


@pytest.fixture
def run_cli(capsys):
    """Run `memplan ARGS...` in-process; return (exit code, stdout, stderr)."""

    def run(*args: str):
        with pytest.raises(SystemExit) as exc:
            main(list(args))
        out = capsys.readouterr()
        return exc.value.code, out.out, out.err

    return run


# One process imports memplan.cli and the modules its estimate and search commands import (~0.7 s of CPU each time
# `python -m memplan.cli estimate` starts) and forks a new process per command: the child's stdout and stderr are
# files, it runs memplan's main() as `python -m memplan.cli` does and exits with its code (an exception not caught:
# the traceback on stderr, exit 1, as Python; SIGALRM ends one that hangs past its time limit); the parent sends back
# [exit code, stdout, stderr]. Single-threaded, so the fork is safe (a pytest-xdist worker runs threads).
# tests/test_bad_input.py's test_deeply_nested_json and tests/test_bad_input_edges.py start `python -m memplan.cli`.
FORKER = r"""
import json, os, signal, sys, tempfile, traceback
import memplan.cli
import memplan.api.estimating, memplan.api.searching, memplan.report.formats, memplan.report.search_tables, \
    memplan.report.tables  # what the estimate and search commands import when they run
for line in sys.stdin:
    args, timeout = json.loads(line)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            signal.alarm(timeout)
            try:
                memplan.cli.main(args)
                code = 0
            except SystemExit as exit:
                code = exit.code if isinstance(exit.code, int) else 0 if exit.code is None else 1
                if not isinstance(exit.code, (int, type(None))):
                    print(exit.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read().decode("utf-8", "backslashreplace"))
    print(json.dumps([code] + texts), flush=True)
"""


@pytest.fixture(scope="module")
def forked_cli():
    """`forked_cli(args)`: memplan ARGS run in a new process forked from one that imported memplan.cli (FORKER), as a
    subprocess.CompletedProcess."""
    server = subprocess.Popen([sys.executable, "-c", FORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run_forked(args, timeout=30):
        server.stdin.write(json.dumps([list(map(str, args)), timeout]) + "\n")
        server.stdin.flush()
        code, out, err = json.loads(server.stdout.readline())
        return subprocess.CompletedProcess(args, code, out, err)

    yield run_forked
    server.stdin.close()
    server.wait(timeout=60)


@pytest.fixture(scope="module")
def one_run_per_search():
    """Each distinct `memplan search` runs once in a module that uses this: the CLI's `PreparedSearch.run` (the
    search and the caching allocator's replay of its listing, ~10 s of CPU over every preset) is kept per prepared
    search (its repr: the model, every plan option, --top, --sort, folding), so the table, JSON and CSV of one search,
    at any console width, render the one result (only the "seconds" the search took differs from a fresh run's).
    A test that patches the replay (plan/verdict.py's replay_listing) runs its own search; for modules whose tests
    patch nothing else a search reads."""
    import memplan.api.searching as searching
    import memplan.plan.verdict as verdict

    original = searching.PreparedSearch.run
    done = {}

    def run(self, progress=None):
        if searching.replay_listing is not verdict.replay_listing:
            return original(self, progress)
        key = repr(self)
        if key not in done:
            done[key] = original(self, progress)
        return done[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(searching.PreparedSearch, "run", run)
        yield


@pytest.fixture(scope="session")
def announce(pytestconfig):
    """`with announce("measuring ..."):` writes a line to the terminal (past pytest's capture, also
    with -q) before a long module fixture starts and one with its wall time when it ends, so a
    suite that measures real torch code for minutes is never silent."""
    import contextlib
    import time

    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")

    def write(line: str) -> None:
        if reporter is None:
            return
        with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
            reporter.write_line(line)

    @contextlib.contextmanager
    def say(what: str):
        start = time.perf_counter()
        write(f"\n[memplan] {what} ...")
        yield
        write(f"[memplan] {what}: done in {time.perf_counter() - start:.0f} s")

    return say


@pytest.fixture(scope="session")
def peak_steps():
    """`run_peak(cases)` (memplan.check.peak) measuring each whole training step once per test run:
    the results of the cases measured before (by any test file) are reused, in the order asked. Only for
    the measurement fixtures: a result's prediction was made unpatched, so a test that changes memplan's prediction
    (monkeypatch) predicts again (memplan.check.peak.predict_peak) against the result's measurement."""
    from memplan.check.peak import run_peak

    done = {}

    def measure(cases):
        todo = [c for c in dict.fromkeys(cases) if c not in done]
        done.update(zip(todo, run_peak(todo)))
        return [done[c] for c in cases]

    measure.done = done
    return measure


def _measures(item) -> bool:
    """Whether a test uses a module-scoped fixture defined in its own test module (a measurement, mostly)."""
    info, module = getattr(item, "_fixtureinfo", None), getattr(item, "module", None)
    if info is None or module is None:
        return False
    return any(fixturedef.scope == "module" and fixturedef.func.__module__ == module.__name__
               for name in info.names_closure for fixturedef in info.name2fixturedefs.get(name, ()))


def pytest_collection_finish(session):
    """Once the test modules are imported (torch, transformers, memplan: ~0.4 M objects), move every object alive
    into gc's permanent generation: the harness's gc.collect() before each measured step (validation/step.py and
    the others) and Python's own full collections then walk only what the tests made since, not the imports again
    (~0.2 s of CPU per collection, two thirds of a small peak step's measurement). Only what is alive here is
    frozen (collected first); everything a test makes is collected as before."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    # on an xdist worker: the order the work is handed out in (the same on every worker): the peak steps' files,
    # the files with a measurement, the rest, each in collection order (a file's tests stay together)
    measuring = {item.nodeid.split("::", 1)[0] for item in items if _measures(item)}

    def rank(item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return 0 if path in PEAK_FILES else 1 if path in measuring else 2

    items.sort(key=rank)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # xdist's hook
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, with PEAK_FILES one unit of work (they share the session's `peak_steps`)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class PeakUnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return PEAK_UNIT if path in PEAK_FILES else path

    return PeakUnitScheduling(config, log)
