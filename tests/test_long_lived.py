"""A store that lives for months: big deletions, transient resource errors, other
processes' evictions, map growth, a full disk, files kvstore cannot remove and temp
files of dead writers never brick the store, lose valid data or leak files."""

import os
import shutil
import subprocess
import sys
import textwrap

import mlx.core as mx
import numpy as np
import pytest
from conftest import compute_cache, random_tokens, run_cli

from kvstore import KVStore
from kvstore.disk import mdbfile
from kvstore.disk.storecheck import StoreError, check_data_file

pytestmark = pytest.mark.stress

C = 8  # tokens per chunk


def same_kv(got, want, n):
    """``got`` (a restored cache) holds exactly the first ``n`` tokens of ``want``."""
    if n == 0:
        return
    for g, w in zip(got, want):
        assert mx.array_equal(g.keys[:, :, :n], w.keys[:, :, :n]).item()
        assert mx.array_equal(g.values[:, :, :n], w.values[:, :, :n]).item()


# -- a big delete transaction leaves data.mdb shorter than its last page ---------------


@pytest.fixture
def shrunk(tmp_path, model, capsys):
    """A store most of which one transaction deleted (``verify --fix`` of broken nodes
    high in both 100-node prompts), so that LMDB left pages it allocated and freed in
    that transaction unwritten past the file's end; then ``gc --max-bytes``."""
    path = str(tmp_path / "store")
    prompts = [random_tokens(800, seed) for seed in (1, 2)]
    with KVStore(path, model, chunk_tokens=C) as s:
        for tokens in prompts:
            s.save(tokens, compute_cache(model, tokens))
        s.flush()
        for tokens, at in zip(prompts, (1, 3)):
            walk = s.index.read(
                lambda txn, t=tokens: s.parts.reads.trie.walk(
                    txn, np.array(t), limit=len(t)
                )
            )
            with open(s.blobs.path(s.namespace, walk[at].h), "r+b") as f:
                f.seek(-4, os.SEEK_END)
                f.write(b"XXXX")  # a checksum mismatch
    status, out, err = run_cli(capsys, "verify", "--store", path, "--fix")
    assert status == 1 and "problems found (fixed)" in out, out + err
    status, out, err = run_cli(capsys, "gc", "--store", path, "--max-bytes", "60K")
    assert status == 0, err  # was: "data.mdb is truncated ... delete index/"
    return path, prompts


def test_a_big_delete_transaction_leaves_the_store_openable(shrunk, model, capsys):
    path, prompts = shrunk
    data = os.path.join(path, "index", "data.mdb")
    fd = os.open(data, os.O_RDONLY)
    try:
        meta = mdbfile.newest_meta(fd)
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    # The case itself: LMDB's own file ends before the last page it names.
    assert size < (meta.last_page + 1) * meta.page_size
    assert check_data_file(data, path) == size  # was "data.mdb is truncated"
    status, out, err = run_cli(capsys, "verify", "--store", path)
    assert status == 0 and "truncated" not in err, err
    with KVStore(path, model, chunk_tokens=C) as s:
        for tokens, kept in zip(prompts, (1, 3)):
            cache, n = s.fetch(tokens)
            assert n == kept * C
            same_kv(cache, compute_cache(model, tokens[:n]), n)
        assert s.stats()["corrupt"] == 0 and s.stats()["nodes"] == 1 + 3


