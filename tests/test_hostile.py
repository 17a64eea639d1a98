"""Hostile stores and prompts files, as a careless or hostile user makes them: never a
hang, a raw traceback, a silent loss, or a write into what is not a kvstore.

Each case answers with a miss or one line naming the store and status 2. Commands run
in-process through ``cli.main`` where nothing can hang or kill the process, and as
subprocesses (with a timeout) where something could: a FIFO, a truncated ``data.mdb``
(SIGBUS), a broken pipe, another process holding the store, dropped privileges.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import lmdb
import pytest
from conftest import compute_cache, random_tokens, run_cli

from kvstore import KVStore, maintenance, server
from kvstore.disk.index import READ_FORMATS, Index, StoreError

C = 8  # tokens per chunk
PROMPTS = [random_tokens(40, seed) for seed in range(3)]


def run_kvstore(*argv, timeout=120, input=None, pre=()):
    """``python -m kvstore ARGV`` as a subprocess (``pre``: a command prefix)."""
    return subprocess.run(
        [*pre, sys.executable, "-m", "kvstore", *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=timeout,
        input=input,
    )


def one_line(err: str, *needles: str) -> None:
    """``err`` is one line (plus nothing) holding every needle, and no traceback."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], err


def tree_digest(path) -> str:
    """Names, sizes and contents of everything under ``path``, for "nothing written"."""
    h = hashlib.sha256()
    for dirpath, dirs, files in sorted(os.walk(path)):
        for name in sorted(dirs + files):
            p = os.path.join(dirpath, name)
            h.update(p.encode())
            if os.path.isfile(p) and not p.endswith("lock.mdb"):
                h.update(open(p, "rb").read())  # lock.mdb: LMDB's reader table
    return h.hexdigest()


@pytest.fixture
def stored(tmp_path, model):
    """A small store of PROMPTS (chunk 8); returns its directory."""
    path = str(tmp_path / "store")
    with KVStore(path, model, chunk_tokens=C) as s:
        for tokens in PROMPTS:
            s.save(tokens, compute_cache(model, tokens))
    return path


def foreign_lmdb(path, *, named=False):
    """Another program's LMDB environment at ``path``: plain keys, or a named DB."""
    os.makedirs(path)
    env = lmdb.open(str(path), max_dbs=2)
    with env.begin(write=True) as txn:
        txn.put(b"abc", b"not yours")
        if named:
            txn.put(b"k", b"v", db=env.open_db(b"photos", txn=txn))
    env.close()


