"""The fallbacks kvstore takes where a Linux-only call is missing (macOS), each run
here, and the tests' macOS mode itself (``KVSTORE_TEST_PLATFORM=macos``: see
``tests/macos_site/macos_shim.py`` and docs/macos.md)."""

import errno
import os
import subprocess
import sys
import time

import pytest
from conftest import compute_cache, random_tokens

from kvstore import KVStore
from kvstore.disk import blobs, reservations
from kvstore.disk.publish import write_one
from kvstore.platform import fsutil, memutil

MACOS_MODE = os.environ.get("KVSTORE_TEST_PLATFORM") == "macos"
NS = bytes(16)


# -- no overwrite when publishing a chunk file -------------------------------------


@pytest.fixture(params=["link", "rename-noreplace", "check-then-replace"])
def publish_mode(request, monkeypatch):
    """How ``link_noreplace`` publishes: a hard link, or (no hard links on this file
    system) an atomic no-replace rename, or (neither) a check then a replace."""
    if request.param != "link":

        def no_link(src, dst):
            raise OSError(errno.EPERM, "Operation not permitted", dst)

        monkeypatch.setattr(os, "link", no_link)
    if request.param == "check-then-replace":
        monkeypatch.setattr(fsutil, "_rename_noreplace", lambda src, dst: False)
    return request.param


def test_link_noreplace_never_replaces(tmp_path, publish_mode):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.write_bytes(b"new")
    dst.write_bytes(b"old")
    with pytest.raises(FileExistsError):
        fsutil.link_noreplace(str(src), str(dst))
    assert dst.read_bytes() == b"old" and src.read_bytes() == b"new"
    dst.unlink()
    fsutil.link_noreplace(str(src), str(dst))
    assert dst.read_bytes() == b"new"
    assert src.exists() == (publish_mode == "link")


def test_second_writer_adopts_the_first_file(tmp_path, publish_mode):
    """Two writers of one node with different bytes: the first file stays, the second
    writer adopts it (its checksum), whichever way the name was published."""
    store = blobs.Blobs(str(tmp_path / "blobs"), str(tmp_path / "q"))
    h = bytes(range(16))
    first, second = _node(1), _node(2)
    a = write_one(store, NS, h, first)
    b = write_one(store, NS, h, second)
    assert a.ours and not b.ours
    assert (a.nbytes, a.checksum) == (b.nbytes, b.checksum)
    with open(store.path(NS, h), "rb") as f:
        assert f.read() == first
    leftovers = [
        n for n in os.listdir(os.path.dirname(store.path(NS, h))) if ".tmp" in n
    ]
    assert leftovers == []


def _node(value) -> bytes:
    import numpy as np

    data = np.full((1, 2, 4, 8), value, np.float32)
    return blobs.serialize_node(
        {"0.keys": ("float32", data.shape, data)}, blobs.node_metadata(NS)
    )


def test_store_round_trip_without_hard_links(tmp_path, model, publish_mode):
    tokens = random_tokens(70, 3)
    with KVStore(str(tmp_path / "s"), model, chunk_tokens=16, ram_bytes=0) as s:
        s.save(tokens, compute_cache(model, tokens))
        s.flush()
        assert s.fetch(tokens + [1])[1] == len(tokens)
        assert s.stats()["writes_failed"] == 0


# -- IOV_MAX ---------------------------------------------------------------------


@pytest.mark.parametrize("answer", [ValueError("unknown name"), OSError(), -1])
def test_iov_max_falls_back_to_the_posix_minimum(monkeypatch, answer):
    def sysconf(name):
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(os, "sysconf", sysconf)
    assert fsutil.iov_max() == 16


# -- process start times (reservations) ---------------------------------------------


def _proc_start(pid):
    """The real /proc start time (ticks), read even when the macOS mode hides /proc."""
    import builtins

    real_open = getattr(builtins.open, "__wrapped__", builtins.open)
    try:
        with real_open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2 :].split()[19])


def _fake_kinfo(pid):
    """A kinfo_proc as macOS's sysctl fills it: p_starttime first, 648 bytes; none
    for a pid that does not exist. Built from the real start time."""
    ticks = _proc_start(pid)
    if ticks is None:
        return b""
    sec, usec = divmod(1_700_000_000 * 100 + ticks, 100)
    return reservations._TIMEVAL.pack(sec, usec * 10_000) + bytes(
        reservations._KINFO_SIZE - reservations._TIMEVAL.size
    )