@pytest.mark.slow
def test_truncation_of_pages_lmdb_reads_is_still_refused(shrunk, tmp_path):
    """Every cut of the shrunk file at a page boundary is either refused, or, when
    accepted, mapped by LMDB with every record read in a child process, which a page
    past the end would kill with SIGBUS."""
    path, _ = shrunk
    data = os.path.join(path, "index", "data.mdb")
    full = os.path.getsize(data)
    psize = 4096
    accepted, refused = [], []
    with open(data, "rb") as f:
        whole = f.read()
    for size in range(2 * psize, full + 1, psize):
        cut = tmp_path / f"cut-{size}"
        os.makedirs(cut / "index")
        (cut / "index" / "data.mdb").write_bytes(whole[:size])
        try:
            check_data_file(str(cut / "index" / "data.mdb"), str(cut))
            accepted.append(str(cut))
        except StoreError as e:
            assert "truncated" in str(e) and "move index/ aside" in str(e)
            refused.append(size)
            shutil.rmtree(cut)
    assert refused and accepted[-1].endswith(f"cut-{full}")
    script = textwrap.dedent("""
        import sys
        from kvstore.disk.index import Index
        for path in sys.argv[1:]:
            idx = Index(path + "/index", create=False, readonly=True)
            def every(txn):
                return sum(
                    len(bytes(k)) + len(bytes(v))
                    for db in idx.db.values()
                    for k, v in txn.cursor(db=db)
                )
            assert idx.read(every) > 0
            idx.close()
        print("read", len(sys.argv) - 1)
        """)
    proc = subprocess.run(
        [sys.executable, "-c", script, *accepted], capture_output=True, text=True
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])


def test_damaged_free_list_is_refused_never_a_crash(shrunk, tmp_path):
    """Random bytes over the short file's free-list pages: accepted or "truncated",
    never another exception (the free list is parsed from untrusted bytes)."""
    path, _ = shrunk
    with open(os.path.join(path, "index", "data.mdb"), "rb") as f:
        whole = bytearray(f.read())
    fd = os.open(os.path.join(path, "index", "data.mdb"), os.O_RDONLY)
    meta = mdbfile.newest_meta(fd)
    os.close(fd)
    page = meta.free_root * meta.page_size
    rng = np.random.default_rng(0)
    target = tmp_path / "index"
    target.mkdir()
    outcomes = set()
    for _ in range(300):
        data = bytearray(whole)
        for at in rng.integers(page, page + meta.page_size, size=rng.integers(1, 6)):
            data[at] = rng.integers(0, 256)
        (target / "data.mdb").write_bytes(bytes(data))
        try:
            check_data_file(str(target / "data.mdb"), str(tmp_path))
            outcomes.add("accepted")
        except StoreError as e:
            assert "truncated" in str(e)
            outcomes.add("refused")
    assert "refused" in outcomes


# -- transient resource errors in a fetch are a miss, never a quarantine ----------------


@pytest.fixture
def saved(tmp_path, model):
    """A store of one 800-token prompt (100 nodes); returns ``(path, tokens)``."""
    path = str(tmp_path / "store")
    tokens = random_tokens(800, 7)
    with KVStore(path, model, chunk_tokens=C) as s:
        s.save(tokens, compute_cache(model, tokens))
    return path, tokens


def quarantined(path) -> list:
    where = os.path.join(path, "quarantine")
    return os.listdir(where) if os.path.isdir(where) else []


@pytest.mark.parametrize(
    "code", ["EMFILE", "ENFILE", "ENOMEM", "EINTR", "EAGAIN", "EIO", "EACCES"]
)
@pytest.mark.parametrize("where", ["open", "read"])
def test_transient_error_is_a_miss_and_an_error(saved, model, monkeypatch, code, where):
    path, tokens = saved
    import errno

    from kvstore.disk import blobs as blobs_module

    with KVStore(path, model, chunk_tokens=C, ram_bytes=0) as s:
        nodes = s.stats()["nodes"]
        calls = []

        def failing(real):
            def call(*args, **kwargs):
                calls.append(1)
                if len(calls) > 40:  # the first 40 nodes read, then the error
                    raise OSError(
                        getattr(errno, code), os.strerror(getattr(errno, code))
                    )
                return real(*args, **kwargs)

            return call

        if where == "open":
            monkeypatch.setattr(s.blobs, "open_file", failing(s.blobs.open_file))
        else:
            monkeypatch.setattr(
                blobs_module.fsutil, "preadv", failing(blobs_module.fsutil.preadv)
            )
        cache, n = s.fetch(tokens)
        assert 0 < n < len(tokens) - 1
        monkeypatch.undo()
        s.flush()
        stats = s.stats()
        assert stats["corrupt"] == 0 and stats["errors"] == 1
        # nothing deleted or skipped
        assert stats["nodes"] == nodes and not s.parts.broken
        cache, n = s.fetch(tokens)  # the next fetch restores it all
        assert n == len(tokens) - 1
        same_kv(cache, compute_cache(model, tokens[:n]), n)
    assert quarantined(path) == []


