"""A damaged ``index/data.mdb`` (a lost disk sector, a flipped bit, a careless tool)
never ends a kvstore process: every command says so in one line (status 2), ``serve``
refuses to start (both check every page), ``KVStore(...)`` raises StoreError for damage
its bounded check sees (meta pages, the roots) and otherwise opens and meets the
damage as a logged, counted miss, and ``kvstore verify --fix`` salvages what can be
read.

The damage is made here, page by page (``mdbdamage``). Commands run in this process
(the page check keeps liblmdb from reading a damaged page, so nothing can abort), and
as subprocesses for the cases that ended in liblmdb's assertions (SIGABRT) and for
the library meeting damage below the roots.
"""

import glob
import json
import logging
import os
import shutil
import signal
import subprocess
import sys

import mdbdamage as damage
import numpy as np
import pytest
from conftest import compute_cache, random_tokens, run_cli

from kvstore import KVStore, StoreError, server
from kvstore.disk import pageguard
from kvstore.disk.index import Index, IndexDamaged

pytestmark = pytest.mark.stress

C = 8  # tokens per chunk: ~400 nodes, trees of three levels
PROMPTS = [random_tokens(200, 100 + i) for i in range(16)]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, model):
    path = str(tmp_path_factory.mktemp("damaged") / "pristine")
    with KVStore(path, model, chunk_tokens=C) as s:
        for tokens in PROMPTS:
            s.save(tokens, compute_cache(model, tokens))
    assert damage.find(path, "children", level=2), "the test wants a 3-level tree"
    return path


@pytest.fixture
def store(pristine, tmp_path):
    path = str(tmp_path / "store")
    shutil.copytree(pristine, path)
    return path


# name -> (damage, what the one line says)
CASES = {
    "zeroed-nodes-leaf": (
        lambda s: damage.zero_page(s, damage.find(s, "nodes", leaf=True)[3]),
        "is zeroed",
    ),
    "zeroed-nodes-root": (
        lambda s: damage.zero_page(s, damage.find(s, "nodes", level=1)[0]),
        "is zeroed",
    ),
    "zeroed-children-branch": (
        lambda s: damage.zero_page(s, damage.find(s, "children", level=2)[1]),
        "is zeroed",
    ),
    "zeroed-children-leaf": (
        lambda s: damage.zero_page(s, damage.find(s, "children", leaf=True)[5]),
        "is zeroed",
    ),
    "zeroed-atime-leaf": (
        lambda s: damage.zero_page(s, damage.find(s, "atime", leaf=True)[2]),
        "is zeroed",
    ),
    "zeroed-main-root": (
        lambda s: damage.zero_page(s, damage.find(s, "main", level=1)[0]),
        "is zeroed",
    ),
    "flipped-root-near": (lambda s: damage.flip_main_root(s, 3), "main database"),
    "flipped-root-far": (
        lambda s: damage.flip_main_root(s, 10),
        "outside the file's pages",
    ),
    "tied-meta-pages-older": (
        lambda s: damage.tie_meta_pages(s, to="older"),
        "both meta pages claim",
    ),
    "tied-meta-pages-newer": (
        lambda s: damage.tie_meta_pages(s, to="newer"),
        "both meta pages claim",
    ),
    "meta-of-another-page-size": (damage.meta_of_other_page_size, "page size"),
    "free-list-lists-a-live-page": (
        lambda s: damage.free_list_lists(s, damage.find(s, "nodes", leaf=True)[2]),
        "free list names",
    ),
    "free-list-lists-a-root": (
        lambda s: damage.free_list_lists(s, damage.find(s, "children", level=1)[0]),
        "free list names",
    ),
}
# Damage that loses records: the rest keep every node.
LOSES_NODES = {"zeroed-nodes-leaf"}
# Damage below the roots of a tree larger than mdbcheck.SMALL_TREE_PAGES (or in a
# small tree: then refused), which KVStore(...)'s bounded check may not read: the
# open's full check in the background (kvstore.disk.pageguard) finds it.
BELOW_THE_ROOTS = {
    "zeroed-nodes-leaf",
    "zeroed-children-branch",
    "zeroed-children-leaf",
    "zeroed-atime-leaf",
    "free-list-lists-a-live-page",
}
_LIBRARY = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
from conftest import compute_cache, random_tokens, tiny_llama
from kvstore import KVStore, StoreError
from kvstore.disk import pageguard
if len(sys.argv) > 3:  # 0: the open's full page check in a child process
    pageguard.CHILD_PAGES = int(sys.argv[3])
model = tiny_llama(0)
prompts = [random_tokens(200, 100 + i) for i in range(16)]
try:
    s = KVStore(sys.argv[1], model, chunk_tokens=8)