def set_format_version(store, version: bytes):
    env = lmdb.open(os.path.join(store, "index"), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.put(b"format_version", version, db=env.open_db(b"meta", txn=txn))
    env.close()


# -- bug 3: another program's LMDB -------------------------------------------------------


@pytest.mark.parametrize("named", [False, True])
def test_foreign_lmdb_is_refused_and_left_unwritten(
    tmp_path, capsys, tiny_model_dir, named
):
    store = tmp_path / "theirs"
    foreign_lmdb(store / "index", named=named)
    (tmp_path / "p.jsonl").write_text(json.dumps({"tokens": PROMPTS[0]}) + "\n")
    before = tree_digest(store)
    commands = [
        ["stats"],
        ["ls", "--no-decode"],
        ["verify"],
        ["verify", "--fix"],
        ["gc"],
        ["pin", "--namespace", "0" * 8, "--node", "0" * 8],
        ["push", "--remote", "s3://bucket/x"],
        ["prefill", tmp_path / "p.jsonl", "--model", tiny_model_dir, "--quiet"],
    ]
    for argv in commands:
        status, _, err = run_cli(capsys, *argv, "--store", store)
        assert status == 2, (argv, err)
        one_line(err, str(store), "not a kvstore store")
        assert "--drop-model" not in err and "--namespace" not in err
    assert tree_digest(store) == before  # no database, no format version, no file
    assert sorted(os.listdir(store / "index")) == ["data.mdb", "lock.mdb"]
    for fn in (maintenance.store_stats, maintenance.verify, maintenance.gc):
        with pytest.raises(StoreError, match="not a kvstore store"):
            fn(str(store))


def test_empty_index_directory_is_initialized_in_one_commit(tmp_path):
    """An index kvstore made, or an empty one, is written to; a half-made one (all
    databases empty, no version: a crash of an older kvstore) is finished."""
    path = str(tmp_path / "index")
    env = lmdb.open(path, max_dbs=8)
    env.open_db(b"meta")
    env.open_db(b"nodes")
    env.close()
    idx = Index(path)
    assert idx.read(lambda t: bytes(t.get(b"format_version", db=idx.db["meta"])))
    idx.close()


# -- bug 4: other format versions ---------------------------------------------------------


@pytest.mark.parametrize("version", [b"999", b"1.5", b"\xff\x00"])
def test_other_format_version_is_one_line_for_every_command(
    stored, capsys, tiny_model_dir, tmp_path, version
):
    set_format_version(stored, version)
    (tmp_path / "p.jsonl").write_text(json.dumps({"tokens": PROMPTS[0]}) + "\n")
    shown = version.decode() if version.isascii() and version.isalnum() else ""
    for argv in (
        ["stats"],
        ["ls", "--no-decode"],
        ["verify"],
        ["gc"],
        ["gc", "--drop-model", "0" * 8],
        ["pin", "--namespace", "0" * 8, "--node", "0" * 8],
        ["prefill", tmp_path / "p.jsonl", "--model", tiny_model_dir, "--quiet"],
    ):
        status, _, err = run_cli(capsys, *argv, "--store", stored)
        assert status == 2, (argv, err)
        readable = " and ".join(map(str, READ_FORMATS))
        one_line(err, stored, f"format version {shown}", f"reads version {readable}")
        assert "--drop-model:" not in err and "--namespace/--node" not in err


# -- bug 7: index files that LMDB would choke on -------------------------------------------


@pytest.mark.slow
def test_truncated_data_mdb_is_refused_not_sigbus(stored):
    data = os.path.join(stored, "index", "data.mdb")
    assert os.path.getsize(data) > 16384
    os.truncate(data, 16384)
    proc = run_kvstore("stats", "--store", stored)  # was exit 135, "Bus error"
    assert proc.returncode == 2, proc.stderr
    one_line(proc.stderr, stored, "data.mdb is truncated")


@pytest.mark.slow
def test_fifo_data_mdb_is_refused_at_once(stored):
    data = os.path.join(stored, "index", "data.mdb")
    os.unlink(data)
    os.mkfifo(data)
    tic = time.monotonic()
    proc = run_kvstore("stats", "--store", stored, timeout=60)  # hung for ever
    assert proc.returncode == 2 and time.monotonic() - tic < 30, proc.stderr
    one_line(proc.stderr, stored, "data.mdb is a FIFO")


@pytest.mark.parametrize(
    "damage, message",
    [
        ("random", "not an LMDB file"),
        ("tiny", "not an LMDB file"),
        ("lock-fifo", "lock.mdb is a FIFO"),
        ("lock-dir", "lock.mdb is a directory"),
        ("data-symlink", "data.mdb is a symbolic link"),
        ("index-symlink", "index is a symbolic link"),
    ],
)
def test_broken_index_files_are_one_line(stored, tmp_path, capsys, damage, message):
    index = os.path.join(stored, "index")
    data, lock = os.path.join(index, "data.mdb"), os.path.join(index, "lock.mdb")
    if damage in ("random", "tiny"):
        with open(data, "wb") as f:
            f.write(os.urandom(100_000 if damage == "random" else 100))
    elif damage.startswith("lock"):
        os.unlink(lock)
        os.mkfifo(lock) if damage == "lock-fifo" else os.mkdir(lock)
    elif damage == "data-symlink":
        shutil.move(data, tmp_path / "elsewhere.mdb")
        os.symlink(tmp_path / "elsewhere.mdb", data)
    else:
        shutil.move(index, tmp_path / "index-elsewhere")
        os.symlink(tmp_path / "index-elsewhere", index)
    for argv in (["stats"], ["verify"], ["gc"]):
        status, _, err = run_cli(capsys, *argv, "--store", stored)
        assert status == 2, (argv, err)
        one_line(err, stored, message)


# -- bug 5: a read-only store ----------------------------------------------------------------


def unprivileged() -> list:
    """A command prefix that runs without write permission on root's files: as
    nobody with no capabilities (the suite runs as root, which ignores permissions)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root and setpriv is missing: cannot drop privileges")
    return [setpriv, "--reuid=nobody", "--regid=nogroup", "--clear-groups"]


@pytest.fixture
def world_readable_dir():
    """A directory that an unprivileged user can read (pytest's are 0700)."""
    path = tempfile.mkdtemp(prefix="kvstore-ro-")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.stress
def test_read_only_store(world_readable_dir, model, tiny_model_dir):
    pre = unprivileged()
    store = os.path.join(world_readable_dir, "store")
    with KVStore(store, model, chunk_tokens=C) as s:
        for tokens in PROMPTS:
            s.save(tokens, compute_cache(model, tokens))
    model_dir = shutil.copytree(tiny_model_dir, os.path.join(world_readable_dir, "m"))
    for name in os.listdir(model_dir):
        os.chmod(os.path.join(model_dir, name), 0o644)
    prompts = os.path.join(world_readable_dir, "p.jsonl")
    with open(prompts, "w") as f:
        f.write(json.dumps({"tokens": PROMPTS[0]}) + "\n")
    for dirpath, dirs, files in os.walk(store):
        for name in dirs + files:
            os.chmod(os.path.join(dirpath, name), 0o555 if name in dirs else 0o444)
    os.chmod(store, 0o555)
    before = tree_digest(store)
    # The read-only commands work; they were a raw lmdb.ReadonlyError, status 1.
    for argv in (["stats", "--json"], ["ls", "--no-decode"], ["verify"]):
        proc = run_kvstore(*argv, "--store", store, pre=pre)
        assert proc.returncode == 0, (argv, proc.stderr)
        assert "Traceback" not in proc.stderr
    assert json.loads(run_kvstore("stats", "--json", "--store", store, pre=pre).stdout)[
        "totals"
    ]["nodes"] == sum(len(t) // C for t in PROMPTS)
    # The others say the store is read-only.
    for argv in (
        ["verify", "--fix"],
        ["gc"],
        ["pin", "--namespace", "0" * 8, "--node", "0" * 8],
        ["prefill", prompts, "--model", model_dir, "--chunk-tokens", C, "--quiet"],
        ["serve", "--model", model_dir],
    ):
        proc = run_kvstore(*argv, "--store", store, pre=pre)
        assert proc.returncode == 2, (argv, proc.stderr)
        one_line(proc.stderr, store, "read-only")
    assert tree_digest(store) == before


# -- bug 2: lock.mdb deleted while the store is open ----------------------------------------

_HOLDER = textwrap.dedent("""
    import sys
    import numpy as np
    from kvstore.disk.index import Index, NodeRecord, StoreError
    idx = Index(sys.argv[1])
    ns, root = bytes(range(16)), bytes(16)

    def put(i):
        rec = NodeRecord(root, 0, np.array([i], dtype=np.int32), 1, 0)
        idx.write(lambda txn: idx.put_node(txn, ns, i.to_bytes(16, "big"), rec))

    put(1)
    print("ready", flush=True)
    sys.stdin.readline()
    try:
        put(2)
        print("wrote", flush=True)
    except StoreError as e:
        print("refused:", e, flush=True)
    """)


@pytest.mark.slow
def test_deleted_lock_file_stops_writers_loudly(tmp_path):
    path = str(tmp_path / "store" / "index")
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, path],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "ready", holder.stderr.read()
        os.unlink(os.path.join(path, "lock.mdb"))
        # Another process may not open it now: its writes and the holder's could
        # overwrite each other (10 of 40 flushed prompts were lost that way).
        with pytest.raises(StoreError, match="lock.mdb is missing while another"):
            Index(path, create=False)
        holder.stdin.write("go\n")
        holder.stdin.flush()
        said = holder.stdout.readline()
        assert said.startswith("refused:") and "lock.mdb was deleted" in said, said
        assert holder.wait(60) == 0
    finally:
        holder.kill()
    # Once nobody holds the store, it opens again, with every acknowledged write.
    idx = Index(path, create=False)
    try:
        assert idx.counters(bytes(range(16)))[0] == 1
    finally:
        idx.close()


def test_deleted_lock_file_is_reported_by_the_store(stored, model):
    with KVStore(stored, model, chunk_tokens=C) as s:
        assert s.stats()["store_problem"] is None
        os.unlink(os.path.join(stored, "index", "lock.mdb"))
        new = random_tokens(24, 99)
        s.save(new, compute_cache(model, new))
        s.flush()
        stats = s.stats()
        assert stats["writes_failed"] == 1
        assert "lock.mdb was deleted" in stats["store_problem"]
        assert s.fetch(PROMPTS[0] + [1])[1] == 40  # reads go on


def test_vanished_store_is_loud_and_not_recreated(stored, model, caplog):
    """A store directory deleted under a running server: later writes fail, logged
    and in ``stats()`` (hence ``GET /kvstore/stats``), and nothing is recreated."""
    with KVStore(stored, model, chunk_tokens=C) as s:
        shutil.rmtree(stored)
        new = random_tokens(24, 98)
        s.save(new, compute_cache(model, new))
        s.flush()
        stats = s.stats()
        assert stats["writes_failed"] == 1
        assert "index directory is gone" in stats["store_problem"]
    assert not os.path.exists(stored)
    assert any("lock.mdb was deleted" in r.getMessage() for r in caplog.records)


def test_verify_says_what_orphans_mean(stored, model, capsys):
    """Orphans after the index lost commits (an older copy of index/ put back)."""
    shutil.copytree(os.path.join(stored, "index"), os.path.join(stored, "old-index"))
    with KVStore(stored, model, chunk_tokens=C) as s:
        new = random_tokens(24, 97)
        s.save(new, compute_cache(model, new))
    shutil.rmtree(os.path.join(stored, "index"))
    os.rename(os.path.join(stored, "old-index"), os.path.join(stored, "index"))
    status, out, _ = run_cli(capsys, "verify", "--store", stored)
    last = out.splitlines()[-1]  # was "clean"
    assert status == 0 and last.startswith("index clean, but 3 orphan chunk files")
    assert "commits the index lost" in last


# -- bug 1: links below the store ------------------------------------------------------------


def test_linked_directories_below_blobs_are_never_followed(stored, model, tmp_path):
    with KVStore(stored, model, chunk_tokens=C, ram_bytes=0) as s:
        ns = s.namespace.hex()
    blobs = os.path.join(stored, "blobs")
    outside = tmp_path / "outside"
    shutil.move(os.path.join(blobs, ns), outside)  # byte-identical files, elsewhere
    os.symlink(outside, os.path.join(blobs, ns))
    before = tree_digest(outside)
    with KVStore(stored, model, chunk_tokens=C, ram_bytes=0) as s:
        assert s.fetch(PROMPTS[0] + [1])[1] == 0  # a miss, not the files out there
        new = random_tokens(24, 96)
        s.save(new, compute_cache(model, new))  # is not written out there either
        s.flush()
        assert s.stats()["writes_failed"] == 1
    report = maintenance.verify(stored, fix=True)
    assert not report["clean"] and {p["kind"] for p in report["problems"]} >= {
        "missing"
    }
    maintenance.gc(stored)
    assert tree_digest(outside) == before  # nothing moved, unlinked or written


def test_linked_store_subdirectory_is_refused(stored, model, tmp_path):
    shutil.move(os.path.join(stored, "blobs"), tmp_path / "blobs")
    os.symlink(tmp_path / "blobs", os.path.join(stored, "blobs"))
    with pytest.raises(StoreError, match="blobs is a symbolic link"):
        KVStore(stored, model, chunk_tokens=C)
    with pytest.raises(StoreError, match="blobs is a symbolic link"):
        maintenance.store_stats(stored)


# -- bug 6 and the prompts file --------------------------------------------------------------


def test_prompts_lines_the_json_parser_rejects_fail_alone(
    tmp_path, capsys, tiny_model_dir
):
    good = random_tokens(40, 5)
    lines = [
        b'{"tokens": [' + b"1" * 5000 + b"]}",  # ValueError: int of 5000 digits
        b"[" * 100_000 + b"]" * 100_000,  # RecursionError
        b'{"prompt": "w5 w6 \xff w7"}',  # invalid UTF-8 in one line
        b'{"tokens": [true, 2]}',  # a boolean is not a token id
        json.dumps({"prompt": "w9 " * 3_000_000}).encode(),  # 9 MB of text
        json.dumps({"tokens": good}).encode(),
    ]
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b"\n".join(lines) + b"\n")
    store = tmp_path / "store"
    status, out, err = run_cli(
        capsys, "prefill", prompts, "--model", tiny_model_dir, "--store", store,
        "--chunk-tokens", C, "--quiet", "--json",
    )  # fmt: skip
    assert status == 1 and "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith(str(prompts))]
    assert [e.split(":")[1] for e in errors] == ["1", "2", "3", "4", "5"], err
    assert "invalid JSON: Exceeds the limit" in errors[0]
    assert "nested too deeply" in errors[1] and "invalid UTF-8 at byte 19" in errors[2]
    assert "tokens[0] is true, not a token id" in errors[3]
    assert "more than 4096 tokens (the limit) in its first" in errors[4]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["failed"] == 5 and summary["prefilled"] == 1
    assert maintenance.store_stats(str(store))["totals"]["tokens"] == len(good)


@pytest.mark.slow
def test_prefill_dash_reads_stdin(tmp_path, tiny_model_dir):
    rows = "".join(json.dumps({"tokens": t}) + "\n" for t in PROMPTS)
    proc = run_kvstore(
        "prefill", "-", "--model", tiny_model_dir, "--store", tmp_path / "s",
        "--chunk-tokens", C, "--quiet", "--json", input=rows,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])["prefilled"] == 3