@pytest.mark.slow
def test_out_of_descriptors_for_real_is_a_miss(saved, tmp_path):
    """A fetch in a process a few descriptors short of ``ulimit -n`` (EMFILE from the
    kernel, no mock): it deleted 95 of 100 nodes from the index."""
    path, tokens = saved
    script = textwrap.dedent(f"""
        import os, resource, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from conftest import tiny_llama
        from kvstore import KVStore
        tokens = {tokens!r}
        s = KVStore({path!r}, tiny_llama(0), chunk_tokens={C}, ram_bytes=0)
        nodes = s.stats()["nodes"]
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/dev/fd")) + 4, hard))
        _, n = s.fetch(tokens)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        s.flush()
        st = s.stats()
        _, again = s.fetch(tokens)
        s.close()
        print(n, again, nodes, st["nodes"], st["corrupt"], st["errors"])
        """)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    n, again, nodes, after, corrupt, errors = map(int, proc.stdout.split())
    assert "Too many open files" in proc.stderr  # the case happened
    assert n < len(tokens) - 1 and again == len(tokens) - 1
    assert after == nodes and corrupt == 0 and errors >= 1
    assert quarantined(path) == []


# -- a node another process evicts while this one reads it is a plain miss --------------


def test_node_evicted_by_another_process_mid_fetch_is_a_plain_miss(
    saved, model, monkeypatch
):
    from kvstore import maintenance

    path, tokens = saved
    with KVStore(path, model, chunk_tokens=C, ram_bytes=0) as s:
        real, evicted = s.blobs.open_file, []

        def open_file(*args, **kwargs):
            if not evicted:  # between the index walk and the first open()
                evicted.append(maintenance.gc(path, max_bytes=20_000)["evicted_nodes"])
            return real(*args, **kwargs)

        monkeypatch.setattr(s.blobs, "open_file", open_file)
        cache, n = s.fetch(tokens)
        monkeypatch.undo()
        s.flush()
        assert evicted[0] > 0 and n < len(tokens) - 1
        stats = s.stats()
        assert stats["corrupt"] == 0 and stats["quarantined"] == []
        assert not s.parts.broken
        # Saved again (by this or another process): reused at once, not skipped for
        # the process's lifetime.
        s.save(tokens, compute_cache(model, tokens))
        s.flush()
        cache, n = s.fetch(tokens)
        assert n == len(tokens) - 1
        same_kv(cache, compute_cache(model, tokens[:n]), n)
    assert quarantined(path) == []


def test_quarantine_spares_a_node_saved_again_meanwhile(saved, model):
    """A node found broken, then evicted and saved again by another process before the
    quarantine runs: the new record and its subtree stay."""
    import threading

    from kvstore import maintenance

    path, tokens = saved
    with KVStore(path, model, chunk_tokens=C, ram_bytes=0) as s:
        victim = s.index.read(
            lambda txn: s.parts.reads.trie.walk(txn, np.array(tokens), limit=800)
        )[50]
        with open(s.blobs.path(s.namespace, victim.h), "r+b") as f:
            f.seek(-5, os.SEEK_END)
            f.write(b"XXXXX")  # a flipped tail: checksum mismatch
        hold = threading.Event()
        s.writer.submit(hold.wait)  # the quarantine waits behind this
        _, n = s.fetch(tokens)
        assert n == 50 * C and s.stats()["corrupt"] == 1
        # Another process: evicts everything, then saves the prompt again.
        maintenance.gc(path, max_bytes=1)
        with KVStore(path, model, chunk_tokens=C) as other:
            other.save(tokens, compute_cache(model, tokens))
        hold.set()
        s.flush()
        assert s.stats()["quarantined"] == [] and s.stats()["nodes"] == 100
        cache, n = s.fetch(tokens)
        assert n == len(tokens) - 1
        same_kv(cache, compute_cache(model, tokens[:n]), n)


