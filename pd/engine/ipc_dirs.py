"""The folders of the ZMQ ipc:// sockets between a server and its engine core: one per
engine, named `pd-engine-<server pid>-*` in the temp directory, removed by the server
when it stops it. A server killed with SIGKILL cannot remove its own, so each new one
first removes those of servers that are gone.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from pathlib import Path

IPC_DIR_PREFIX = "pd-engine-"  # then the server's pid and a random part
STALE_AFTER_S = 60.0  # a folder without a pid in its name is removed once this old and unused


def remove_stale_ipc_dirs(temp_dir: str | None = None) -> list[str]:
    """Remove the IPC folders of servers that are gone (killed with SIGKILL, they could not
    remove their own): the server's pid in the name is not a live process, or, for a
    folder named otherwise, no socket in it is bound and it is older than STALE_AFTER_S.
    The folders removed."""
    base = Path(temp_dir or tempfile.gettempdir())
    removed = []
    for folder in base.glob(f"{IPC_DIR_PREFIX}*"):
        if folder.is_dir() and _stale(folder):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(str(folder))
    return removed


def _stale(folder: Path) -> bool:
    match = re.match(rf"{IPC_DIR_PREFIX}(\d+)-", folder.name)
    if match is not None:
        return not _pid_alive(int(match.group(1)))
    try:
        old = time.time() - folder.stat().st_mtime > STALE_AFTER_S
        bound = Path("/proc/net/unix").read_text()
    except OSError:
        return False
    return old and f"{folder}/" not in bound


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def new_ipc_dir() -> str:
    """A fresh folder for one engine's sockets (stale folders removed first)."""
    remove_stale_ipc_dirs()
    return tempfile.mkdtemp(prefix=f"{IPC_DIR_PREFIX}{os.getpid()}-")
