"""The process-mode disk watch (sandbox_call.workdir_usage) against trees a hostile call can build:
paths longer than PATH_MAX, a directory it made unreadable, a directory swapped for a symlink into the
user's files between the listing and the open. The walk goes by directory descriptors and changes
nothing; what it cannot read kills the call."""

from __future__ import annotations

import os
import pickle
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from megatron_sao.envs import sandbox_call  # noqa
from megatron_sao.envs.sandbox_call import workdir_usage

NOBODY = 65534
LONG = "x" * 250
_DIR = os.O_RDONLY | os.O_DIRECTORY


def _deep_tree(root: str, levels: int, files: int, size: int) -> None:
    """`levels` directories of 250-character names (a path of 20 is past PATH_MAX), `files` files of
    `size` bytes at the bottom; made relative to descriptors, as a sandboxed call would."""
    fd = os.open(root, _DIR)
    for _ in range(levels):
        os.mkdir(LONG, dir_fd=fd)
        sub = os.open(LONG, _DIR, dir_fd=fd)
        os.close(fd)
        fd = sub
    for i in range(files):
        f = os.open(f"f{i}", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd)
        os.write(f, b"y" * size)
        os.close(f)
    os.close(fd)


def test_a_tree_longer_than_path_max_is_counted_in_full(tmp_path):
    _deep_tree(str(tmp_path), levels=20, files=40, size=1 << 20)  # 40 MiB, 60 entries, 5000-char paths
    used, n, problem = workdir_usage(str(tmp_path), 10_000)
    assert problem is None and n == 60, (n, problem)
    assert used >= 40 << 20
    used, n, problem = workdir_usage(str(tmp_path), 50)  # the file-count bound still stops the walk
    assert n == 51 and problem is None


def test_a_tree_deeper_than_the_bound_kills_the_call(tmp_path):
    _deep_tree(str(tmp_path), levels=sandbox_call.MAX_DEPTH + 1, files=0, size=0)
    _, _, problem = workdir_usage(str(tmp_path), 10_000)
    assert problem is not None and f"deeper than {sandbox_call.MAX_DEPTH}" in problem


def _as_nobody(fn, *args):
    """Run fn(*args) in a forked child as an unprivileged uid (root reads 000 directories); its result."""
    if os.geteuid() != 0:
        pytest.skip("needs root to drop to another uid (CI runs as root)")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            out = ("ok", fn(*args))
        except BaseException as e:  # noqa: BLE001 (reported to the parent)
            out = ("error", repr(e))
        os.write(w, pickle.dumps(out))
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    kind, value = pickle.loads(data)
    assert kind == "ok", value
    return value


@pytest.fixture
def base():
    """A folder the unprivileged uid can reach (pytest's tmp_path is under root's 0700 folder)."""
    d = Path(tempfile.mkdtemp(prefix="sao-watch-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    for p in d.rglob("*"):  # what the tests made 000
        if p.is_dir() and not p.is_symlink():
            p.chmod(0o700)
    shutil.rmtree(d, ignore_errors=True)


def _owned_by_nobody(*paths) -> None:
    for p in paths:
        os.chown(p, NOBODY, NOBODY)


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_an_unreadable_directory_kills_the_call_and_is_left_as_it_is(base):
    work = base / "work"
    work.mkdir()
    (work / "d").mkdir()
    (work / "d" / "f").write_bytes(b"z" * 4096)
    _owned_by_nobody(work, work / "d", work / "d" / "f")
    (work / "d").chmod(0o000)  # the call's mkdir(d, 0): Landlock does not govern modes

    def walk():
        return workdir_usage(str(work), 1000)

    _, _, problem = _as_nobody(walk)
    assert problem is not None and "./d" in problem and "Permission denied" in problem, problem
    assert _mode(work / "d") == 0o000  # never opened up by the watch


def test_a_directory_swapped_for_a_symlink_is_not_followed(base, monkeypatch):
    """The race the watch lost (3 of 3 tries with a busy trainer thread): `d` is listed as a directory,
    then replaced by a symlink to a 000 directory of the user before the watch reads it. The swap is
    made deterministic here by doing it the moment the watch first touches `d`."""
    work, user = base / "work", base / "home"
    work.mkdir()
    user.mkdir()
    (work / "d").mkdir()
    (user / "private").mkdir()
    _owned_by_nobody(work, user, work / "d", user / "private")
    (user / "private").chmod(0o000)
    swapped = []

    def swap_once(path) -> None:
        if not swapped and os.fsdecode(path).rstrip("/").endswith("d") and os.path.isdir(work / "d"):
            swapped.append(path)
            os.rmdir(work / "d")
            os.symlink(user / "private", work / "d")

    real_open, real_scandir = os.open, os.scandir

    def open_(path, *a, **kw):
        if isinstance(path, (str, bytes)):
            swap_once(path)
        return real_open(path, *a, **kw)

    def scandir_(path="."):
        if isinstance(path, (str, bytes)):
            swap_once(path)
        return real_scandir(path)

    def walk():
        monkeypatch.setattr(os, "open", open_)
        monkeypatch.setattr(os, "scandir", scandir_)
        return workdir_usage(str(work), 1000), swapped

    (_, _, problem), seen = _as_nobody(walk)
    assert seen, "the swap did not happen: the test checks nothing"
    assert _mode(user / "private") == 0o000  # the user's directory is untouched
    assert problem is not None and "./d" in problem, problem  # and the call is killed