def test_failed_writes_fail_the_prompt(tmp_path, capsys, tiny_model_dir, monkeypatch):
    """Nothing stored (here: every file write fails) is not "1 prompts: 1 prefilled"."""
    import errno

    from kvstore.disk.publish import WriteBatch

    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(WriteBatch, "add", no_space)  # every file a save writes
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"tokens": PROMPTS[0]}) + "\n")
    status, out, err = run_cli(
        capsys, "prefill", prompts, "--model", tiny_model_dir, "--store",
        tmp_path / "s", "--chunk-tokens", C, "--quiet", "--json",
    )  # fmt: skip
    assert status == 1, err
    assert f"{prompts}:1: not stored: writing to the store failed" in err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["failed"] == 1 and summary["prefilled"] == 0
    assert summary["writes_failed"] >= 1


def test_prefill_repairs_a_broken_node_it_is_asked_to_warm(stored, model):
    with KVStore(stored, model, chunk_tokens=C, ram_bytes=0) as s:
        path = s.blobs.path(s.namespace, s.index.children(s.namespace, s.root)[0])
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0xFF  # a flipped bit in the KV: only the checksum sees it
    open(path, "wb").write(bytes(data))
    assert not maintenance.verify(stored)["clean"]  # a prefill said "already stored"
    with KVStore(stored, model, chunk_tokens=C, ram_bytes=0) as s:
        done = [s.prefill(t) for t in PROMPTS]
        s.flush()
        assert sum(d["computed"] for d in done) > 0
        assert s.stats()["corrupt"] == 1
    assert maintenance.verify(stored)["clean"]
    with KVStore(stored, model, chunk_tokens=C, ram_bytes=0) as s:
        assert all(s.fetch(t + [1])[1] == len(t) for t in PROMPTS)


