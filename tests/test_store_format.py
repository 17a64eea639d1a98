"""Store format versions: a new store spreads its node files over 4,096 directories
per namespace (format 2); a store made in format 1 (256 directories) keeps its
layout and works as before: saves, restores, verify, gc and a salvage of its index."""

import glob
import json
import os

import mdbdamage as damage
import pytest
from conftest import assert_same_as_cold, compute_cache, random_tokens, run_cli

from kvstore import KVStore, maintenance
from kvstore.disk.blobs import FANOUT_CHARS, Blobs
from kvstore.disk.index import FORMAT_VERSION, READ_FORMATS, Index
from kvstore.maintenance import salvage

C = 8
PROMPTS = [random_tokens(200, 300 + i) for i in range(16)]


def node_dirs(store: str) -> set:
    """Names of the directories holding node files, every namespace."""
    return {
        os.path.basename(os.path.dirname(p))
        for p in glob.glob(os.path.join(store, "blobs", "*", "*", "*.safetensors"))
    }


def make_store(path: str, model, version: int) -> None:
    """A store of ``version`` holding PROMPTS: its index created in that format
    first, as the kvstore of that format made it."""
    Index(os.path.join(path, "index"), format_version=version).close()
    with KVStore(path, model, chunk_tokens=C) as s:
        for tokens in PROMPTS:
            s.save(tokens, compute_cache(model, tokens))


def test_the_formats_agree():
    assert set(READ_FORMATS) == set(FANOUT_CHARS)
    assert FORMAT_VERSION == max(READ_FORMATS)


@pytest.mark.parametrize("version", READ_FORMATS)
def test_a_path_parses_only_in_its_own_layout(tmp_path, version):
    blobs = Blobs(str(tmp_path / "b"), str(tmp_path / "q"), format_version=version)
    ns, h = bytes(range(16)), bytes(range(16, 32))
    path = blobs.path(ns, h)
    assert os.path.basename(os.path.dirname(path)) == h.hex()[: FANOUT_CHARS[version]]
    assert blobs.parse_path(path) == (ns, h)
    other = [v for v in READ_FORMATS if v != version][0]
    elsewhere = Blobs(blobs.root, blobs.quarantine_dir, format_version=other)
    assert blobs.parse_path(elsewhere.path(ns, h)) is None


def test_an_unknown_layout_is_refused(tmp_path):
    with pytest.raises(ValueError, match="format 99"):
        Blobs(str(tmp_path / "b"), str(tmp_path / "q"), format_version=99)
    with pytest.raises(ValueError, match="format_version"):
        Index(str(tmp_path / "i"), format_version=99)


@pytest.mark.parametrize("version", READ_FORMATS)
def test_a_store_keeps_its_format(tmp_path, model, capsys, version):
    store = str(tmp_path / "store")
    make_store(store, model, version)
    assert {len(d) for d in node_dirs(store)} == {FANOUT_CHARS[version]}
    with KVStore(store, model, chunk_tokens=C) as s:
        assert s.index.format_version == version
        assert_same_as_cold(model, s, PROMPTS[3] + [5, 6, 7], len(PROMPTS[3]))
    status, out, _ = run_cli(capsys, "verify", "--json", "--store", store)
    report = json.loads(out)
    assert status == 0 and report["clean"] and report["nodes"] > 0, report
    assert maintenance.store_stats(store)["format_version"] == version
    held = maintenance.store_stats(store)["bytes_on_disk"]
    status, _, err = run_cli(
        capsys, "gc", "--max-bytes", str(held // 2), "--store", store
    )
    assert status == 0, err
    status, out, _ = run_cli(capsys, "verify", "--json", "--store", store)
    assert status == 0 and json.loads(out)["clean"]


def test_a_new_store_is_of_the_newest_format(tmp_path, model):
    store = str(tmp_path / "store")
    with KVStore(store, model, chunk_tokens=C) as s:
        s.save(PROMPTS[0], compute_cache(model, PROMPTS[0]))
        assert s.index.format_version == FORMAT_VERSION
    assert {len(d) for d in node_dirs(store)} == {FANOUT_CHARS[FORMAT_VERSION]}


@pytest.mark.parametrize("version", READ_FORMATS)
def test_a_salvage_keeps_the_store_format(tmp_path, model, capsys, version):
    store = str(tmp_path / "store")
    make_store(store, model, version)
    damage.zero_page(store, damage.find(store, "children", leaf=True)[1])
    status, out, err = run_cli(capsys, "verify", "--fix", "--store", store)
    assert status == 1 and "salvaged" in out, (out, err)
    with KVStore(store, model, chunk_tokens=C) as s:
        assert s.index.format_version == version
        for tokens in PROMPTS[:4]:
            assert_same_as_cold(model, s, tokens + [9], len(tokens))
    status, out, _ = run_cli(capsys, "verify", "--json", "--store", store)
    report = json.loads(out)
    assert status == 0 and report["clean"] and report["orphans"] == 0, report


@pytest.mark.parametrize("version", READ_FORMATS)
def test_a_salvage_without_the_version_reads_the_layout_from_the_files(
    tmp_path, model, version
):
    store = str(tmp_path / "store")
    make_store(store, model, version)
    lost_meta = salvage._Found()  # the meta database's pages were unreadable
    assert salvage._store_format(lost_meta, os.path.join(store, "blobs")) == version
    empty = str(tmp_path / "none")
    assert salvage._store_format(lost_meta, empty) == FORMAT_VERSION


def test_an_index_created_empty_without_a_version_opens(tmp_path):
    """Every database there and empty, no format version (a kvstore that crashed
    while creating the index): it opens as a new index does."""
    import lmdb

    path = str(tmp_path / "index")
    env = lmdb.open(path, max_dbs=len(Index.DATABASES), subdir=True)
    for name in Index.DATABASES:
        env.open_db(name.encode())
    env.close()
    index = Index(path)
    try:
        assert index.format_version == FORMAT_VERSION
    finally:
        index.close()
