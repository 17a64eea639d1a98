"""Cache salts in ``kvstore serve``, in process: reading a request's salt, keeping
salts apart in the prompt cache (RAM and disk), carrying salts through mlx-lm's batch
generator, and ``/metrics`` parsing with the standard parser."""

from email.message import Message
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import compute_cache, random_tokens
from mlx_lm.generate import BatchGenerator
from prometheus_client.parser import text_string_to_metric_families
from serving import KEY, provider

from kvstore.disk.salts import Tenant
from kvstore.serve.request_salts import (
    UNKNOWN,
    SaltedCache,
    SaltPolicy,
    SaltRouter,
    batch_generator_class,
    missing_hooks,
)
from kvstore.server import PersistentPromptCache


def headers(*pairs):
    m = Message()
    for name, value in pairs:
        m[name] = value
    return m


# -- SaltPolicy ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, match",
    [
        ({"cache_salt": 5}, "cache_salt must be a non-empty string, got int"),
        ({"cache_salt": True}, "got bool"),
        ({"cache_salt": ["a"]}, "got list"),
        ({"cache_salt": {"a": 1}}, "got dict"),
        ({"cache_salt": ""}, "cache_salt must be a non-empty string, got ''"),
        ({"cache_salt": "x" * 257}, "cache_salt is 257 bytes long"),
        ({"cache_salt": "\ud800"}, "cache_salt is not valid text"),
    ],
)
def test_bad_body_salts(body, match):
    for policy in (SaltPolicy(), SaltPolicy(header="X-Tenant")):
        with pytest.raises(ValueError, match=match):
            policy.salt_of(body, headers(("X-Tenant", "t")))


def test_body_salt():
    p = SaltPolicy()
    assert p.salt_of({}, headers()) is None
    assert p.salt_of({"cache_salt": None}, headers()) is None  # null: not given
    assert p.salt_of({"cache_salt": "a"}, headers()) == "a"
    assert p.salt_of({"cache_salt": "x" * 256}, headers()) == "x" * 256
    # Without --salt-header a header is just a header.
    assert p.salt_of({}, headers(("X-Tenant", "t"))) is None
    required = SaltPolicy(required=True)
    with pytest.raises(ValueError, match="cache_salt is required.*--require-salt"):
        required.salt_of({}, headers())
    with pytest.raises(ValueError, match="cache_salt is required"):
        required.salt_of({"cache_salt": None}, headers())
    assert required.salt_of({"cache_salt": "a"}, headers()) == "a"


def test_header_salt():
    p = SaltPolicy(header="X-Tenant")
    assert p.salt_of({}, headers(("X-Tenant", "acme"))) == Tenant("acme")
    assert p.salt_of({}, headers(("x-tenant", "acme"))) == Tenant("acme")
    assert p.salt_of({}, headers()) is None
    # A body salt narrows the tenant's tree; without the header it is a plain salt,
    # which never reaches a tenant's tree (another domain: kvstore.disk.salts).
    assert p.salt_of({"cache_salt": "s"}, headers(("X-Tenant", "acme"))) == Tenant(
        "acme", "s"
    )
    assert p.salt_of({"cache_salt": "acme"}, headers()) == "acme"
    # Both parts may be 256 bytes: they are hashed apart, never joined.
    assert p.salt_of(
        {"cache_salt": "s" * 256}, headers(("X-Tenant", "t" * 256))
    ) == Tenant("t" * 256, "s" * 256)
    with pytest.raises(ValueError, match="header X-Tenant was sent 2 times"):
        p.salt_of({}, headers(("X-Tenant", "a"), ("X-Tenant", "a")))
    for bad, match in (("", "non-empty"), ("   ", "non-empty"), ("x" * 300, "300")):
        with pytest.raises(ValueError, match=f"header X-Tenant .*{match}"):
            p.salt_of({}, headers(("X-Tenant", bad)))
    with pytest.raises(ValueError, match="control character"):
        p.salt_of({}, headers(("X-Tenant", "a\nb")))
    required = SaltPolicy(header="X-Tenant", required=True)
    with pytest.raises(ValueError, match="header X-Tenant is required"):
        required.salt_of({"cache_salt": "s"}, headers())
    assert required.salt_of({}, headers(("X-Tenant", "acme"))) == Tenant("acme")


