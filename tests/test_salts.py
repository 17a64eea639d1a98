"""Cache salts in the library: separate trees per salt, the keyed root, bad salts,
maintenance tools on salted trees, prefill ``--salt`` and the per-line field."""

import json
import os

import lmdb
import numpy as np
import pytest
from conftest import compute_cache, greedy, next_logits, random_tokens

import kvstore
from kvstore import maintenance
from kvstore.disk.chunking import root_hash
from kvstore.disk.salts import (
    MAX_SALT_BYTES,
    SECRET_KEY,
    check_salt,
    salted_root,
    store_secret,
    tree_roots,
)
from kvstore.prompts import PromptError, parse_line


def store_files(path):
    out = []
    for d, _, names in os.walk(os.path.join(path, "blobs")):
        out += [os.path.join(d, n) for n in names]
    return sorted(out)


def test_salts_never_share_a_node(tmp_path, model, tokenizer):
    tokens = random_tokens(600, seed=1)
    cache = compute_cache(model, tokens)
    query = tokens + [3, 4]
    with kvstore.KVStore(tmp_path / "s", model, tokenizer) as store:
        store.save(tokens, cache, salt="alice")
        store.flush()
        assert store.fetch(query, salt="alice")[1] == 600
        assert store.lookup(query, salt="alice") == 600
        # Neither the unsalted pool nor another tenant sees alice's KV.
        for salt in (None, "bob", "alice ", "Alice"):
            got, n = store.fetch(query, salt=salt)
            assert n == 0 and got[0].offset == 0, salt
            assert store.lookup(query, salt=salt) == 0
        alice_files = store_files(store.path)

        # The same tokens saved unsalted and for bob: separate nodes and files,
        # nothing of alice's is shared or rewritten.
        store.save(tokens, cache)
        store.save(tokens, cache, salt="bob")
        store.flush()
        files = store_files(store.path)
        assert len(files) == 3 * len(alice_files)
        assert set(alice_files) <= set(files)
        assert store.stats()["nodes"] == 3 * 3  # 600 tokens = 256 + 256 + 88
        for salt in (None, "alice", "bob"):
            assert store.fetch(query, salt=salt)[1] == 600
        # The three roots differ; the salted ones are not the namespace root.
        secret = store_secret(store.index)
        roots = {salted_root(store.root, secret, s) for s in (b"alice", b"bob")}
        assert len(roots | {store.root}) == 3


def test_salted_restore_equals_cold(tmp_path, model, tokenizer):
    tokens = random_tokens(300, seed=2)
    rest = random_tokens(5, seed=3)
    cold = compute_cache(model, tokens)
    want_logits = next_logits(model, compute_cache(model, tokens), rest)
    want_tokens = greedy(model, compute_cache(model, tokens), rest, 10)
    with kvstore.KVStore(tmp_path / "s", model, tokenizer) as store:
        store.save(tokens, cold, salt="tenant-7")
    # A restart: a new process would open the store the same way.
    with kvstore.KVStore(tmp_path / "s", model, tokenizer) as store:
        got, n = store.fetch(tokens + rest, salt="tenant-7")
        assert n == 300
        np.testing.assert_allclose(
            np.array(next_logits(model, got, rest)),
            np.array(want_logits),
            rtol=1e-5,
            atol=1e-5,
        )
        got, _ = store.fetch(tokens + rest, salt="tenant-7")
        assert greedy(model, got, rest, 10) == want_tokens


def test_store_lists_no_salt(tmp_path, model, tokenizer):
    salt = "tenant-name-that-must-not-leak"
    tokens = random_tokens(100, seed=4)
    with kvstore.KVStore(tmp_path / "s", model, tokenizer) as store:
        store.save(tokens, compute_cache(model, tokens), salt=salt)
    needle = salt.encode()
    for d, _, names in os.walk(tmp_path / "s"):
        for name in names:
            assert salt not in name
            with open(os.path.join(d, name), "rb") as f:
                assert needle not in f.read(), name


def test_secret_is_random_per_store_and_kept(tmp_path, model, tokenizer):
    tokens = random_tokens(100, seed=5)
    cache = compute_cache(model, tokens)
    trees = []
    for name in ("a", "b"):
        with kvstore.KVStore(tmp_path / name, model, tokenizer) as store:
            store.save(tokens, cache, salt="same")
        stats = maintenance.store_stats(tmp_path / name, full=True)
        trees.append(stats["namespaces"][0]["salted_trees"][0]["root"])
    assert trees[0] != trees[1]  # another store, another secret: another root
    with kvstore.KVStore(tmp_path / "a", model, tokenizer) as store:
        assert store.fetch(tokens + [1], salt="same")[1] == 100  # kept across opens


