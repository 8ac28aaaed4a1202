import os
import tempfile

import pytest

# Inventories traced on first use (memplan/inventory/traced.py) go to a scratch cache, never the user's home.
os.environ.setdefault("MEMPLAN_CACHE", tempfile.mkdtemp(prefix="memplan-cache-"))

from memplan.cli import main  # noqa: E402


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
