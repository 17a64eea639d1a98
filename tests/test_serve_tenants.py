"""``kvstore serve`` with many clients at once, as real processes: the batch path and
the sequential path across restarts, against plain ``mlx_lm.server``; salts kept
apart (``cached_tokens`` and the store); a server SIGKILLed mid-batch; bad salts;
``/metrics``."""

import json
import os
import signal
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import tiny_tokenizer
from prometheus_client.parser import text_string_to_metric_families
from serving import SYSTEM, Server, chat_body, settled_stats

from kvstore import maintenance
from kvstore.disk.chunking import root_hash
from kvstore.disk.index import Index, NodeRecord
from kvstore.disk.salts import tree_roots

pytestmark = pytest.mark.slow

USERS = [f"w{40 + i} w{60 + i} w{80 + 3 * i}" for i in range(4)]


def post(port, path, body, headers=None, timeout=120):
    """``(status, json)`` of a POST (a 4xx is returned, not raised)."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def body(user, salt=None, *, max_tokens=8, messages=None):
    b = chat_body(user)
    if messages is not None:
        b["messages"] = messages
    b.update(max_tokens=max_tokens, logprobs=True, top_logprobs=5)
    if salt is not None:
        b["cache_salt"] = salt
    return b


def all_at_once(server, bodies):
    """Send every body at the same moment (one client thread each); the answers."""
    start = threading.Barrier(len(bodies))

    def one(b):
        start.wait()
        status, out = post(server.port, "/v1/chat/completions", b)
        assert status == 200, out
        return out

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(one, bodies))


def text(r):
    return r["choices"][0]["message"]["content"]


def cached(r):
    return (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def top_logprobs(r):
    """``[[(token, logprob) x 5] per generated token]``."""
    return [
        [(t["token"], t["logprob"]) for t in c["top_logprobs"]]
        for c in r["choices"][0]["logprobs"]["content"]
    ]


def assert_same_answers(got, want):
    for g, w in zip(got, want, strict=True):
        assert text(g) == text(w)
        g_top, w_top = top_logprobs(g), top_logprobs(w)
        assert [[t for t, _ in step] for step in g_top] == [
            [t for t, _ in step] for step in w_top
        ]
        np.testing.assert_allclose(
            [[lp for _, lp in step] for step in g_top],
            [[lp for _, lp in step] for step in w_top],
            rtol=0,
            atol=1e-4,
        )


def metrics(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        families = text_string_to_metric_families(r.read().decode())
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in families
            for s in f.samples
        }


def trees(store):
    """``root -> set of node hashes`` of the store's one namespace."""
    index = Index(os.path.join(store, "index"), create=False)
    try:
        nodes = index.read(
            lambda txn: {
                h: NodeRecord.decode(raw) for _, h, raw in index.iter_nodes(txn)
            }
        )
    finally:
        index.close()
    roots = tree_roots({h: (r.parent, r.start) for h, r in nodes.items()})
    assert set(roots) == set(nodes)  # every node hangs from a root
    out = {}
    for h, root in roots.items():
        out.setdefault(root, set()).add(h)
    return out, nodes


def stop_killed(server):
    server.proc.wait()
    server.log.close()


# -- the batch path ---------------------------------------------------------------


def test_batch_path_clients_across_restart(tmp_path, tiny_model_dir):
    salts = ["alice", "bob"]
    bodies = [body(u, s) for s in salts for u in USERS]  # 8 clients at once
    plain = Server(["mlx_lm", "server", "--model", tiny_model_dir], tmp_path / "p.log")
    try:
        want = all_at_once(plain, bodies)
    finally:
        plain.stop()

    store = str(tmp_path / "store")
    kv = ["kvstore.server", "--model", tiny_model_dir, "--store", store]
    s1 = Server(kv, tmp_path / "run1.log")
    try:
        got = all_at_once(s1, bodies)
    finally:
        assert s1.stop() == 0, s1.output()
    assert_same_answers(got, want)

    # The store: one tree per salt, each holding the system prompt on its own.
    assert maintenance.verify(store)["clean"]
    by_root, nodes = trees(store)
    assert len(by_root) == 2
    (ns,) = {
        bytes.fromhex(n["id"]) for n in maintenance.store_stats(store)["namespaces"]
    }
    assert root_hash(ns) not in by_root  # nothing unsalted was sent
    a, b = by_root.values()
    assert not a & b  # not one node (nor its file, named by the node) in common
    for tree in (a, b):
        assert sum(nodes[h].ntokens for h in tree if nodes[h].start == 0) >= 256

    s2 = Server(kv, tmp_path / "run2.log")  # a restart: nothing in RAM
    try:
        again = all_at_once(s2, bodies)
        # New salts and the unsalted pool find nothing of alice's or bob's.
        others = all_at_once(s2, [body(USERS[0], "carol"), body(USERS[0])])
        stats = settled_stats(s2.metrics_port)
        m = metrics(s2.metrics_port)
    finally:
        assert s2.stop() == 0, s2.output()
    assert_same_answers(again, want)
    for r in again:  # each prompt restored from its own salt's tree, to the last token
        assert cached(r) == r["usage"]["prompt_tokens"] - 1
    assert [cached(r) for r in others] == [0, 0]
    assert stats["disk_hits"] + stats["ram_hits"] == 8 and stats["misses"] == 2
    # Restores started as the requests arrived (pool threads), taken by their lookups.
    assert stats["restores_prefetched"] >= 1
    assert m[("kvstore_requests_total", ())] == 10
    assert m[("kvstore_lookups_total", (("tier", "miss"),))] == 2
    assert m[("kvstore_lookups_total", (("tier", "disk"),))] == stats["disk_hits"]
    assert m[("kvstore_restore_seconds_count", ())] == stats["disk_hits"]
    assert m[("kvstore_store_nodes", ())] == stats["stores"][0]["nodes"]
    assert maintenance.verify(store)["clean"]