def test_damaged_secret_is_a_miss_not_a_crash(tmp_path, model, tokenizer):
    tokens = random_tokens(100, seed=6)
    with kvstore.KVStore(tmp_path / "s", model, tokenizer) as store:
        store.save(tokens, compute_cache(model, tokens), salt="x")
        store.flush()
        store.index.write(
            lambda txn: txn.put(SECRET_KEY, b"short", db=store.index.db["meta"])
        )
    with kvstore.KVStore(tmp_path / "s", model, tokenizer) as store:
        got, n = store.fetch(tokens + [1], salt="x")  # logged and counted
        assert n == 0 and store.stats()["errors"] == 1
        assert store.fetch(tokens + [1])[1] == 0  # unsalted still works
        with pytest.raises(kvstore.StoreError, match="salt secret"):
            store.save(tokens, compute_cache(model, tokens), salt="x")


@pytest.mark.parametrize(
    "salt, error, match",
    [
        (7, TypeError, "salt must be a non-empty string, got int"),
        (b"x", TypeError, "got bytes"),
        (["a"], TypeError, "got list"),
        ("", ValueError, "non-empty"),
        ("x" * (MAX_SALT_BYTES + 1), ValueError, "257 bytes"),
        ("é" * 129, ValueError, "258 bytes"),  # counted in UTF-8 bytes
        ("\ud800", ValueError, "not valid text"),
    ],
)
def test_bad_salts_are_refused_and_store_nothing(
    tmp_path, model, tokenizer, salt, error, match
):
    tokens = random_tokens(50, seed=7)
    cache = compute_cache(model, tokens)
    with kvstore.KVStore(tmp_path / "s", model, tokenizer) as store:
        for call in (
            lambda: store.fetch(tokens, salt=salt),
            lambda: store.lookup(tokens, salt=salt),
            lambda: store.save(tokens, cache, salt=salt),
            lambda: store.save_prefix(tokens, cache, salt=salt),
            lambda: store.prefill(tokens, salt=salt),
            lambda: list(
                kvstore.stream_generate(
                    model, tokenizer, tokens, store=store, salt=salt, max_tokens=2
                )
            ),
        ):
            with pytest.raises(error, match=match):
                call()
        store.flush()
        assert store.stats()["nodes"] == 0 and store_files(store.path) == []
    assert check_salt("x" * MAX_SALT_BYTES) == b"x" * MAX_SALT_BYTES


def test_prefill_and_stream_generate_take_the_salt(tmp_path, model, tokenizer):
    system = random_tokens(280, seed=8)
    prompt = system + random_tokens(6, seed=9)
    with kvstore.KVStore(tmp_path / "s", model, tokenizer) as store:
        done = store.prefill(system, salt="t1")
        assert done == {"tokens": 280, "computed": 280, "reused": 0}
        store.flush()
        assert store.prefill(system, salt="t1")["computed"] == 0
        assert store.prefill(system, salt="t2")["computed"] == 280
        store.flush()
        want = [
            r.token
            for r in kvstore.stream_generate(
                model, tokenizer, prompt, store=store, salt="t3", max_tokens=4
            )
        ]
        store.flush()
        before = store.stats()["hits"]
        got = [
            r.token
            for r in kvstore.stream_generate(
                model, tokenizer, prompt, store=store, salt="t1", max_tokens=4
            )
        ]
        assert got == want and store.stats()["hits"] == before + 1
        assert store.lookup(prompt, salt="t1") >= 280
        assert store.lookup(prompt) == 0