def test_verify_fix_and_gc_never_remove_a_file_they_cannot_open_now(
    saved, monkeypatch, capsys
):
    import errno

    from kvstore import maintenance
    from kvstore.disk.blobs import Blobs

    path, _ = saved
    real = Blobs.open_file

    def open_file(self, ns, h, part="", **kwargs):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(Blobs, "open_file", open_file)
    report = maintenance.verify(path, fix=True)
    assert not report["clean"]
    assert {p["kind"] for p in report["problems"]} == {"unreadable"}
    assert report["fixed"]["nodes_removed"] == 0
    gc = maintenance.gc(path)
    assert gc["broken_nodes"] == 0 and gc["quarantined"] == []
    monkeypatch.setattr(Blobs, "open_file", real)
    assert maintenance.verify(path)["clean"] and quarantined(path) == []
    assert maintenance.verify(path)["nodes"] == 100


# -- the LMDB map grows under concurrent threads and processes, invisibly ---------------


def spawn(script: str, **fields) -> subprocess.Popen:
    """A Python child running ``script`` formatted with ``fields``, the tests'
    directory (``tests``) and the chunk size (``C``); text pipes."""
    code = script.format(tests=os.path.dirname(__file__), C=C, **fields)
    return subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


GROW_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from conftest import compute_cache, random_tokens, tiny_llama
from kvstore import KVStore
model = tiny_llama(0)
with KVStore({path!r}, model, chunk_tokens={C}) as s:
    for seed in range({first}, {first} + {count}):
        tokens = random_tokens(160, seed)
        s.save(tokens, compute_cache(model, tokens))
        s.flush()
        print(s.index.env.info()["map_size"], flush=True)
    st = s.stats()
    assert st["writes_failed"] == 0 and st["errors"] == 0, st
"""


@pytest.mark.slow
def test_map_growth_is_invisible_to_threads_and_processes(tmp_path, model, monkeypatch):
    """From a 64 KiB map: threads of this process run stats(), lookup() and fetch()
    while this process and another one save, both growing the map many times."""
    import threading

    monkeypatch.setenv("KVSTORE_INITIAL_MAP_BYTES", str(64 << 10))
    path = str(tmp_path / "store")
    base = random_tokens(160, 0)
    mine, theirs = range(1, 25), range(100, 124)
    errors, done = [], threading.Event()
    with KVStore(path, model, chunk_tokens=C) as s:
        s.save(base, compute_cache(model, base))
        s.flush()
        start = s.index.env.info()["map_size"]
        other = spawn(GROW_SCRIPT, path=path, first=theirs[0], count=len(theirs))

        def reader(what):
            rounds = 0
            while not done.is_set() or rounds == 0:
                try:
                    if what == "stats":
                        s.stats()
                    elif what == "lookup":
                        assert s.lookup(base) == len(base) - 1
                    else:
                        assert s.fetch(base)[1] == len(base) - 1
                except Exception as e:  # every error fails the test
                    errors.append(f"{what}: {type(e).__name__}: {e}")
                    return
                rounds += 1

        threads = [
            threading.Thread(target=reader, args=(w,))
            for w in ("stats", "lookup", "fetch", "fetch")
        ]
        for t in threads:
            t.start()
        try:
            for seed in mine:
                tokens = random_tokens(160, seed)
                s.save(tokens, compute_cache(model, tokens))
                s.flush()
        finally:
            out, err = other.communicate(timeout=600)
            done.set()
            for t in threads:
                t.join()
        assert other.returncode == 0, err[-3000:]
        grown = s.index.env.info()["map_size"]
        stats = s.stats()
        assert errors == []
        assert stats["writes_failed"] == 0 and stats["errors"] == 0, stats
        assert stats["corrupt"] == 0
        # The map grew from 64 KiB past 1 MiB (four doublings at least), in both
        # processes (each grows it, or adopts the other's growth).
        assert start < 1 << 20 <= grown, (start, grown)
        assert int(out.split()[-1]) >= 1 << 20, out
        for seed in [0, *mine, *theirs]:
            tokens = random_tokens(160, seed)
            assert s.lookup(tokens) == len(tokens) - 1, seed


GROW_INDEX = """
import lmdb
# Plain LMDB: kvstore's own opening would wait for the opener under test.
env = lmdb.open({path!r}, max_dbs=16, map_size=64 << 10)
meta = env.open_db(b"meta")
for i in range(256):  # 4 MiB: the map doubles six times
    while True:
        try:
            with env.begin(write=True) as txn:
                txn.put(b"%d" % i, bytes(16 << 10), db=meta)
            break
        except lmdb.MapFullError:
            env.set_mapsize(2 * env.info()["map_size"])