# -- the sequential path -------------------------------------------------------------


@pytest.fixture(scope="module")
def llama4_dir(tmp_path_factory):
    """A tiny Llama 4 (chunked attention): caches mlx-lm's server does not batch."""
    import families
    from mlx_lm.utils import save_config, save_model

    path = tmp_path_factory.mktemp("llama4")
    save_model(path, families.build("llama4"))
    save_config(
        dict(families.CONFIGS["llama4"], model_type="llama4"),
        config_path=path / "config.json",
    )
    tiny_tokenizer().save_pretrained(path)
    return str(path)


@pytest.mark.stress  # the slow tier: keeps the README's test command short
def test_sequential_path_clients_across_restart(tmp_path, llama4_dir):
    """4 clients at once, then each client's next turn after a restart: the turn's
    prefix (the first turn and its answer) comes from the checkpoint of its own salt."""
    salts = ["alice", "bob", "alice", None]
    first = [body(u, s) for u, s in zip(USERS, salts)]

    def second_turns(answers):
        out = []
        for u, s, r in zip(USERS, salts, answers):
            messages = first[0]["messages"][:1] + [
                {"role": "user", "content": u},
                {"role": "assistant", "content": text(r)},
                {"role": "user", "content": "w7 w8 w9"},
            ]
            out.append(body(None, s, messages=messages))
        return out

    plain = Server(["mlx_lm", "server", "--model", llama4_dir], tmp_path / "p.log")
    try:
        want_first = all_at_once(plain, first)
        want_second = all_at_once(plain, second_turns(want_first))
    finally:
        plain.stop()

    store = str(tmp_path / "store")
    kv = ["kvstore.server", "--model", llama4_dir, "--store", store]
    s1 = Server(kv, tmp_path / "run1.log")
    try:
        got_first = all_at_once(s1, first)
        stats = settled_stats(s1.metrics_port)
    finally:
        assert s1.stop() == 0, s1.output()
    assert_same_answers(got_first, want_first)
    assert stats["saves"] == 4 and stats["saves_unattributed"] == 0
    by_root, _ = trees(store)
    assert len(by_root) == 3  # alice, bob, unsalted

    s2 = Server(kv, tmp_path / "run2.log")
    try:
        got_second = all_at_once(s2, second_turns(got_first))
        # bob's second turn under another salt: nothing to reuse.
        (stranger,) = all_at_once(
            s2, [dict(second_turns(got_first)[1], cache_salt="eve")]
        )
    finally:
        assert s2.stop() == 0, s2.output()
    assert_same_answers(got_second, want_second)
    for r1, r2 in zip(got_first, got_second):
        # The first turn's prompt and its answer (up to what the cache held).
        n = r1["usage"]["prompt_tokens"]
        assert n < cached(r2) <= n + r1["usage"]["completion_tokens"]
    assert cached(stranger) == 0
    assert maintenance.verify(store)["clean"]


# -- a crash in the middle of a batch -------------------------------------------------