def test_maintenance_sees_salted_trees(tmp_path, model, tokenizer):
    a, b = random_tokens(520, seed=10), random_tokens(90, seed=11)
    with kvstore.KVStore(tmp_path / "s", model, tokenizer) as store:
        store.save(a, compute_cache(model, a), salt="big")
        store.save(b, compute_cache(model, b), salt="small")
        store.save(b, compute_cache(model, b))
        store.flush()
        ns = store.namespace
    stats = maintenance.store_stats(tmp_path / "s", full=True)
    (space,) = stats["namespaces"]
    trees = space["salted_trees"]
    assert [(t["nodes"], t["tokens"]) for t in trees] == [(3, 520), (1, 90)]
    assert trees[0]["bytes"] > trees[1]["bytes"] > 0
    assert space["nodes"] == 5 and space["tokens"] == 520 + 90 + 90
    assert all(len(t["root"]) == 32 and t["root"] != root_hash(ns).hex() for t in trees)

    report = maintenance.verify(tmp_path / "s")
    assert report["clean"], report["problems"]
    # gc keeps salted trees (they are not orphans) and evicts them like any other.
    maintenance.gc(tmp_path / "s")
    assert maintenance.store_stats(tmp_path / "s")["namespaces"][0]["nodes"] == 5
    maintenance.gc(tmp_path / "s", max_bytes=0)
    assert maintenance.store_stats(tmp_path / "s")["namespaces"][0]["nodes"] == 0
    assert maintenance.verify(tmp_path / "s")["clean"]


def test_verify_still_catches_a_lost_parent(tmp_path, model, tokenizer):
    a = random_tokens(520, seed=12)
    with kvstore.KVStore(tmp_path / "s", model, tokenizer) as store:
        store.save(a, compute_cache(model, a), salt="t")
        store.flush()
        ns = store.namespace
        first = [
            h
            for _, h, raw in store.index.read(lambda t: list(store.index.iter_nodes(t)))
            if store.index.get_node(ns, h).start == 0
        ]
        store.index.write(lambda txn: store.index.delete_node(txn, ns, first[0]))
    report = maintenance.verify(tmp_path / "s")
    assert not report["clean"]
    kinds = sorted(p["kind"] for p in report["problems"])
    assert kinds == ["orphan", "unreachable"]  # the deleted node's file, its child


def test_tree_roots():
    r, s = b"R" * 16, b"S" * 16
    nodes = {
        b"a": (r, 0),
        b"b": (b"a", 10),
        b"c": (b"b", 20),
        b"d": (s, 0),
        b"e": (b"d", 5),
        b"f": (b"gone", 30),  # cut off
        b"x": (b"y", 3),  # a loop
        b"y": (b"x", 4),
    }
    assert tree_roots(nodes) == {b"a": r, b"b": r, b"c": r, b"d": s, b"e": s}


def test_prompt_line_salt_field(tokenizer):
    line = parse_line(1, json.dumps({"tokens": [5, 6], "salt": "t"}), tokenizer)
    assert line.salt == "t"
    line = parse_line(1, json.dumps({"tokens": [5, 6]}), tokenizer, default_salt="d")
    assert line.salt == "d"
    line = parse_line(
        1, json.dumps({"tokens": [5], "salt": "t"}), tokenizer, default_salt="d"
    )
    assert line.salt == "t"
    for bad, match in ((1, "got int"), ("", "non-empty"), ("x" * 300, "300 bytes")):
        with pytest.raises(PromptError, match=f"field 'salt'.*{match}"):
            parse_line(1, json.dumps({"tokens": [5], "salt": bad}), tokenizer)


def test_cli_prefill_salt_and_stats(tmp_path, tiny_model_dir, capsys):
    from kvstore.cli import main

    system = " ".join(f"w{3 + i % 500}" for i in range(300))
    prompts = tmp_path / "p.jsonl"
    lines = [
        {"messages": [{"role": "system", "content": system}], "salt": "line-salt"},
        {"messages": [{"role": "system", "content": system}]},  # takes --salt
        {"prompt": "w9 w10", "salt": ""},  # a bad line: reported, the rest goes on
    ]
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    store = str(tmp_path / "s")
    common = ["--store", store, "--model", tiny_model_dir, "--json", "--quiet"]
    assert main(["prefill", str(prompts), "--salt", "flag-salt", *common]) == 1
    out, err = capsys.readouterr()
    assert f"{prompts}:3: field 'salt' must be a non-empty string" in err
    summary = json.loads(out.strip().splitlines()[-1])
    assert (summary["prefilled"], summary["failed"]) == (2, 1)

    assert main(["stats", "--store", store, "--json", "--full"]) == 0
    (space,) = json.loads(capsys.readouterr().out)["namespaces"]
    assert len(space["salted_trees"]) == 2
    assert space["nodes"] == sum(t["nodes"] for t in space["salted_trees"])
    assert main(["stats", "--store", store, "--full"]) == 0
    text = capsys.readouterr().out
    assert text.count("salted tree ") == 2
    assert "flag-salt" not in text and "line-salt" not in text

    # Rerun: everything is found in the salts' own trees.
    assert main(["prefill", str(prompts), "--salt", "flag-salt", *common]) == 1
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["tokens_computed"], summary["skipped"]) == (0, 2)

    for bad in ("", "x" * 257):
        with pytest.raises(SystemExit) as e:
            main(["prefill", str(prompts), "--salt", bad, *common])
        assert e.value.code == 2
        assert "--salt" in capsys.readouterr().err


