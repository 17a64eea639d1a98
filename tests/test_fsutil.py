"""The platform primitives and their portable fallbacks, run here by hiding the
Linux-only functions (macOS may lack ``os.preadv``; only it has ``F_FULLFSYNC``)."""

import errno
import os

import mlx.core as mx
import pytest
from conftest import compute_cache, random_tokens

from kvstore import KVStore
from kvstore.platform import fsutil


def test_open_regular_opens_a_file(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"abc")
    fd = fsutil.open_regular(str(path))
    try:
        assert os.read(fd, 10) == b"abc"
    finally:
        os.close(fd)


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory"])
def test_open_regular_refuses_at_once(tmp_path, kind):
    target = tmp_path / "target"
    target.write_bytes(b"abc")
    path = str(tmp_path / "p")
    {"fifo": os.mkfifo, "directory": os.mkdir}.get(
        kind, lambda p: os.symlink(target, p)
    )(path)
    with pytest.raises(fsutil.NotRegularFile, match=r"symbolic link|regular file"):
        fsutil.open_regular(path)


def test_open_regular_missing(tmp_path):
    with pytest.raises(FileNotFoundError):
        fsutil.open_regular(str(tmp_path / "none"))


@pytest.fixture(params=["preadv", "lseek+readv"])
def read_mode(request, monkeypatch):
    if request.param == "preadv" and not hasattr(os, "preadv"):
        pytest.skip("no os.preadv here (macOS mode)")
    if request.param != "preadv":
        monkeypatch.delattr(os, "preadv", raising=False)
    return request.param


def test_preadv_scatters_in_order(tmp_path, read_mode):
    data = bytes(range(256)) * 40
    path = tmp_path / "f"
    path.write_bytes(data)
    parts = [bytearray(n) for n in (1, 1000, 3000, 7)]
    fd = os.open(path, os.O_RDONLY)
    try:
        got = fsutil.preadv(fd, [memoryview(p) for p in parts], 17, nbytes=4008)
        assert got == 4008
        assert b"".join(parts) == data[17 : 17 + 4008]
        # At the end of the file: short, and says so.
        tail = bytearray(100)
        assert fsutil.preadv(fd, [memoryview(tail)], len(data) - 10, nbytes=100) == 10
    finally:
        os.close(fd)


def test_preadv_resumes_after_short_reads(tmp_path, monkeypatch):
    data = os.urandom(5000)
    path = tmp_path / "f"
    path.write_bytes(data)
    real = getattr(os, "preadv", None)
    if real is None:
        pytest.skip("no os.preadv here (macOS mode)")

    def short(fd, buffers, offset):  # at most 7 bytes a call, as a slow FS may do
        return real(fd, [memoryview(buffers[0])[:7]], offset)

    monkeypatch.setattr(os, "preadv", short)
    parts = [bytearray(n) for n in (3, 2000, 2997)]
    fd = os.open(path, os.O_RDONLY)
    try:
        assert fsutil.preadv(fd, [memoryview(p) for p in parts], 0, nbytes=5000) == 5000
    finally:
        os.close(fd)
    assert b"".join(parts) == data


class _FakeFcntl:
    """``fcntl`` with macOS's ``F_FULLFSYNC``; ``fails`` as on a file system without it."""

    F_FULLFSYNC = 51

    def __init__(self, fails: bool):
        self.fails, self.calls = fails, []

    def fcntl(self, fd, cmd):
        self.calls.append(cmd)
        if self.fails:
            raise OSError(self.fails, os.strerror(self.fails))
        return 0


@pytest.mark.parametrize("fails", [0, errno.ENOTSUP, errno.EINVAL])
def test_fsync_uses_full_fsync_where_offered(tmp_path, monkeypatch, fails):
    fake, plain = _FakeFcntl(fails), []
    monkeypatch.setattr(fsutil, "fcntl", fake)
    monkeypatch.setattr(os, "fsync", lambda fd: plain.append(fd))
    with open(tmp_path / "f", "wb") as f:
        fsutil.fsync(f.fileno())
        assert fake.calls == [51]
        assert plain == ([f.fileno()] if fails else [])
    fsutil.fsync_dir(str(tmp_path))
    assert fake.calls == [51, 51]


def test_store_round_trip_through_the_fallbacks(tmp_path, model, monkeypatch):
    """Save and restore bit-exactly with no ``os.preadv`` and macOS's full fsync."""
    monkeypatch.delattr(os, "preadv", raising=False)
    fake = _FakeFcntl(fails=0)
    monkeypatch.setattr(fsutil, "fcntl", fake)
    tokens = random_tokens(70, 3)
    want = compute_cache(model, tokens)
    with KVStore(str(tmp_path / "s"), model, chunk_tokens=16, ram_bytes=0) as s:
        s.save(tokens, want)
        s.flush()
        cache, n = s.fetch(tokens + [1])
    assert n == len(tokens) and fake.calls
    for got, ref in zip(cache, want):
        assert mx.array_equal(got.keys[:, :, :n], ref.keys[:, :, :n]).item()
        assert mx.array_equal(got.values[:, :, :n], ref.values[:, :, :n]).item()


@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC])
def test_full_fsync_io_error_is_raised_not_retried(tmp_path, monkeypatch, err):
    """An I/O error of F_FULLFSYNC is the write failing: a plain fsync after it could
    succeed and hide that the data never reached the disk."""
    fake, plain = _FakeFcntl(err), []
    monkeypatch.setattr(fsutil, "fcntl", fake)
    monkeypatch.setattr(os, "fsync", lambda fd: plain.append(fd))
    with open(tmp_path / "f", "wb") as f:
        with pytest.raises(OSError) as e:
            fsutil.fsync(f.fileno())
    assert e.value.errno == err and plain == []