def sent(text):
    """A header value as http.server hands it over: its UTF-8 bytes as ISO-8859-1."""
    return text.encode("utf-8").decode("latin-1")


def test_header_salt_keeps_what_was_sent():
    p = SaltPolicy(header="X-Tenant")
    # Only HTTP's optional whitespace is cut: control characters are refused, never
    # folded into another tenant's name.
    assert p.salt_of({}, headers(("X-Tenant", sent(" \tA \t")))) == Tenant("A")
    for value, code in (
        ("A\x1f", "001F"),
        ("A\x0b", "000B"),
        ("A\x0c", "000C"),
        ("\x1cA", "001C"),
        ("A\x7f", "007F"),
        (sent("A\x85"), "0085"),  # a C1 control, sent as UTF-8
    ):
        with pytest.raises(ValueError, match=f"control character \\(U\\+{code}\\)"):
            p.salt_of({}, headers(("X-Tenant", value)))
    # A no-break space is not HTTP whitespace: another tenant, not "A".
    assert p.salt_of({}, headers(("X-Tenant", sent("A\xa0")))) == Tenant("A\xa0")
    # UTF-8 bytes are the tenant's text, counted once against 256 bytes.
    assert p.salt_of({}, headers(("X-Tenant", sent("é")))) == Tenant("é")
    assert p.salt_of({}, headers(("X-Tenant", sent("é" * 128)))) == Tenant("é" * 128)
    with pytest.raises(ValueError, match="258 bytes"):
        p.salt_of({}, headers(("X-Tenant", sent("é" * 129))))
    with pytest.raises(ValueError, match="header X-Tenant is not valid UTF-8"):
        p.salt_of({}, headers(("X-Tenant", "\xe9")))  # a latin-1 byte alone


def test_hooked_mlx_lm_names_exist():
    import mlx_lm.server

    from kvstore.serve.prefetch import HOOKED as PREFETCH_HOOKED

    assert missing_hooks(mlx_lm.server) == []
    assert missing_hooks(mlx_lm.server, PREFETCH_HOOKED) == []
    without = SimpleNamespace(ResponseGenerator=type("R", (), {"generate": None}))
    assert missing_hooks(without, PREFETCH_HOOKED) == [
        "mlx_lm.server.ResponseGenerator._next_request",
        "mlx_lm.server.ResponseGenerator._tokenize",
    ]
    assert missing_hooks(SimpleNamespace()) == [
        "mlx_lm.server.ResponseGenerator",
        "mlx_lm.server.BatchGenerator",
        "mlx_lm.server.APIHandler",
    ]


# -- PersistentPromptCache with salts ----------------------------------------------


def test_salts_are_kept_apart_in_ram_and_on_disk(tmp_path, model, tokenizer):
    tokens = random_tokens(300, seed=1)
    query = tokens + [5, 6]
    cache = compute_cache(model, tokens)
    pc = PersistentPromptCache(tmp_path / "s", provider(model, tokenizer))
    pc.insert_cache(KEY, tokens, cache, cache_type="system", salt="alice")
    for salt in (None, "bob"):
        assert pc.fetch_nearest_cache(KEY, query, salt=salt) == (None, query)
    got, rest = pc.fetch_nearest_cache(KEY, query, salt="alice")
    assert rest == [5, 6] and got[0].offset == 300
    assert pc.stats()["ram_hits"] == 1
    pc.close()

    pc = PersistentPromptCache(tmp_path / "s", provider(model, tokenizer))  # restart
    for salt in (None, "bob"):
        assert pc.fetch_nearest_cache(KEY, query, salt=salt) == (None, query)
    got, rest = pc.fetch_nearest_cache(KEY, query, salt="alice")
    assert rest == [5, 6]
    np.testing.assert_array_equal(
        np.array(got[0].keys[..., :300, :]), np.array(cache[0].keys[..., :300, :])
    )
    s = pc.stats()
    assert (s["disk_hits"], s["misses"]) == (1, 2)
    pc.close()