def saved_bytes(path, model, tokenizer, tokens, cache):
    """Bytes on disk of ``tokens`` saved alone into a new store at ``path``."""
    with kvstore.KVStore(path, model, tokenizer) as probe:
        probe.save(tokens, cache)
        probe.flush()
        return probe.stats()["bytes_on_disk"]


def test_salt_quota_evicts_only_that_tenants_tree(tmp_path, model, tokenizer):
    prompts = [[10 + i] + random_tokens(99, seed=50 + i) for i in range(6)]
    caches = [compute_cache(model, p) for p in prompts]
    node_bytes = saved_bytes(
        tmp_path / "probe", model, tokenizer, prompts[0], caches[0]
    )
    quota = 2 * node_bytes + node_bytes // 2  # room for two such prompts
    with kvstore.KVStore(
        tmp_path / "s", model, tokenizer, salt_disk_bytes=quota
    ) as store:
        store.save(prompts[0], caches[0])  # unsalted: no quota
        store.save(prompts[1], caches[1], salt="quiet")
        store.save(prompts[5], caches[5], salt="noisy", pin=True)  # never evicted
        store.flush()
        for i in (2, 3, 4):  # the noisy tenant goes on saving
            store.save(prompts[i], caches[i], salt="noisy")
            store.flush()
            trees = maintenance.store_stats(store.path, full=True)["namespaces"][0]
            noisy = [t for t in trees["salted_trees"] if t["nodes"] > 1]
            assert all(t["bytes"] <= quota for t in trees["salted_trees"])
        assert store.fetch(prompts[0] + [1])[1] == 100  # others untouched
        assert store.fetch(prompts[1] + [1], salt="quiet")[1] == 100
        assert store.fetch(prompts[5] + [1], salt="noisy")[1] == 100  # pinned
        assert store.fetch(prompts[4] + [1], salt="noisy")[1] == 100  # newest
        assert store.fetch(prompts[2] + [1], salt="noisy")[1] == 0  # evicted
        assert store.stats()["nodes_evicted"] == 2
        assert len(noisy) == 1 and noisy[0]["nodes"] == 2
    assert maintenance.verify(tmp_path / "s")["clean"]
    with pytest.raises(ValueError, match="salt_disk_bytes"):
        kvstore.KVStore(tmp_path / "s", model, tokenizer, salt_disk_bytes=-1)


def test_tenants_and_plain_salts_never_share_a_tree(tmp_path, model, tokenizer):
    tokens = random_tokens(300, seed=3)
    cache = compute_cache(model, tokens)
    query = tokens + [3, 4]
    trees = (
        kvstore.Tenant("A"),
        "A",
        kvstore.Tenant("A", "s"),
        kvstore.Tenant("A\ns"),  # what the tenant "A" with cache_salt "s" once was
        "A\ns",
        kvstore.Tenant("s"),
    )
    with kvstore.KVStore(tmp_path / "s", model, tokenizer) as store:
        for saved in trees:
            store.save(tokens, cache, salt=saved)
            store.flush()
            for other in trees:
                want = 300 if trees.index(other) <= trees.index(saved) else 0
                assert store.lookup(query, salt=other) == want, (saved, other)
        assert store.fetch(query, salt=kvstore.Tenant("A", "s"))[1] == 300
        roots = {
            store.parts.tree_of(kvstore.disk.salts.parse_salt(t))[0] for t in trees
        }
        assert len(roots | {store.root}) == len(trees) + 1
    for bad, error, match in (
        (kvstore.Tenant(""), ValueError, "salt tenant must be a non-empty"),
        (kvstore.Tenant(None), TypeError, "salt tenant must be a non-empty"),
        (kvstore.Tenant("A", ""), ValueError, "salt salt must be a non-empty"),
        (kvstore.Tenant("A", "x" * 257), ValueError, "257 bytes"),
        (kvstore.Tenant("A", 5), TypeError, "got int"),
    ):
        with kvstore.KVStore(tmp_path / "s", model, tokenizer) as store:
            with pytest.raises(error, match=match):
                store.fetch(query, salt=bad)


