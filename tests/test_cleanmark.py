"""The clean mark (kvstore.disk.cleanmark): an index closed after its full page check,
unchanged since, opens without checking again; any change, damage, crash, copy or a
file system with coarse times makes the next open check every page as before."""

import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap

import mdbdamage as damage
import numpy as np

from kvstore.disk import cleanmark, pageguard
from kvstore.disk.index import Index, NodeRecord

NS = bytes(range(16))
ROOT = b"\x00" * 16


def _rec(i: int) -> NodeRecord:
    tokens = np.arange(20, dtype=np.int32) + i
    return NodeRecord(ROOT, 0, tokens, 1000, 123, "user", False, 1.5)


def _h(i: int) -> bytes:
    return struct.pack(">QQ", 0xABCD, i)


def _put(idx: Index, first: int, n: int = 1) -> None:
    idx.write(
        lambda t: [idx.put_node(t, NS, _h(i), _rec(i)) for i in range(first, first + n)]
    )


def _store(tmp_path, nodes: int = 3000) -> str:
    """A store directory whose index has trees below their roots, closed cleanly."""
    store = tmp_path / "store"
    idx = Index(str(store / "index"))
    _put(idx, 0, nodes)
    idx.close()
    return str(store)


def _audit_of_open(path: str):
    """How a fresh open's full page check went: (checked_by, failure)."""
    idx = Index(os.path.join(path, "index"), create=False)
    try:
        audit = idx._shared.audit
        failure = audit.wait()
        return audit.checked_by, failure
    finally:
        idx.close()


def _marked(path: str) -> bool:
    return os.path.exists(os.path.join(path, "index", cleanmark.MARK_NAME))


def test_a_clean_close_marks_the_index_and_the_next_open_trusts_it(tmp_path):
    """The next open passes at once (no thread, no child), and writes do not wait."""
    path = _store(tmp_path)
    assert _marked(path)
    idx = Index(os.path.join(path, "index"), create=False)
    try:
        audit = idx._shared.audit
        assert audit.passed and audit.checked_by == "mark"
        assert audit._thread is None  # no background check was started
        _put(idx, 5000)
        assert idx.get_node(NS, _h(5000)) is not None
    finally:
        idx.close()
    # Its own commits keep the file explained: it leaves a new mark.
    assert _audit_of_open(path) == ("mark", None)


def test_damage_written_just_after_a_clean_close_is_found(tmp_path):
    """Zeroing a leaf right after the close (within the coarse clock's tick) changes
    the file's time away from the close's stamp: the open checks every page."""
    path = _store(tmp_path)
    damage.zero_page(path, damage.find(path, "nodes", leaf=True)[3])
    by, failure = _audit_of_open(path)
    assert by in ("thread", "process") and "is zeroed" in (failure or ""), failure
    assert not _marked(path)  # damage found: the mark is gone


def test_damage_written_while_open_leaves_no_mark(tmp_path):
    """Bytes written into the file by anything but this process's commits, even
    between two of them and never read, keep its close from marking the file."""
    path = _store(tmp_path)
    idx = Index(os.path.join(path, "index"), create=False)
    try:
        assert idx._shared.audit.checked_by == "mark"
        damage.zero_page(path, damage.find(path, "nodes", leaf=True)[5])
        _put(idx, 7000)  # a commit after the damage: the file's time moves on
        assert not idx._shared.audit.watch.explained
    finally:
        idx.close()
    by, failure = _audit_of_open(path)
    assert by != "mark" and "is zeroed" in (failure or ""), (by, failure)


def test_another_process_commit_leaves_this_process_no_mark(tmp_path):
    """A commit of another process while this one has the index open: this
    process's close does not vouch for it (that process marks its own close)."""
    path = _store(tmp_path)
    index_dir = os.path.join(path, "index")
    idx = Index(index_dir, create=False)
    try:
        code = textwrap.dedent(f"""
            import sys
            sys.path[:0] = {sys.path!r}
            from test_cleanmark import _put
            from kvstore.disk.index import Index
            idx = Index({index_dir!r}, create=False)
            _put(idx, 9000)
            idx.close()
        """)
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
        _put(idx, 9001)  # after the other's commit: its mark is stale now
        assert not idx._shared.audit.watch.explained
    finally:
        idx.close()
    assert _audit_of_open(path)[0] in ("thread", "process")