def test_the_router_decides_when_no_salt_is_passed(tmp_path, model, tokenizer):
    tokens = random_tokens(200, seed=2)
    query = tokens + [1]
    router = SaltRouter()
    pc = PersistentPromptCache(tmp_path / "s", provider(model, tokenizer), salts=router)
    # No request known: nothing is looked up or kept.
    assert pc.fetch_nearest_cache(KEY, query) == (None, query)
    pc.insert_cache(KEY, tokens, compute_cache(model, tokens))
    assert pc.stats()["saves_unattributed"] == 1 and len(pc) == 0

    # A sequential request: lookup and insert take its salt.
    with router.sequential("t1"):
        router.set_request("t1")
        assert pc.fetch_nearest_cache(KEY, query) == (None, query)
        pc.insert_cache(KEY, tokens, compute_cache(model, tokens))
    # A batch insert: the cache's tag wins over whatever request came last.
    router.set_request("t2")
    tagged = SaltedCache(compute_cache(model, tokens), "t2")
    pc.insert_cache(KEY, tokens, tagged)
    pc.insert_cache(KEY, tokens, SaltedCache(compute_cache(model, tokens), UNKNOWN))
    assert pc.stats()["saves_unattributed"] == 2
    pc.flush()
    for salt, n in (("t1", 200), ("t2", 200), ("t3", 0), (None, 0)):
        router.set_request(salt)
        got, rest = pc.fetch_nearest_cache(KEY, query)
        assert len(query) - len(rest) == n, salt
    assert pc.open_store(KEY).stats()["nodes"] == 2  # t1's and t2's, no unsalted
    pc.close()


def test_batch_generator_tags_caches_with_their_salt(model):
    router = SaltRouter()
    gen = batch_generator_class(BatchGenerator, router)(model, max_tokens=3)
    prompts = {"a": random_tokens(20, seed=3), None: random_tokens(9, seed=4)}
    uids = {}
    for salt, prompt in prompts.items():
        router.set_request(salt)
        (uids[salt],) = gen.insert_segments([[prompt[:10], prompt[10:]]])
    router.set_request("b")  # a later request does not change the earlier ones
    extracted = gen.extract_cache([uids["a"]])
    assert extracted[uids["a"]][0].kvstore_salt == "a"
    finished = {}
    for _ in range(50):
        _, responses = gen.next()
        for r in responses:
            if r.finish_reason is not None:
                finished[r.uid] = r.prompt_cache
        if len(finished) == 2:
            break
    assert {uid: c.kvstore_salt for uid, c in finished.items()} == {
        uids["a"]: "a",
        uids[None]: None,
    }
    assert all(isinstance(c, SaltedCache) for c in finished.values())
    assert gen._kvstore_salts == {}
    gen.close()


def test_metrics_parse_with_the_standard_parser(tmp_path, model, tokenizer):
    tokens = random_tokens(300, seed=5)
    pc = PersistentPromptCache(tmp_path / "s", provider(model, tokenizer))
    pc.insert_cache(KEY, tokens, compute_cache(model, tokens), salt="x")
    pc.fetch_nearest_cache(KEY, tokens + [1], salt="x")  # RAM
    pc.fetch_nearest_cache(KEY, tokens + [1])  # miss
    pc.flush()
    pc._lru.trim_to(n_sequences=0)
    pc.fetch_nearest_cache(KEY, tokens + [1], salt="x")  # disk
    text = pc.metrics.exposition().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    value = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in families.values()
        for s in f.samples
    }
    assert value[("kvstore_requests_total", ())] == 3
    for tier, n in (("ram", 1), ("disk", 1), ("remote", 0), ("miss", 1)):
        assert value[("kvstore_lookups_total", (("tier", tier),))] == n
    assert value[("kvstore_tokens_reused_total", (("tier", "disk"),))] == 300
    assert value[("kvstore_tokens_computed_total", ())] == 1 + 301 + 1
    assert value[("kvstore_restore_seconds_count", ())] == 1
    assert families["kvstore_restore_seconds"].type == "histogram"
    assert value[("kvstore_store_nodes", ())] == 2
    assert value[("kvstore_store_bytes", ())] > 0
    assert value[("kvstore_write_queue_depth", ())] == 0
    assert value[("kvstore_writes_dropped_total", ())] == 0
    # No label carries a salt or a prompt: only the fixed tier names.
    labels = {
        v for f in families.values() for s in f.samples for v in s.labels.values()
    }
    assert labels <= {"ram", "disk", "remote", "miss"} | {
        s.labels["le"]
        for s in families["kvstore_restore_seconds"].samples
        if "le" in s.labels
    }
    pc.close()
