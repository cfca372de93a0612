"""`videosparse._io`: the JSON conversion of keys and numpy bools, the standard streams each written through its
own Python stream, an open file's /proc link written in place, and a folder whose file system refuses fsync."""

import errno
import json
import os
import stat

import numpy as np
import pytest

from videosparse._io import from_jsonable, to_jsonable, write_atomic, writes_in_place


def test_keys_become_strings_and_numpy_bools_become_json_bools():
    data = {3: 1.5, (0, 1): float("-inf"), "nested": {2: np.float32(0.5)},
            "ok": np.bool_(True), "flags": [np.bool_(False), True]}
    out = to_jsonable(data)
    assert out == {"3": 1.5, "(0, 1)": "-inf", "nested": {"2": 0.5}, "ok": True, "flags": [False, True]}
    assert out["ok"] is True and out["flags"][0] is False
    text = json.dumps(out, allow_nan=False)
    assert '"ok": true' in text and '"flags": [false, true]' in text
    assert from_jsonable(json.loads(text))["(0, 1)"] == float("-inf")


def test_each_standard_stream_path_is_written_through_its_own_stream(capsys):
    for path, text in (("/dev/fd/2", "two\n"), ("/proc/self/fd/2", "proc two\n"), ("/dev/stderr", "err\n")):
        write_atomic(path, text)
        assert capsys.readouterr() == ("", text), path
    for path in ("/dev/fd/1", "/proc/self/fd/1", "/dev/stdout"):
        write_atomic(path, "out\n")
        assert capsys.readouterr() == ("out\n", ""), path


def test_an_open_files_proc_link_is_written_in_place(tmp_path):
    """/proc/self/fd/N of a regular file (a shell's `3> log.json`) names a stream the process holds open: the file is
    written where it is, not replaced by a new one (which the descriptor would no longer see)."""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc")
    target = tmp_path / "log.json"
    target.write_text("old")
    inode = os.stat(target).st_ino
    fd = os.open(target, os.O_WRONLY)
    try:
        link = f"/proc/self/fd/{fd}"
        assert writes_in_place(link) and not writes_in_place(target)
        write_atomic(link, '{"a": 1}')
        assert target.read_text() == '{"a": 1}'
        assert os.stat(target).st_ino == inode == os.fstat(fd).st_ino
    finally:
        os.close(fd)
    assert sorted(os.listdir(tmp_path)) == ["log.json"]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_a_pipe_named_by_its_fd_link_is_written_in_place():
    """Mutation pass 61 find: `writes_in_place` resolved /dev/fd/N with realpath, which for a pipe gives
    "/proc/<pid>/fd/pipe:[inode]" (no such path), so `--json >(jq .)` was refused ("no file can be made in
    '/dev/fd'") and write_atomic tried to make a temporary file beside the pipe."""
    from videosparse._run_checks import check_output

    read_end, write_end = os.pipe()
    try:
        for prefix in ("/dev/fd/", "/proc/self/fd/"):
            path = f"{prefix}{write_end}"
            assert writes_in_place(path), path
            check_output("--json", path)
            write_atomic(path, f"through {prefix}\n")
            assert os.read(read_end, 100) == f"through {prefix}\n".encode(), path
    finally:
        os.close(read_end)
        os.close(write_end)
    assert not writes_in_place(f"/proc/self/fd/{write_end}")         # closed: no such path any more


def test_a_folder_that_takes_no_fsync_does_not_fail_a_write(tmp_path, monkeypatch):
    """Some file systems refuse fsync on a folder (EINVAL): the file's own bytes are synced, the rename is done, and
    the write is not reported as failed; a file that cannot be synced still fails it, naming the path."""
    real_fsync = os.fsync

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "Invalid argument")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    write_atomic(tmp_path / "r.json", "{}")
    assert (tmp_path / "r.json").read_text() == "{}"
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.EIO, "Input/output error")))
    with pytest.raises(OSError, match=f"{str(tmp_path / 's.json')!r} could not be written: Input/output error"):
        write_atomic(tmp_path / "s.json", "{}")
    assert sorted(os.listdir(tmp_path)) == ["r.json"]