env.close()
"""


def test_opening_adopts_a_map_another_process_grew_meanwhile(tmp_path, monkeypatch):
    """Another process grows the map between this one's LMDB open and its first
    transaction: the open adopts the new size (it was an lmdb.MapResizedError, or
    "not a kvstore store" when it came in open_db)."""
    from kvstore.disk import storecheck
    from kvstore.disk.index import Index

    path = str(tmp_path / "index")
    Index(path, map_size=64 << 10).close()
    real, grown = storecheck._open_dbs, []

    def open_dbs(env, *args, **kwargs):
        if not grown:
            child = spawn(GROW_INDEX, path=path)
            grown.append(child.communicate(timeout=300))
            assert child.returncode == 0, grown[0][1][-3000:]
        return real(env, *args, **kwargs)

    monkeypatch.setattr(storecheck, "_open_dbs", open_dbs)
    idx = Index(path, map_size=64 << 10)
    try:
        assert idx.env.info()["map_size"] >= 4 << 20
        assert (
            len(idx.read(lambda txn: bytes(txn.get(b"255", db=idx.db["meta"]))))
            == 16 << 10
        )
    finally:
        idx.close()


def test_gate_alone_waits_for_users_and_holds_new_ones_back():
    import threading
    import time

    from kvstore.platform.gate import Gate, NestedAlone

    gate, events = Gate(), []
    inside, leave = threading.Event(), threading.Event()

    def reader():
        with gate.shared():
            with gate.shared():  # nested: passes at once
                inside.set()
                leave.wait()
                events.append("reader done")

    def late_reader():
        with gate.shared():
            events.append("late reader")

    r = threading.Thread(target=reader)
    r.start()
    inside.wait()
    resize = threading.Thread(
        target=lambda: gate.alone(lambda: events.append("resize"))
    )
    resize.start()
    time.sleep(0.1)
    late = threading.Thread(target=late_reader)
    late.start()
    time.sleep(0.1)
    assert events == []  # the resize waits for the reader, the late reader for it
    leave.set()
    for t in (r, resize, late):
        t.join()
    assert events == ["reader done", "resize", "late reader"]
    with gate.shared():
        with pytest.raises(NestedAlone):
            gate.alone(lambda: None)


# -- gc frees space on a 100% full file system -------------------------------------------


@pytest.fixture
def small_fs(tmp_path):
    """A fresh 8 MiB tmpfs (needs root with CAP_SYS_ADMIN; skipped otherwise)."""
    where = tmp_path / "fs"
    where.mkdir()
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs Linux and root")
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def fill(fs) -> None:
    """Fill the file system to the last byte."""
    fd = os.open(fs / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        for size in (1 << 16, 1 << 10, 1):
            try:
                while True:
                    os.write(fd, bytes(size))
            except OSError as e:
                assert e.errno == 28
    finally:
        os.close(fd)
    assert os.statvfs(fs).f_bavail == 0


@pytest.mark.parametrize("spare", [True, False])
def test_gc_frees_space_on_a_full_disk(small_fs, model, capsys, spare):
    path = str(small_fs / "store")
    prompts = [random_tokens(800, seed) for seed in (1, 2, 3)]
    with KVStore(path, model, chunk_tokens=C) as s:
        for tokens in prompts:
            s.save(tokens, compute_cache(model, tokens))
    if not spare:  # a store whose spare room is gone (made by an older kvstore, say)
        os.unlink(os.path.join(path, "index", "spare"))
    fill(small_fs)
    status, out, err = run_cli(capsys, "gc", "--store", path, "--max-bytes", "60K")
    if spare:  # was: lmdb.DiskError traceback, exit 1, nothing freed
        assert status == 0, err
        assert os.statvfs(small_fs).f_bavail > 0
        assert os.path.getsize(os.path.join(path, "index", "spare")) == 1 << 20
    else:  # one line saying what to do, nothing changed
        assert status == 2 and len(err.strip().splitlines()) == 1, err
        assert "file system is full" in err and "free a few MiB" in err
        os.unlink(small_fs / "filler")
    status, out, err = run_cli(capsys, "verify", "--store", path)
    assert status == 0 and "clean" in out, out + err
    with KVStore(path, model, chunk_tokens=C) as s:
        assert s.stats()["corrupt"] == 0
        restored = 0
        for tokens in prompts:
            cache, n = s.fetch(tokens)
            same_kv(cache, compute_cache(model, tokens[:n]), n)
            restored += n
        assert restored > 0


# -- files kvstore cannot remove are skipped and reported, one by one -----------------


@pytest.fixture
def immutable(tmp_path):
    """``make(path)``: make a file unremovable, even by root (``chattr +i``); undone
    at teardown. Skipped where chattr is missing or the file system refuses it."""
    made = []

    def make(path):
        proc = subprocess.run(["chattr", "+i", str(path)], capture_output=True)
        if proc.returncode != 0:
            pytest.skip(f"chattr +i does not work here: {proc.stderr!r}")
        made.append(path)

    if shutil.which("chattr") is None:
        pytest.skip("chattr is missing: cannot make a file unremovable for root")
    yield make
    for path in made:
        subprocess.run(["chattr", "-i", str(path)], check=False)


def test_gc_goes_on_past_files_it_cannot_remove(gc_store_files, immutable, capsys):
    path, blobs, files = gc_store_files
    stuck = files[:3]  # least recently used: the first victims
    orphan = os.path.join(os.path.dirname(files[-1]), "0" * 32 + ".safetensors")
    temp = os.path.join(os.path.dirname(files[-1]), ".dead.1.abcd.tmp")
    for p in (orphan, temp):
        with open(p, "wb") as f:
            f.write(b"x" * 100)
        os.utime(p, (1, 1))  # old
    for p in stuck + [orphan, temp]:
        immutable(p)
    status, out, err = run_cli(
        capsys, "gc", "--store", path, "--max-bytes", "60K", "--json"
    )
    assert status == 0, err
    import json

    report = json.loads(out)
    # Each one reported, and gc went on: every other victim's file is gone.
    failed = sorted(line.split(": ")[0] for line in report["unremovable"])
    assert failed == sorted(stuck + [orphan, temp])
    assert report["evicted_nodes"] > 150 and report["over_budget"] == 0
    left = [p for p in all_files(blobs) if p not in stuck + [orphan, temp]]
    assert len(left) == len(files) - report["evicted_nodes"]


@pytest.fixture
def gc_store_files(tmp_path, model):
    """A store of two 800-token prompts, the second used last: ``(path, blobs dir,
    node files oldest first)``."""
    import time

    path = str(tmp_path / "store")
    with KVStore(path, model, chunk_tokens=C) as s:
        for seed in (1, 2):
            tokens = random_tokens(800, seed)
            s.save(tokens, compute_cache(model, tokens))
            s.flush()
            time.sleep(0.05)
        walk = s.index.read(
            lambda txn: s.parts.reads.trie.walk(
                txn, np.array(random_tokens(800, 1)), limit=800
            )
        )
        files = [s.blobs.path(s.namespace, step.h) for step in reversed(walk)]
    blobs = os.path.join(path, "blobs")
    return path, blobs, files + [p for p in all_files(blobs) if p not in files]


def all_files(root) -> list:
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]


def test_eviction_goes_on_past_files_it_cannot_remove(tmp_path, model, monkeypatch):
    """A budgeted save's eviction, with unlink refused for some victims (a stand-in
    for another user's files: root ignores permissions, so os.unlink is mocked)."""
    from kvstore.platform import fsutil

    path = str(tmp_path / "store")
    refused = []
    real = os.unlink

    def unlink(p, *args, **kwargs):
        if str(p).endswith(".safetensors") and os.path.exists(p) and len(refused) < 3:
            refused.append(str(p))
            raise PermissionError(1, "Operation not permitted", str(p))
        return real(p, *args, **kwargs)

    with KVStore(path, model, chunk_tokens=C, disk_bytes=100_000) as s:
        first = random_tokens(800, 1)
        s.save(first, compute_cache(model, first))
        s.flush()
        monkeypatch.setattr(fsutil.os, "unlink", unlink)
        for seed in (2, 3):
            tokens = random_tokens(800, seed)
            s.save(tokens, compute_cache(model, tokens))
            s.flush()
        monkeypatch.undo()
        stats = s.stats()
        assert len(refused) == 3 and stats["writes_failed"] == 0
        assert stats["nodes_evicted"] > 100  # went on past the three
        assert all(os.path.exists(p) for p in refused)
        on_disk = sum(
            os.path.getsize(p) for p in all_files(os.path.join(path, "blobs"))
        )
        assert on_disk <= 100_000 + sum(os.path.getsize(p) for p in refused) + 20_000