except StoreError as e:
    print(json.dumps({"refused": str(e)}))
    sys.exit(0)
with s:
    fetched = [s.fetch(t + [1])[1] for t in prompts]
    extra = prompts[1] + [3, 4, 5]
    saved = s.save(extra, compute_cache(model, extra))
    s.flush()
    stats = s.stats()
print(json.dumps({"fetched": fetched, "saved": saved, "errors": stats["errors"],
                  "problem": stats["store_problem"],
                  "unsaved": stats["writes_failed"] + stats["writes_dropped"]}))
"""


def one_line(err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], err


def restored_prompts(path, model):
    """``(whole, restored)``: prompts restored to their last stored token, and the
    tokens restored of each; every restored KV equals the KV computed from scratch,
    bit for bit."""
    whole, counts = 0, []
    with KVStore(path, model, chunk_tokens=C) as s:
        for tokens in PROMPTS:
            cache, n = s.fetch(tokens + [1])
            counts.append(n)
            whole += n == len(tokens)
            if n:
                fresh = compute_cache(model, tokens[:n])
                for got, want in zip(cache, fresh):
                    for part in ("keys", "values"):
                        a, b = getattr(got, part), getattr(want, part)
                        assert np.array_equal(
                            np.array(a[..., :n, :]), np.array(b[..., :n, :])
                        )
    return whole, counts


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_command_says_the_index_is_damaged_in_one_line(
    store, model, capsys, monkeypatch, case
):
    make, says = CASES[case]
    make(store)
    scans = (["stats", "--full"], ["verify"], ["ls", "--no-decode"], ["gc"])
    for argv in scans:
        status, _, err = run_cli(capsys, *argv, "--store", store)
        assert status == 2, (argv, err)
        one_line(err, store, "index/data.mdb is damaged", says, "verify --fix")
    # Plain stats reads the kept totals only (small trees, which the bounded check
    # covers whole), in a time that does not grow with the index: it sees what
    # that check sees, and reads no page below a large tree's root. The background
    # check every open starts may find damage there first: then it says so.
    try:
        Index(os.path.join(store, "index"), create=False, readonly=True).close()
        bounded_check_sees = False
    except IndexDamaged:
        bounded_check_sees = True
    assert bounded_check_sees or case in BELOW_THE_ROOTS
    status, _, err = run_cli(capsys, "stats", "--store", store)
    if bounded_check_sees or status != 0:
        assert status == 2, err
        one_line(err, store, "index/data.mdb is damaged", says, "verify --fix")
    if case not in BELOW_THE_ROOTS:
        with pytest.raises(IndexDamaged, match="index/data.mdb is damaged") as e:
            KVStore(store, model, chunk_tokens=C)
        assert says in str(e.value) and len(str(e.value).splitlines()) == 1
    assert issubclass(IndexDamaged, StoreError)
    import mlx_lm.server

    def serve():
        raise AssertionError("kvstore serve got past its store checks")

    monkeypatch.setattr(mlx_lm.server, "main", serve)
    monkeypatch.setattr("kvstore.server.check_server", lambda **kw: True)
    assert server.main(["--store", store], hard_exit=False) == 2
    one_line(capsys.readouterr().err, store, "index/data.mdb is damaged", says)


@pytest.mark.parametrize(
    "case,child_pages",
    [(case, pageguard.CHILD_PAGES) for case in sorted(CASES)]
    + [(case, 0) for case in sorted(BELOW_THE_ROOTS)],
)
def test_kvstore_refuses_what_its_check_sees_and_meets_the_rest_as_misses(
    store, case, child_pages
):
    """In a child process (an assertion in liblmdb would end it): ``KVStore(...)``
    raises the one-line StoreError for damage its bounded check reads (meta pages,
    roots, small trees), or opens, and the full check it runs in the background
    finds the rest (the read path checks the pages its cursors step onto until
    then): a logged, counted miss, no traceback, no signal, every restore whole or a
    miss, and nothing written into the damaged file (a free list naming a page in
    use would have a write overwrite it)."""
    make, says = CASES[case]
    make(store)
    with open(damage.data_file(store), "rb") as f:
        before = f.read()
    tests = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run(
        [sys.executable, "-c", _LIBRARY, store, tests, str(child_pages)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    with open(damage.data_file(store), "rb") as f:
        assert f.read() == before, "a write went into the damaged index"
    result = json.loads(proc.stdout)
    if "refused" in result:  # by the bounded check, or the full one found it first
        one_line(result["refused"], store, "index/data.mdb is damaged", says)
        return
    assert case in BELOW_THE_ROOTS, f"{case}: the bounded check let it open"
    assert set(result["fetched"]) <= {0, 200}, result
    # Found by the full check at the latest when the save's write waited for it (or
    # met first by a search, which liblmdb answers with MDB_CORRUPTED): logged once,
    # reads and writes stopped, the save not written.
    problem = result["problem"] or ""
    assert "index/data.mdb is damaged" in problem, result
    assert says in problem or "CorruptedError met" in problem, result
    logged = [ln for ln in proc.stderr.splitlines() if "is damaged" in ln]
    assert len(logged) == 1, proc.stderr
    assert result["saved"] == 0 or result["unsaved"] >= 1, result
    if case == "zeroed-nodes-leaf":  # every walk passes the lost leaf's branch
        assert result["errors"] > 0, result


_NO_FULL_CHECK = r"""
import sys, threading
from kvstore import KVStore
from kvstore.disk import pageguard
from kvstore.disk.index import Index
go = threading.Event()  # the open's full check waits until the first save returned
start, save = pageguard.PageAudit.start, KVStore.save
def held_back(self, read, on_damage, *, name):
    start(self, lambda fn: go.wait() and read(fn), on_damage, name=name)
