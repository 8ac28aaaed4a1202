"""Shared fixtures of the test suite, and how it runs in parallel (pytest-xdist, `python -m pytest -q -n 2`).

The suite measures real torch code for minutes; each measurement is made once per test run:
- a fixture of module (or session) scope is computed once per worker that runs a test using it, so every
  test using a module-scoped fixture of its test module is put in one xdist group (pyproject's addopts:
  --dist loadgroup), named after the module: one worker computes it, the other goes on with other tests
  (a file lock and a cache shared by the workers would make the second worker wait for the first);
- the whole training steps of `memplan validate --peak` (tests/test_validate_peak.py's grid, ~200 s; the
  subsets tests/test_chunked_loss.py and tests/test_mst.py measure) are measured once through the session
  fixture `peak_steps`, and every test using it is in the group "peak steps";
- on a worker the groups run first, the peak steps first of all (the longest), then the single tests
  fill both workers up to the end (pyproject's addopts: --no-loadscope-reorder keeps this order).
Run one file as usual (`python -m pytest tests/test_x.py`, one process); `-n 2` runs it in parallel.
"""

import os
import tempfile

import pytest

# Inventories traced on first use (memplan/inventory/traced.py) go to a scratch cache, never the user's home.
os.environ.setdefault("MEMPLAN_CACHE", tempfile.mkdtemp(prefix="memplan-cache-"))

from memplan.cli import main  # noqa: E402

PEAK_GROUP = "peak steps"


@pytest.fixture
def run_cli(capsys):
    """Run `memplan ARGS...` in-process; return (exit code, stdout, stderr)."""

    def run(*args: str):
        with pytest.raises(SystemExit) as exc:
            main(list(args))
        out = capsys.readouterr()
        return exc.value.code, out.out, out.err

    return run


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
    """`run_peak(cases)` (memplan.check.validate) measuring each whole training step once per test run:
    the results of the cases measured before (by any test file) are reused, in the order asked. Only for
    the measurement fixtures: a test that changes memplan's prediction (monkeypatch) calls run_peak itself."""
    from memplan.check.peak import run_peak

    done = {}

    def measure(cases):
        todo = [c for c in dict.fromkeys(cases) if c not in done]
        done.update(zip(todo, run_peak(todo)))
        return [done[c] for c in cases]

    measure.done = done
    return measure


def _group(item) -> str | None:
    """The xdist group of a test: PEAK_GROUP if it uses `peak_steps`; its module's path if it uses a
    module- or session-scoped fixture defined in its module; else none (the test goes to any worker)."""
    info = getattr(item, "_fixtureinfo", None)
    module = getattr(item, "module", None)
    if info is None or module is None:
        return None
    if "peak_steps" in info.names_closure:
        return PEAK_GROUP
    for name in info.names_closure:
        for fixturedef in info.name2fixturedefs.get(name, ()):
            if fixturedef.scope in ("module", "session") and fixturedef.func.__module__ == module.__name__:
                return item.nodeid.split("::")[0]
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    groups = {}
    for item in items:
        group = _group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
            groups[item] = group
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # the order xdist hands out the work in (--no-loadscope-reorder): the peak steps, the other groups,
        # then the single tests, each in collection order (a worker runs one module's group at a time)
        rank = {item: (0 if groups.get(item) == PEAK_GROUP else 1 if item in groups else 2) for item in items}
        items.sort(key=rank.__getitem__)