# -- smaller items ---------------------------------------------------------------------------


def test_directories_are_0755_whatever_the_umask(tmp_path, model):
    old = os.umask(0)
    try:
        path = tmp_path / "a" / "b" / "store"  # parents made here too
        with KVStore(str(path), model, chunk_tokens=C) as s:
            s.save(PROMPTS[0], compute_cache(model, PROMPTS[0]))
    finally:
        os.umask(old)
    for dirpath, dirs, files in os.walk(tmp_path / "a"):
        for name in dirs:
            mode = os.stat(os.path.join(dirpath, name)).st_mode & 0o777
            assert mode == 0o755, (dirpath, name, oct(mode))
        for name in files:
            mode = os.stat(os.path.join(dirpath, name)).st_mode & 0o777
            assert not mode & 0o022, (dirpath, name, oct(mode))


def _exits_quietly_into_a_closed_pipe(*args) -> None:
    """``kvstore ARGS | head`` where head has read enough before anything is written."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(60) == 141 and "Traceback" not in err, err


@pytest.mark.slow
def test_ls_into_a_closed_pipe_exits_quietly(stored):
    _exits_quietly_into_a_closed_pipe("ls", "--no-decode", "--store", stored)


def test_bench_replay_into_a_closed_pipe_exits_quietly():
    run = os.path.join(os.path.dirname(__file__), "..", "docs", "bench-restart.json")
    _exits_quietly_into_a_closed_pipe("bench", "--from-json", run, "--markdown")


def test_dangling_store_symlink_says_so(tmp_path, capsys, tiny_model_dir):
    link = tmp_path / "store"
    os.symlink(tmp_path / "gone", link)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"tokens": PROMPTS[0]}) + "\n")
    for argv in (["stats"], ["prefill", prompts, "--model", tiny_model_dir]):
        status, _, err = run_cli(capsys, *argv, "--store", link)
        assert status == 2
        one_line(err, "dangling symbolic link")


# -- bug 9: kvstore serve start-up -----------------------------------------------------------


def test_serve_refuses_bad_stores_before_the_model_loads(
    stored, tmp_path, capsys, monkeypatch
):
    foreign_lmdb(tmp_path / "theirs" / "index")
    other = tmp_path / "other"
    shutil.copytree(stored, other)
    set_format_version(str(other), b"1.5")
    truncated = tmp_path / "truncated"
    shutil.copytree(stored, truncated)
    os.truncate(truncated / "index" / "data.mdb", 16384)
    import mlx_lm.server

    def serve():  # where the model would load and the server run (for ever)
        raise AssertionError("kvstore serve got past its store checks")

    monkeypatch.setattr(mlx_lm.server, "main", serve)
    # The stub is no mlx-lm main: skip the start-up check of mlx-lm's internals.
    monkeypatch.setattr("kvstore.server.check_server", lambda **kw: True)
    for store, message in (
        (tmp_path / "theirs", "not a kvstore store"),
        (other, "format version 1.5"),
        (truncated, "data.mdb is truncated"),
    ):
        status = server.main(["--store", str(store)], hard_exit=False)
        err = capsys.readouterr().err
        assert status == 2, err
        one_line(err, str(store), message)


def test_a_disk_budget_of_0_is_refused(stored, model):
    """It made a store that keeps nothing, shown as "no disk budget"."""
    with pytest.raises(ValueError, match="nbytes must be >= 1"):
        maintenance.set_disk_budget(stored, 0)
    with pytest.raises(ValueError, match="disk_bytes must be >= 1"):
        KVStore(stored, model, chunk_tokens=C, disk_bytes=0)
    assert maintenance.disk_budget(stored) is None
