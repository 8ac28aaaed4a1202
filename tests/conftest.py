import pytest

from memplan.cli import main


@pytest.fixture
def run_cli(capsys):
    """Run `memplan ARGS...` in-process; return (exit code, stdout, stderr)."""

    def run(*args: str):
        with pytest.raises(SystemExit) as exc:
            main(list(args))
        out = capsys.readouterr()
        return exc.value.code, out.out, out.err

    return run