@pytest.fixture
def darwin(monkeypatch):
    """process_start_time as on macOS: no /proc, sysctl's kinfo_proc (faked)."""
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(reservations, "_proc_start_time", lambda pid: None)
    monkeypatch.setattr(reservations, "_darwin_kinfo", _fake_kinfo)
    monkeypatch.setattr(reservations, "_identity", {})


@pytest.mark.skipif(_proc_start(os.getpid()) is None, reason="needs /proc to fake it")
def test_darwin_start_times_tell_a_reused_pid(darwin):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        start = reservations.process_start_time(sleeper.pid)
        assert start and start % 1_000_000 < 1_000_000
        assert reservations.process_alive(sleeper.pid, start)
        assert not reservations.process_alive(sleeper.pid, start + 1)  # reused pid
    finally:
        sleeper.kill()
        sleeper.wait()
    assert reservations.process_start_time(sleeper.pid) is None
    assert not reservations.process_alive(sleeper.pid, start)


def test_parse_kinfo():
    raw = reservations._TIMEVAL.pack(1_700_000_123, 456_789) + bytes(632)
    assert reservations._parse_kinfo(raw) == 1_700_000_123_456_789
    assert reservations._parse_kinfo(b"") is None  # sysctl: no such process
    assert reservations._parse_kinfo(bytes(648)) is None


def test_darwin_sysctl_is_only_asked_on_macos(monkeypatch):
    asked = []
    monkeypatch.setattr(reservations, "_proc_start_time", lambda pid: None)
    monkeypatch.setattr(reservations, "_darwin_kinfo", lambda pid: asked.append(pid))
    assert reservations.process_start_time(os.getpid()) is None
    assert asked == []


def test_without_start_times_a_reused_pid_counts_until_stale(monkeypatch):
    """The weaker guarantee where no start time is known: a dead writer's reservation
    whose pid now belongs to another live process counts until STALE_SECONDS."""
    monkeypatch.setattr(reservations, "process_start_time", lambda pid: None)
    monkeypatch.setattr(reservations, "_identity", {})  # this process's, cached
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        now = time.time()
        res = reservations.Reservation(b"k", other.pid, 0, 100, now)
        assert not reservations.is_stale(res, now=now)  # the pid is alive: counted
        late = now + reservations.STALE_SECONDS + 1
        assert reservations.is_stale(res, now=late)
    finally:
        other.kill()
        other.wait()
    assert reservations.is_stale(res, now=now)  # the pid is gone


# -- the macOS mode itself ----------------------------------------------------------


@pytest.mark.skipif(not MACOS_MODE, reason="KVSTORE_TEST_PLATFORM=macos only")
def test_macos_mode_hides_linux_calls_here_and_in_children(tmp_path, model):
    import fcntl

    import macos_shim

    assert not hasattr(os, "preadv") and not hasattr(os, "posix_fadvise")
    assert not hasattr(os, "sched_getaffinity")
    with pytest.raises(FileNotFoundError):
        open("/proc/self/stat")
    assert reservations.process_start_time(os.getpid()) is None
    assert fcntl.F_FULLFSYNC == 51
    assert fsutil.sync_file_range is None  # Linux's libc calls, bound through ctypes
    assert not memutil.prefault_supported()
    before = macos_shim.FULLFSYNC_CALLS[0]
    tokens = random_tokens(40, 4)
    with KVStore(str(tmp_path / "s"), model, chunk_tokens=16, ram_bytes=0) as s:
        s.save(tokens, compute_cache(model, tokens))
        s.flush()
        assert s.fetch(tokens + [1])[1] == len(tokens)
    assert macos_shim.FULLFSYNC_CALLS[0] > before  # chunk files went through it
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, fcntl; from kvstore.platform import fsutil, memutil; "
            "print(hasattr(os, 'preadv'), os.path.exists('/proc/self'), "
            "fcntl.F_FULLFSYNC, fsutil.sync_file_range, memutil.prefault_supported())",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert child.stdout.split() == ["False", "False", "51", "None", "False"]