def stream_tokens(port, b, started, timeout=120):
    """Stream a chat completion, setting ``started`` after 5 tokens; the token
    count when the stream ends or the connection breaks."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    n = 0
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps(dict(b, stream=True)),
            {"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        for line in resp:
            if line.startswith(b"data: {"):
                n += 1
                if n == 5:
                    started.release()
    except (OSError, http.client.HTTPException):
        pass  # the server was killed
    finally:
        conn.close()
    return n


@pytest.mark.stress
def test_sigkill_mid_batch_leaves_a_clean_store(tmp_path, tiny_model_dir):
    store = str(tmp_path / "store")
    kv = ["kvstore.server", "--model", tiny_model_dir, "--store", store]
    committed = body(USERS[0], "alice")
    s1 = Server(kv, tmp_path / "run1.log")
    try:
        (done,) = all_at_once(s1, [committed])
        settled_stats(s1.metrics_port)
        # 8 long generations at once; SIGKILL when every one has streamed tokens
        # (the batch is decoding and its segments are being saved).
        started = threading.Semaphore(0)
        bodies = [body(u, s, max_tokens=3000) for s in ("bob", None) for u in USERS]
        with ThreadPoolExecutor(len(bodies)) as pool:
            jobs = [pool.submit(stream_tokens, s1.port, b, started) for b in bodies]
            for _ in bodies:
                assert started.acquire(timeout=60), s1.output()
            s1.proc.send_signal(signal.SIGKILL)
            streamed = [j.result() for j in jobs]
    finally:
        if s1.proc.poll() is None:
            s1.proc.kill()
        stop_killed(s1)
    assert s1.proc.returncode == -signal.SIGKILL
    assert all(5 <= n < 3000 for n in streamed), streamed  # killed mid-generation

    report = maintenance.verify(store)
    assert report["clean"], report["problems"]  # orphan/temp files allowed, no errors

    s2 = Server(kv, tmp_path / "run2.log")
    try:
        (again,) = all_at_once(s2, [committed])
        (other,) = all_at_once(s2, [body(USERS[0], "mallory")])
    finally:
        assert s2.stop() == 0, s2.output()
    assert cached(again) == again["usage"]["prompt_tokens"] - 1  # what was committed
    assert text(again) == text(done)
    assert cached(other) == 0
    maintenance.gc(store)  # the crash's leftovers go
    assert maintenance.verify(store)["clean"]


# -- bad salts ---------------------------------------------------------------------


def test_bad_salts_are_400s_and_store_nothing(tmp_path, tiny_model_dir):
    store = str(tmp_path / "store")
    kv = ["kvstore.server", "--model", tiny_model_dir, "--store", store]
    s = Server(
        kv + ["--salt-header", "X-Tenant", "--require-salt", "--salt-disk-bytes", "1G"],
        tmp_path / "run.log",
    )
    chat, text_path = "/v1/chat/completions", "/v1/completions"
    tenant = {"X-Tenant": "acme"}
    try:
        bad = [
            (chat, body(USERS[0]), {}, "header X-Tenant is required"),
            (chat, body(USERS[0], "s"), {}, "header X-Tenant is required"),
            (chat, body(USERS[0], 5), tenant, "cache_salt must be a non-empty string"),
            (chat, body(USERS[0], ""), tenant, "cache_salt must be a non-empty string"),
            (chat, body(USERS[0], "x" * 257), tenant, "cache_salt is 257 bytes"),
            (chat, body(USERS[0], ["a"]), tenant, "got list"),
            (chat, body(USERS[0]), {"X-Tenant": ""}, "header X-Tenant must be"),
            (
                text_path,
                {"prompt": SYSTEM, "max_tokens": 2},
                {},
                "X-Tenant is required",
            ),
        ]
        for path, b, h, match in bad:
            status, out = post(s.port, path, b, h)
            assert status == 400 and match in out["error"], (match, out)
        # The header twice (urllib cannot send that): a raw request.
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
        conn.putrequest("POST", chat)
        raw = json.dumps(body(USERS[0])).encode()
        for name, value in (
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(raw))),
            ("X-Tenant", "acme"),
            ("X-Tenant", "other"),
        ):
            conn.putheader(name, value)
        conn.endheaders(raw)
        resp = conn.getresponse()
        out = json.loads(resp.read())
        conn.close()
        assert resp.status == 400 and "X-Tenant was sent 2 times" in out["error"]

        stats = s.stats()
        assert stats["rejected_requests"] == len(bad) + 1
        assert stats["requests"] == 0 and stats["saves"] == 0
        assert not any(files for _, _, files in os.walk(os.path.join(store, "blobs")))

        # Good requests: the tenant's text completion is reused by that tenant only.
        completion = {"prompt": SYSTEM, "max_tokens": 2, "temperature": 0}
        outs = []
        for h in (tenant, tenant, {"X-Tenant": "globex"}):
            status, out = post(s.port, text_path, completion, h)
            assert status == 200, out
            outs.append(cached(out))
        assert outs[0] == 0 and outs[1] > 250 and outs[2] == 0
        assert (
            metrics(s.metrics_port)[("kvstore_rejected_requests_total", ())]
            == len(bad) + 1
        )
        assert s.stats()["stores"][0]["salt_disk_budget"] == 1 << 30
    finally:
        assert s.stop() == 0, s.output()
    assert maintenance.verify(store)["clean"]