def _quota_case(tmp_path, model, tokenizer, noisy_salts):
    """Tenant B saves one prompt, tenant A then saves 5 prompts under
    ``noisy_salts(i)``; every tree under a per-tenant quota of two prompts and a disk
    budget of five. Returns the tokens B and A's last prompt still restore, the bytes
    of A's trees, and one prompt's bytes."""
    prompts = [[10 + i] + random_tokens(99, seed=70 + i) for i in range(6)]
    caches = [compute_cache(model, p) for p in prompts]
    node_bytes = saved_bytes(
        tmp_path / "probe", model, tokenizer, prompts[0], caches[0]
    )
    path = tmp_path / "s"
    with kvstore.KVStore(
        path,
        model,
        tokenizer,
        salt_disk_bytes=2 * node_bytes + node_bytes // 2,
        disk_bytes=5 * node_bytes + node_bytes // 2,
    ) as store:
        store.save(prompts[0], caches[0], salt=kvstore.Tenant("B"))
        store.flush()
        for i in range(1, 6):
            store.save(prompts[i], caches[i], salt=noisy_salts(i))
            store.flush()
        kept = store.fetch(prompts[0] + [1], salt=kvstore.Tenant("B"))[1]
        newest = store.fetch(prompts[5] + [1], salt=noisy_salts(5))[1]
        stats = maintenance.store_stats(path, full=True)["namespaces"][0]
    assert maintenance.verify(path)["clean"]
    a_bytes = sum(t["bytes"] for t in stats["salted_trees"]) - node_bytes
    return kept, newest, a_bytes, node_bytes


def test_tenant_quota_counts_its_narrowed_trees(tmp_path, model, tokenizer):
    # A tenant sending a new cache_salt with each prompt stays within its quota, so
    # it cannot push tenant B's prefix out of the shared disk budget.
    kept, newest, a_bytes, node_bytes = _quota_case(
        tmp_path / "narrowed", model, tokenizer, lambda i: kvstore.Tenant("A", f"s{i}")
    )
    assert (kept, newest) == (100, 100)
    assert a_bytes <= 2 * node_bytes + node_bytes // 2
    # Control: plain salts are trees of their own, each with its own quota, so the
    # same traffic fills the disk budget and evicts B's prefix.
    kept, newest, a_bytes, _ = _quota_case(
        tmp_path / "plain", model, tokenizer, lambda i: f"s{i}"
    )
    assert (kept, newest) == (0, 100)
    assert a_bytes > 2 * node_bytes + node_bytes // 2


def test_tenant_groups_are_hashes_kept_only_while_needed(tmp_path, model, tokenizer):
    from kvstore.disk.index import Index
    from kvstore.disk.salts import GROUP_PREFIX
    from kvstore.maintenance.common import prefixed_items

    def groups(path):
        index = Index(os.path.join(path, "index"), create=False)
        try:
            return index.read(
                lambda txn: [
                    k for k, _ in prefixed_items(txn, index.db["meta"], GROUP_PREFIX)
                ]
            )
        finally:
            index.close()

    prompts = [[10 + i] + random_tokens(99, seed=90 + i) for i in range(6)]
    caches = [compute_cache(model, p) for p in prompts]
    path = tmp_path / "s"
    with kvstore.KVStore(path, model, tokenizer, salt_disk_bytes=1) as store:
        for i in range(5):  # a quota below one prompt: each save evicts the last
            store.save(prompts[i], caches[i], salt=kvstore.Tenant("tenant-a", f"s{i}"))
            store.flush()
        store.save(prompts[5], caches[5], salt=kvstore.Tenant("tenant-b"))
        store.flush()
        ns = store.namespace
        keys = groups(path)
        # Hashes only; a narrowed tree found empty is forgotten, so five cache_salts
        # leave two records (the last, and the one its save emptied).
        assert len(keys) == 2 and all(k.startswith(GROUP_PREFIX + ns) for k in keys)
        assert b"tenant" not in b"".join(keys)
    maintenance.gc(path, drop_namespaces=[ns.hex()])
    assert groups(path) == []