# -- temp files of dead writers go at once ----------------------------------------------


def test_gc_removes_temp_files_of_dead_writers_at_once(saved, capsys):
    """A writer SIGKILLed mid-write leaves its temp file; gc kept it for an hour and
    verify said "clean"."""
    import signal

    from kvstore import maintenance
    from kvstore.disk.publish import temp_name, temp_writer

    path, _ = saved
    directory = os.path.dirname(next(p for p in all_files(os.path.join(path, "blobs"))))
    script = textwrap.dedent(f"""
        import os, sys, time
        from kvstore.disk.publish import temp_name
        p = os.path.join({directory!r}, temp_name(b"\\x01" * 16))
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, b"half a node")
        print(p, flush=True)
        time.sleep(600)
        """)
    writer = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True
    )
    dead = writer.stdout.readline().strip()
    assert temp_writer(os.path.basename(dead))[0] == writer.pid
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    live = os.path.join(directory, temp_name(b"\x02" * 16))  # this process: alive
    with open(live, "wb") as f:
        f.write(b"being written")
    status, out, err = run_cli(capsys, "verify", "--store", path)
    assert status == 0 and "1 temp files of writer processes that are gone" in out
    report = maintenance.gc(path)
    assert (report["temp_removed"], report["temp_kept"]) == (1, 1)
    assert not os.path.exists(dead) and os.path.exists(live)
    # An old-style name (no start time) of a dead pid goes too; one of a live pid stays.
    old_dead = os.path.join(directory, f".{'03' * 16}.{writer.pid}.aa.tmp")
    old_live = os.path.join(directory, f".{'04' * 16}.{os.getpid()}.bb.tmp")
    for p in (old_dead, old_live):
        open(p, "wb").close()
    report = maintenance.gc(path)
    assert not os.path.exists(old_dead) and os.path.exists(old_live)