def saving(self, *args, **kwargs):
    try:
        return save(self, *args, **kwargs)
    finally:
        go.set()
pageguard.PageAudit.start, KVStore.save = held_back, saving
if sys.argv[3] == "unguarded":
    Index.cover = lambda self, txn, name, prefix=b"": True
sys.argv[3:] = []
"""


@pytest.mark.parametrize("case", ["zeroed-children-branch", "zeroed-children-leaf"])
def test_the_read_path_checks_its_cursor_ranges_while_the_full_check_runs(store, case):
    """With the open's full check held back until the first save has returned, the
    read path steps onto no damaged page: the children ranges it reads are checked
    first, and the damage is a logged miss. Without those checks the save's trie
    walk ends the process: its ``set_range`` past a leaf's last key steps onto the
    zeroed branch page (liblmdb: ``IS_BRANCH`` asserted in ``mdb_cursor_sibling``,
    SIGABRT), in the caller's thread."""
    make, says = CASES[case]
    make(store)
    tests = os.path.dirname(os.path.abspath(__file__))
    code = _NO_FULL_CHECK + _LIBRARY
    proc = subprocess.run(
        [sys.executable, "-c", code, store, tests, "guarded"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    result = json.loads(proc.stdout)
    assert set(result["fetched"]) <= {0, 200}, result
    problem = result["problem"] or ""
    assert "index/data.mdb is damaged" in problem and says in problem, result
    if case == "zeroed-children-branch":  # met by the save's walk: not saved
        assert result["saved"] == 0 and result["unsaved"] >= 1, result
    if case == "zeroed-children-branch":
        proc = subprocess.run(
            [sys.executable, "-c", code, store, tests, "unguarded"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == -signal.SIGABRT, (proc.returncode, proc.stderr)


_EVERY_RANGE = r"""
import random, sys
import numpy as np
from kvstore.disk import mdbcheck, pageguard
from kvstore.disk.index import Index
pageguard.PageAudit.start = lambda *a, **kw: None  # only the ranges are checked
index = Index(sys.argv[1], create=False, readonly=True)
audit = index._shared.audit
Index.cover = lambda self, txn, name, prefix=b"": True  # checked below, or not
nodes = index.read(lambda t: list(index.iter_nodes(t)), guarded=True)
rng = random.Random(0)
refused = stepped = 0
for ns, h, _ in nodes:
    query = np.array([rng.randrange(1000) for _ in range(8)], dtype=np.int32)
    def steps(txn):
        if sys.argv[2] == "checked":
            try:
                audit.cover(txn, "children", ns + h)
            except mdbcheck.Damage:
                return False
        index.children(ns, h, txn)
        index.nearest_children(ns, h, query, txn)
        index.prefix_children(ns, h, query, txn)
        index.has_children(txn, ns, h)
        return True
    if index.read(steps, guarded=True):
        stepped += 1
    else:
        refused += 1
print(refused, stepped)
"""


@pytest.mark.parametrize("case", ["zeroed-children-branch", "zeroed-children-leaf"])
def test_a_checked_range_holds_every_page_its_cursor_steps_onto(store, case):
    """Every children range of every node (the ranges the read path's cursors
    take), in one child process: where the range's pages were checked sound, the
    cursor steps of a fetch and a save over it (``set_range``, ``prev``, ``last``,
    ``next`` past the range's end) never reach the zeroed page; without the check,
    some do, and liblmdb ends the process (SIGABRT)."""
    CASES[case][0](store)
    run = [sys.executable, "-c", _EVERY_RANGE, os.path.join(store, "index")]
    proc = subprocess.run(run + ["checked"], capture_output=True, text=True)
    assert proc.returncode == 0 and not proc.stderr, (proc.returncode, proc.stderr)
    refused, stepped = map(int, proc.stdout.split())
    assert refused > 0 and stepped > 0, (refused, stepped)
    proc = subprocess.run(run + ["all"], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGABRT, (proc.returncode, proc.stderr)


@pytest.mark.parametrize("case", sorted(CASES))
def test_verify_fix_salvages_a_store_that_opens_verifies_and_restores(
    store, model, capsys, case
):
    make, _ = CASES[case]
    stored = sum(map(len, damage.node_keys_by_page(store).values()))
    make(store)
    status, out, err = run_cli(capsys, "verify", "--fix", "--store", store)
    assert status == 1 and "Traceback" not in err and not err, (out, err)
    assert "salvaged" in out and "problems found (fixed)" in out, out
    aside = glob.glob(os.path.join(store, "index.damaged-*"))
    assert len(aside) == 1 and os.path.exists(os.path.join(aside[0], "data.mdb"))
    status, out, err = run_cli(capsys, "verify", "--json", "--store", store)
    report = json.loads(out)
    assert status == 0 and report["clean"], report["problems"]
    whole, counts = restored_prompts(store, model)
    print(
        f"{case}: {whole} of {len(PROMPTS)} prompts restored whole, "
        f"{report['nodes']} of {stored} nodes kept"
    )
    if case in LOSES_NODES:
        # A zeroed leaf of the nodes database: its records are gone, unless an older
        # copy of the page survives; the prompts whose nodes all survived restore.
        assert report["nodes"] < stored and whole < len(PROMPTS)
        assert report["orphans"] == stored - report["nodes"]
        assert sum(counts) > 0
    else:
        assert report["nodes"] == stored and whole == len(PROMPTS)


def test_a_salvage_refuses_while_another_process_has_the_store_open(store, model):
    with KVStore(store, model, chunk_tokens=C):
        damage.zero_page(store, damage.find(store, "nodes", leaf=True)[3])
        code = (
            "import sys; from kvstore import maintenance; "
            "maintenance.verify(sys.argv[1], fix=True)"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code, store], capture_output=True, text=True
        )
        assert proc.returncode == 1 and "another process has the store open" in (
            proc.stderr
        ), proc.stderr
    assert not glob.glob(os.path.join(store, "index.damaged-*"))


def test_damage_met_while_a_store_is_open_is_a_logged_miss(store, model, caplog):
    """The page check runs at the open; a page damaged afterwards is met by liblmdb
    as MDB_CORRUPTED: logged once, reads and writes of the index stop, every fetch
    is a counted miss, and the store keeps answering."""
    caplog.set_level(logging.ERROR, logger="kvstore")
    with KVStore(store, model, chunk_tokens=C) as s:
        assert s.fetch(PROMPTS[0] + [1])[1] == len(PROMPTS[0])
        damage.zero_page(store, damage.find(store, "nodes", level=1)[0])
        for tokens in PROMPTS[:4]:
            cache, n = s.fetch(tokens + [1])
            assert n == 0 and cache[0].offset == 0
            assert s.lookup(tokens) == 0
        extra = PROMPTS[1] + [3, 4, 5]
        assert s.save(extra, compute_cache(model, extra)) == 0
        s.flush()
        stats = s.stats()
        assert stats["errors"] == 8 and stats["writes_dropped"] == 1
        assert "index/data.mdb is damaged" in stats["store_problem"]
    logged = [r for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(logged) == 1 and not logged[0].exc_info, caplog.text


@pytest.mark.slow
@pytest.mark.parametrize("case", ["zeroed-nodes-leaf", "zeroed-children-branch"])
def test_no_command_ends_by_a_signal(store, case):
    """Without the page check these end in liblmdb's assertions (SIGABRT, exit 134):
    verify and gc, the commands an operator runs to diagnose and repair."""
    CASES[case][0](store)
    for argv in (["verify"], ["gc"]):
        proc = subprocess.run(
            [sys.executable, "-m", "kvstore", *argv, "--store", store],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 2, (argv, proc.returncode, proc.stderr)
        one_line(proc.stderr, store, "index/data.mdb is damaged")
    proc = subprocess.run(
        [sys.executable, "-m", "kvstore", "verify", "--fix", "--store", store],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1 and not proc.stderr, proc.stderr
    assert "salvaged" in proc.stdout