def test_a_process_killed_with_the_index_open_leaves_no_mark_that_holds(tmp_path):
    """A crash (no close): the old mark names the file before the crashed process's
    commits, so the next open checks every page."""
    path = _store(tmp_path)
    index_dir = os.path.join(path, "index")
    code = textwrap.dedent(f"""
        import os, sys
        sys.path[:0] = {sys.path!r}
        from test_cleanmark import _put
        from kvstore.disk.index import Index
        idx = Index({index_dir!r}, create=False)
        _put(idx, 9000)
        os._exit(0)
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert _marked(path)
    assert _audit_of_open(path) == ("thread", None)


def test_a_copy_of_a_marked_store_is_checked(tmp_path):
    """copytree keeps the modification time: the mark names another inode."""
    path = _store(tmp_path)
    copy = str(tmp_path / "copy")
    shutil.copytree(path, copy)
    assert _audit_of_open(copy) == ("thread", None)


def test_marks_that_are_not_marks_are_ignored(tmp_path):
    """A mark of the wrong shape, size or values is doubt: the open checks."""
    path = _store(tmp_path)
    mark = os.path.join(path, "index", cleanmark.MARK_NAME)
    with open(mark) as f:
        good = json.load(f)
    wrong = [
        b"",
        b"not json",
        b"[]",
        b"x" * 10_000,
        json.dumps({**good, "mtime_ns": good["mtime_ns"] + 1}).encode(),
        json.dumps({**good, "metas": good["metas"][::-1]}).encode(),
        json.dumps({**good, "version": 2}).encode(),
    ]
    for raw in wrong:
        with open(mark, "wb") as f:
            f.write(raw)
        os.utime(os.path.join(path, "index", "data.mdb"), ns=(good["mtime_ns"],) * 2)
        assert _audit_of_open(path)[0] == "thread", raw[:40]
        os.unlink(mark)  # the check's close marked the file again
    with open(mark, "w") as f:  # the control: the mark itself holds
        json.dump(good, f)
    os.utime(os.path.join(path, "index", "data.mdb"), ns=(good["mtime_ns"],) * 2)
    assert _audit_of_open(path)[0] == "mark"


def test_coarse_file_times_leave_no_mark(tmp_path, monkeypatch):
    """A file system keeping whole seconds (HFS+, some network file systems): a
    later write within the second could leave the stamp, so no mark is left."""
    real = os.utime

    def coarse(target, *, ns):
        real(target, ns=tuple(t // 10**9 * 10**9 for t in ns))

    monkeypatch.setattr(cleanmark.os, "utime", coarse)
    path = _store(tmp_path)
    assert not _marked(path)
    assert _audit_of_open(path)[0] == "thread"


def test_a_large_index_without_a_mark_is_still_checked_in_a_child(
    tmp_path, monkeypatch
):
    """The mark skips the check only where it holds: remove it and a large
    index's open checks every page in the child process as before."""
    path = _store(tmp_path)
    os.unlink(os.path.join(path, "index", cleanmark.MARK_NAME))
    monkeypatch.setattr(pageguard, "CHILD_PAGES", 0)
    assert _audit_of_open(path) == ("process", None)


def test_without_futimens_the_stamp_is_set_by_path(tmp_path, monkeypatch):
    """Platforms whose os.utime takes no descriptor: the stamp goes through the
    path, and the mark holds as before."""
    monkeypatch.setattr(cleanmark.os, "supports_fd", os.supports_fd - {os.utime})
    path = _store(tmp_path)
    assert _marked(path)
    assert _audit_of_open(path) == ("mark", None)


def test_a_mark_that_cannot_be_written_costs_only_the_next_check(tmp_path, monkeypatch):
    """An error while leaving the mark (a read-only directory, say) is logged; the
    close completes and the next open checks every page."""

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(cleanmark.os, "replace", refuse)
    path = _store(tmp_path)
    assert not _marked(path)
    assert sorted(os.listdir(os.path.join(path, "index"))) == [
        "data.mdb",
        "kvstore.lock",
        "lock.mdb",
    ]  # no temporary mark left behind
    assert _audit_of_open(path)[0] == "thread"


def test_a_marked_open_checks_every_page_only_without_the_mark(tmp_path):
    """check="marked" (kvstore serve's start): the mark stands for the full check;
    without it, or after damage, every page is checked before the open returns."""
    from kvstore.disk.storecheck import StoreError

    path = _store(tmp_path)
    index_dir = os.path.join(path, "index")
    idx = Index(index_dir, create=False, check="marked")
    assert idx._shared.audit.checked_by == "mark" and idx._shared.audit.passed
    idx.close()
    os.unlink(os.path.join(index_dir, cleanmark.MARK_NAME))
    idx = Index(index_dir, create=False, check="marked")
    assert idx._shared.audit.passed and idx._shared.audit.checked_by is None
    idx.close()  # checked whole: the close marks it again
    assert _marked(path)
    damage.zero_page(path, damage.find(path, "nodes", leaf=True)[3])
    try:
        Index(index_dir, create=False, check="marked").close()
    except StoreError as e:
        assert "is zeroed" in str(e)
    else:
        raise AssertionError("a zeroed leaf opened")
