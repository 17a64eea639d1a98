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

from kvstore import KVStore, mdbfile
from kvstore.storecheck import StoreError, check_data_file

C = 8  # tokens per chunk


def same_kv(got, want, n):
    """``got`` (a restored cache) holds exactly the first ``n`` tokens of ``want``."""
    for g, w in zip(got, want):
        assert mx.array_equal(g.keys[:, :, :n], w.keys[:, :, :n]).item()
        assert mx.array_equal(g.values[:, :, :n], w.values[:, :, :n]).item()


# -- a big delete transaction leaves data.mdb shorter than its last page ---------------


@pytest.fixture
def gc_shrunk(tmp_path, model, capsys):
    """A store whose ``gc --max-bytes`` evicted most of it, so that LMDB left pages it
    allocated and freed in one transaction unwritten past the file's end."""
    path = str(tmp_path / "store")
    prompts = [random_tokens(800, seed) for seed in (1, 2)]
    with KVStore(path, model, chunk_tokens=C) as s:
        for tokens in prompts:
            s.save(tokens, compute_cache(model, tokens))
    status, out, err = run_cli(capsys, "gc", "--store", path, "--max-bytes", "60K")
    assert status == 0, err
    return path, prompts


def test_gc_of_most_of_the_store_leaves_it_openable(gc_shrunk, model, capsys):
    path, prompts = gc_shrunk
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
        for tokens in prompts:
            cache, n = s.fetch(tokens)
            if n:
                same_kv(cache, compute_cache(model, tokens[:n]), n)
        assert s.stats()["corrupt"] == 0
        assert s.stats()["nodes"] > 0


@pytest.mark.slow
def test_truncation_of_pages_lmdb_reads_is_still_refused(gc_shrunk, tmp_path):
    """Every cut of the gc-shrunk file at a page boundary is either refused, or, when
    accepted, mapped by LMDB with every record read in a child process, which a page
    past the end would kill with SIGBUS."""
    path, _ = gc_shrunk
    data = os.path.join(path, "index", "data.mdb")
    full = os.path.getsize(data)
    psize = 4096
    accepted, refused = [], []
    for size in range(2 * psize, full + 1, psize):
        cut = tmp_path / f"cut-{size}"
        shutil.copytree(path, cut)
        os.truncate(cut / "index" / "data.mdb", size)
        try:
            check_data_file(str(cut / "index" / "data.mdb"), str(cut))
            accepted.append(str(cut))
        except StoreError as e:
            assert "truncated" in str(e) and "move index/ aside" in str(e)
            refused.append(size)
            shutil.rmtree(cut)
    assert refused and accepted[-1].endswith(f"cut-{full}")
    script = textwrap.dedent(
        """
        import sys
        from kvstore.index import Index
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
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, *accepted], capture_output=True, text=True
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
