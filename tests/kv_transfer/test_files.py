"""tokenmill/kv_transfer/files.py: a file is replaced whole or not at all, and a failed write leaves nothing."""

from __future__ import annotations

import os

import pytest

from tokenmill.kv_transfer.files import tmp_path as tmp_path_of, unlink_quietly, write_atomically


def _write(text: str):
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)
    return write


def test_write_replaces_the_file_whole(tmp_path):
    p = str(tmp_path / "a.json")
    write_atomically(p, _write("one"))
    write_atomically(p, _write("two"))
    assert open(p).read() == "two" and os.listdir(tmp_path) == ["a.json"]


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_failed_write_leaves_the_old_file_and_no_partial_one(tmp_path, error):
    p = str(tmp_path / "a.json")
    write_atomically(p, _write("old"))

    def half(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write("partial")
        raise error

    with pytest.raises(type(error)):
        write_atomically(p, half)
    assert open(p).read() == "old" and os.listdir(tmp_path) == ["a.json"]


def test_tmp_names_are_per_process_and_marked(tmp_path):
    p = str(tmp_path / "b")
    assert tmp_path_of(p).startswith(p + ".tmp") and str(os.getpid()) in tmp_path_of(p)
    unlink_quietly(p)                       # not there: nothing happens
    unlink_quietly(str(tmp_path))           # a directory is not unlinked, and no error either
    assert tmp_path.is_dir()