# -- paths inside a store, directory modes, record locks --------------------------------


def test_open_regular_beneath_follows_no_link(tmp_path):
    (tmp_path / "root" / "a").mkdir(parents=True)
    (tmp_path / "root" / "a" / "f").write_bytes(b"in")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "f").write_bytes(b"out")
    fd = fsutil.open_regular_beneath(str(tmp_path / "root"), ["a", "f"])
    try:
        assert os.read(fd, 10) == b"in"
    finally:
        os.close(fd)
    os.symlink(tmp_path / "out", tmp_path / "root" / "b")
    with pytest.raises(fsutil.NotRegularFile, match="not a directory"):
        fsutil.open_regular_beneath(str(tmp_path / "root"), ["b", "f"])
    with pytest.raises(fsutil.NotRegularFile):
        fsutil.check_real_dirs(str(tmp_path / "root"), ["b"])
    fsutil.check_real_dirs(str(tmp_path / "root"), ["a", "missing"])  # passes
    with pytest.raises(FileNotFoundError):
        fsutil.open_regular_beneath(str(tmp_path / "root"), ["a", "none"])


def _read_all(fd):
    try:
        return os.read(fd, 100)
    finally:
        os.close(fd)


def test_dirs_beneath_opens_each_directory_once(tmp_path, monkeypatch):
    root = tmp_path / "root"
    for d in ("a/x", "a/y", "b/x"):
        (root / d).mkdir(parents=True)
        for name in ("f", "g"):
            (root / d / name).write_bytes(f"{d}/{name}".encode())
    opens = []
    real_open = os.open
    monkeypatch.setattr(
        os, "open", lambda p, *a, **k: opens.append(p) or real_open(p, *a, **k)
    )
    order = [["a", "x", "f"], ["a", "x", "g"], ["a", "y", "f"], ["b", "x", "g"]]
    with fsutil.DirsBeneath(str(root)) as dirs:
        got = [_read_all(dirs.open(parts)) for parts in order]
        assert len(dirs._fds) == 3  # root, b, x kept
    assert got == [b"a/x/f", b"a/x/g", b"a/y/f", b"b/x/g"]
    # root, a, x, f, g; then y, f; then b, x, g: 10 opens, not 4 per file
    assert len(opens) == 10
    assert dirs._fds == [] and dirs._names == []


def test_dirs_beneath_looks_again_through_a_replaced_directory(tmp_path):
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    (root / "a" / "f").write_bytes(b"old")
    with fsutil.DirsBeneath(str(root)) as dirs:
        assert _read_all(dirs.open(["a", "f"])) == b"old"
        os.unlink(root / "a" / "f")
        os.rmdir(root / "a")  # the kept descriptor now names a removed directory
        (root / "a").mkdir()
        (root / "a" / "g").write_bytes(b"new")
        assert _read_all(dirs.open(["a", "g"])) == b"new"
        with pytest.raises(FileNotFoundError):
            dirs.open(["a", "none"])
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "f").write_bytes(b"out")
        os.symlink(tmp_path / "out", root / "b")
        with pytest.raises(fsutil.NotRegularFile, match="not a directory"):
            dirs.open(["b", "f"])
        os.symlink(tmp_path / "out" / "f", root / "a" / "link")
        with pytest.raises(fsutil.NotRegularFile, match="symbolic link"):
            dirs.open(["a", "link"])


def test_makedirs_modes_ignore_a_permissive_umask(tmp_path):
    old = os.umask(0)
    try:
        fsutil.makedirs(str(tmp_path / "x" / "y" / "z"))
    finally:
        os.umask(old)
    for p in ("x", "x/y", "x/y/z"):
        assert os.stat(tmp_path / p).st_mode & 0o777 == 0o755


def test_lock_byte_excludes_another_process(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        assert fsutil.lock_byte(fd, 1, exclusive=False, blocking=True)
        probe = (
            "import os, sys; from kvstore.platform import fsutil; "
            "fd = os.open(sys.argv[1], os.O_RDWR); "
            "print(fsutil.lock_byte(fd, 1, exclusive=True, blocking=False), "
            "fsutil.lock_byte(fd, 0, exclusive=True, blocking=False))"
        )
        run = lambda: subprocess.run(  # noqa: E731
            [sys.executable, "-c", probe, str(path)], capture_output=True, text=True
        ).stdout.split()
        assert run() == ["False", "True"]  # byte 1 is held shared here; byte 0 free
        fsutil.unlock_byte(fd, 1)
        assert run() == ["True", "True"]
    finally:
        os.close(fd)


def test_lock_byte_without_record_locks_locks_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(fsutil, "fcntl", None)  # Windows; or no lockf
    fd = os.open(tmp_path / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        assert fsutil.lock_byte(fd, 0, exclusive=True, blocking=False)
        fsutil.unlock_byte(fd, 0)
    finally:
        os.close(fd)


def test_remove_leftovers_takes_only_old_files_of_the_prefix(tmp_path):
    """What a killed writer left (old, of the prefix) goes; a live writer's file
    (young) and other files stay."""
    import time

    names = [".checked.1.aa", ".checked.2.bb", "checked", ".spare.3.cc"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    old = time.time() - 120
    for name in (".checked.1.aa", ".spare.3.cc", "checked"):
        os.utime(tmp_path / name, (old, old))
    fsutil.remove_leftovers(str(tmp_path), ".checked.", older_than_s=60)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".checked.2.bb",
        ".spare.3.cc",
        "checked",
    ]
    fsutil.remove_leftovers(str(tmp_path / "missing"), ".x", older_than_s=0)