def test_temp_names_are_unique_and_say_who_writes():
    from kvstore.disk import reservations
    from kvstore.disk.publish import temp_name, temp_writer

    names = {temp_name(b"\x05" * 16) for _ in range(1000)}
    assert len(names) == 1000
    assert {temp_writer(n) for n in names} == {reservations.own_identity()}
    for name in ("x.tmp", ".a.b.tmp", ".h.-1.r.tmp", ".h.1.2.3.4.tmp", ".h.0.r.tmp"):
        assert temp_writer(name) is None, name


def test_spare_room_is_kept_whole_and_leftovers_go(tmp_path):
    from kvstore.disk import spare

    index = str(tmp_path)
    leftover = tmp_path / ".spare.1.abcd"
    leftover.write_bytes(b"x" * 10)
    os.utime(leftover, (1, 1))
    young = tmp_path / ".spare.2.ef01"
    young.write_bytes(b"x")  # maybe being written now
    assert spare.ensure(index)
    st = os.stat(tmp_path / "spare")
    assert st.st_size == spare.SPARE_BYTES and st.st_blocks * 512 >= spare.SPARE_BYTES
    assert not leftover.exists() and young.exists()
    os.truncate(tmp_path / "spare", 100)  # short: made again
    assert spare.ensure(index) and os.path.getsize(tmp_path / "spare") == 1 << 20
    assert spare.release(index) == 1 << 20 and spare.release(index) == 0


