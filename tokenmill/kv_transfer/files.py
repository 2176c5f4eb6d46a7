"""File helpers the KV connectors that write files share (:mod:`~tokenmill.kv_transfer.shared_memory`'s
per-request files, :mod:`~tokenmill.kv_transfer.offloading`'s tier blocks and its metadata files).

A reader must never see half a file: every file is written under a temporary name beside it and renamed
into place (``os.replace``, atomic within one POSIX file system), and a failed write leaves nothing behind.
"""

from __future__ import annotations

import os
from collections.abc import Callable


def tmp_path(path: str) -> str:
    """The temporary name :func:`write_atomically` fills for ``path`` (``<path>.tmp.<pid>``: two processes
    writing the same file never share one; ``".tmp" in name`` marks a write a crash interrupted)."""
    return f"{path}.tmp.{os.getpid()}"


def write_atomically(path: str, write: Callable[[str], None]) -> None:
    """Create or replace ``path`` whole: ``write(tmp)`` writes the content to :func:`tmp_path`, which is
    then renamed over ``path``.

    Args:
        path: the file to create or replace (its directory must exist).
        write: writes the whole content to the file name it is given.

    Raises:
        whatever ``write`` or the rename raises (``OSError``, e.g. ENOSPC on a full disk), after removing
        the partial temporary file; ``path`` is then unchanged.
    """
    tmp = tmp_path(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        unlink_quietly(tmp)
        raise


def unlink_quietly(path: str) -> None:
    """Remove ``path`` if it can be removed (already gone, or not ours to remove: nothing happens)."""
    try:
        os.unlink(path)
    except OSError:
        pass
