"""The one writer of files memplan is asked to make (--plot, --plot-techniques, trace --out): every output path is
checked before the work (`check_output`), and written whole or not at all (`write_bytes`).

Refused before any work: a directory, a missing folder, a folder this user cannot write, a FIFO, a device or other
non-regular file, a path under /proc, /sys or /dev, a symbolic link (it would write through to wherever it points:
give the target's path), an existing file unless overwriting is allowed (trace --out needs --force), and two
outputs of one command that name the same file. The file is written to a temporary file beside it and renamed
over it, so a failure leaves the old file (or none) and a link created in between is replaced, not followed.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import Optional

from memplan.core.errors import MemplanError

_SYSTEM = ("/proc", "/sys", "/dev")


def check_output(path: str, what: str, overwrite: bool = True, reads: Optional[str] = None) -> Path:
    """`path` as a file this command may write (see the module docstring); `reads`: an input it must not replace."""
    p = Path(path)
    shown = str(path)[:200]
    absolute = Path(os.path.abspath(p))
    if any(absolute == Path(s) or Path(s) in absolute.parents for s in _SYSTEM):
        raise MemplanError(f"{what} {shown}: not a place for an output file")
    if p.is_symlink():
        raise MemplanError(f"{what} {shown} is a symbolic link: give the path of the file it points to")
    if p.exists():
        mode = p.stat().st_mode
        if stat.S_ISDIR(mode):
            raise MemplanError(f"{what} {shown} is a directory: give a file name")
        if not stat.S_ISREG(mode):
            raise MemplanError(f"{what} {shown} is not a regular file (a FIFO, socket or device)")
        if reads is not None and Path(reads).exists() and p.resolve() == Path(reads).resolve():
            raise MemplanError(f"{what} {shown} is the file this command reads: give another file name")
        if not overwrite:
            raise MemplanError(f"{what} {shown} exists: give another file name, or --force to overwrite it")
    folder = absolute.parent
    if not folder.is_dir():
        raise MemplanError(f"{what} {shown}: folder {str(folder)[:200]} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise MemplanError(f"{what} {shown}: folder {str(folder)[:200]} is not writable")
    return p


def same_outputs(*named: tuple[str, Optional[str]]) -> None:
    """Refuse two outputs of one command that name the same file ((option, path) pairs; None: not given)."""
    seen: dict[str, str] = {}
    for option, path in named:
        if path:
            key = os.path.realpath(path)
            if key in seen:
                raise MemplanError(f"{seen[key]} and {option} name the same file {str(path)[:200]}: give two files")
            seen[key] = option


def write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` whole: a temporary file in the same folder, renamed over it."""
    folder = Path(os.path.abspath(path)).parent
    try:
        fd, temp = tempfile.mkstemp(prefix=".memplan-", dir=folder)
    except OSError as err:
        raise MemplanError(f"cannot write {str(path)[:200]}: {err.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(temp, 0o666 & ~_umask())
        os.replace(temp, path)
    except OSError as err:
        Path(temp).unlink(missing_ok=True)
        raise MemplanError(f"cannot write {str(path)[:200]}: {err.strerror}") from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