EVICTING_WRITER = """
import sys
sys.path.insert(0, {tests!r})
from conftest import compute_cache, random_tokens, tiny_llama
from kvstore import KVStore
model = tiny_llama(0)
with KVStore({path!r}, model, chunk_tokens={C}, disk_bytes={budget}) as s:
    for seed in range(1000, 1000 + {count}):
        tokens = random_tokens(400, seed)
        s.save(tokens, compute_cache(model, tokens))
        s.flush()
    print(s.stats()["nodes_evicted"])
"""


@pytest.mark.slow
def test_reader_beside_an_evicting_writer_process_reports_no_corruption(
    tmp_path, model
):
    """A reader process fetching while a budgeted writer process evicts what it reads:
    every node unlinked under it is a plain miss (it counted them as corrupt and
    skipped them for its lifetime)."""
    path = str(tmp_path / "store")
    prompts = [random_tokens(400, seed) for seed in range(6)]
    with KVStore(path, model, chunk_tokens=C, ram_bytes=0) as s:
        for tokens in prompts:
            s.save(tokens, compute_cache(model, tokens))
        s.flush()
        budget = s.stats()["bytes_on_disk"]
        writer = spawn(EVICTING_WRITER, path=path, budget=budget, count=12)
        fetches = 0
        while writer.poll() is None:
            for tokens in prompts:
                cache, n = s.fetch(tokens)
                same_kv(cache, compute_cache(model, tokens[:n]), n)
                fetches += 1
        out, err = writer.communicate()
        assert writer.returncode == 0, err[-3000:]
        stats = s.stats()
        assert int(out) > 0 and fetches > 20  # it evicted while this one read
        assert stats["corrupt"] == 0 and stats["quarantined"] == [], stats
        assert not s.parts.broken
    assert quarantined(path) == []


def test_open_adopts_a_map_grown_while_lmdb_opened_it(tmp_path, model, monkeypatch):
    """py-lmdb's own open can meet MDB_MAP_RESIZED when another process grows the
    map at that moment (1 open in ~38,000 under the soak): the open is tried again."""
    import lmdb

    from kvstore.disk import storecheck

    with KVStore(tmp_path, model, chunk_tokens=C) as s:
        s.save(random_tokens(3 * C, 1), compute_cache(model, random_tokens(3 * C, 1)))
    real, calls = lmdb.open, []

    def grown_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise lmdb.MapResizedError("mdb_txn_begin: MDB_MAP_RESIZED")
        return real(*args, **kwargs)

    monkeypatch.setattr(storecheck.lmdb, "open", grown_once)
    with KVStore(tmp_path, model, chunk_tokens=C) as s:
        assert s.stats()["nodes"] == 3
    assert len(calls) == 2
