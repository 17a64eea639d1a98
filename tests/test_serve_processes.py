"""``kvstore serve`` and ``kvstore prefill`` as processes around one store: the real
model across a restart, a store shared by a prefill and two servers, a store holding
another model's prefixes."""

import json
import os

import pytest
from conftest import save_tiny_model
from serving import (
    SYSTEM,
    Server,
    answer,
    chat_body,
    request,
    run_kvstore,
    stop_all,
)

from kvstore.prompts import render_messages

pytestmark = pytest.mark.slow


def prefill(store, model_dir, prompts_file):
    """``kvstore prefill --json``: its summary (asserts success)."""
    r = run_kvstore(
        "prefill",
        prompts_file,
        "--store",
        store,
        "--model",
        model_dir,
        "--json",
        "--quiet",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def system_tokens(tokenizer, system, user):
    """Tokens of the system prompt part of a rendered chat (as mlx-lm's server splits it)."""
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": user},
    ]
    tokens, system_end, _ = render_messages(tokenizer, messages)
    assert 0 < system_end < len(tokens)
    return system_end


def write_prompts(path, system, user):
    path.write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": user},
                ]
            }
        )
        + "\n"
    )
    return str(path)


# -- 1. the real model across a restart ---------------------------------------------


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    """The converted SmolLM2 directory (under $KVSTORE_HOME when set, like ``smollm2``)."""
    from kvstore.platform.default_model import ensure_default_model

    home = os.environ.get("KVSTORE_HOME")
    root = home if home else str(tmp_path_factory.mktemp("kvstore-home"))
    return ensure_default_model(root=root)


REAL_SYSTEM = "You are a terse assistant for a bakery. Answer in one short sentence."


def real_body(user):
    body = chat_body(user, system=REAL_SYSTEM)
    body["max_tokens"] = 5
    return body


@pytest.mark.model
def test_real_model_restart_reuses_system_prompt(tmp_path, smollm2_dir):
    from mlx_lm.utils import load_tokenizer

    first, second = real_body("What do you sell?"), real_body("When do you open?")
    n_system = system_tokens(
        load_tokenizer(smollm2_dir), REAL_SYSTEM, "When do you open?"
    )

    plain = Server(["mlx_lm", "server", "--model", smollm2_dir], tmp_path / "plain.log")
    try:
        want_first, want_second = answer(plain.chat(first)), answer(plain.chat(second))
    finally:
        plain.stop()
    assert want_first.strip() and want_second.strip()

    kv = [
        "kvstore",
        "serve",
        "--model",
        smollm2_dir,
        "--store",
        str(tmp_path / "store"),
    ]
    s1 = Server(kv, tmp_path / "run1.log")
    try:
        got_first = answer(s1.chat(first))
        stats1 = s1.stats()
    finally:
        assert s1.stop() == 0, s1.output()
    assert got_first == want_first
    assert stats1["misses"] == 1 and stats1["saves"] >= 1

    s2 = Server(kv, tmp_path / "run2.log")  # a restart: nothing in RAM
    try:
        got_second = answer(s2.chat(second))
        stats2 = s2.stats()
    finally:
        assert s2.stop() == 0, s2.output()
    assert got_second == want_second
    assert stats2["disk_hits"] == 1 and stats2["ram_hits"] == 0
    assert stats2["tokens_reused_disk"] >= n_system, (stats2, n_system)
    assert (
        stats2["tokens_computed"]
        == stats2["tokens_requested"] - stats2["tokens_reused"]
    )


# -- 2. one store, a prefill process and two servers ---------------------------------


@pytest.mark.stress  # the slow tier: keeps the README's test command short
def test_prefill_while_two_servers_share_the_store(tmp_path, tiny_model_dir, tokenizer):
    store = str(tmp_path / "store")
    prompts = write_prompts(tmp_path / "p.jsonl", SYSTEM, "w40 w41 w42")
    n_system = system_tokens(tokenizer, SYSTEM, "w50 w51")
    assert n_system >= 300

    kv = ["kvstore", "serve", "--model", tiny_model_dir, "--store", store]
    servers = []
    try:
        servers.append(Server(kv, tmp_path / "a.log"))
        servers.append(Server(kv, tmp_path / "b.log"))
        summary = prefill(store, tiny_model_dir, prompts)
        assert summary["prefilled"] == 1 and summary["tokens_computed"] > n_system

        results = []
        for i, s in enumerate(servers):
            r = s.chat(chat_body(f"w{50 + i} w51"))
            results.append((r, s.stats()))
    finally:
        codes = stop_all(servers)
    assert codes == [0, 0], [s.output() for s in servers]

    for (r, stats), s in zip(results, servers):
        assert answer(r) is not None and r["usage"]["completion_tokens"] >= 1
        assert stats["disk_hits"] == 1 and stats["misses"] == 0, (stats, s.output())
        assert stats["tokens_reused_disk"] >= n_system, stats
        assert stats["stores"][0]["hits"] == 1

    v = run_kvstore("verify", "--store", store)
    assert v.returncode == 0, v.stdout + v.stderr
    assert "clean" in v.stdout


# -- 3. a store holding another model's prefixes ---------------------------------------


@pytest.mark.stress  # the slow tier: keeps the README's test command short
def test_store_of_another_model(tmp_path, tiny_model_dir):
    store = str(tmp_path / "store")
    prompts = write_prompts(tmp_path / "p.jsonl", SYSTEM, "w40 w41 w42")
    model_b = save_tiny_model(tmp_path / "model-b", seed=1)

    first = prefill(store, tiny_model_dir, prompts)  # model A
    assert first["prefilled"] == 1 and first["tokens_computed"] > 300

    s = Server(
        ["kvstore", "serve", "--model", model_b, "--store", store], tmp_path / "b.log"
    )
    try:
        a = s.chat(chat_body("w40 w41 w42"))  # the very prompt model A stored
        b = s.chat(chat_body("w50 w51"))
        stats = s.stats()
    finally:
        assert s.stop() == 0, s.output()
    assert a["usage"]["completion_tokens"] >= 1 and b["usage"]["completion_tokens"] >= 1
    assert stats["disk_hits"] == 0 and stats["tokens_reused_disk"] == 0, stats
    assert stats["store_errors"] == 0, stats
    assert stats["stores"][0]["namespaces"] == 2  # B's own namespace next to A's

    again = prefill(store, tiny_model_dir, prompts)  # model A: all still there
    assert again["tokens_computed"] == 0, again
    assert again["skipped"] == 1
    v = run_kvstore("verify", "--store", store)
    assert v.returncode == 0, v.stdout + v.stderr
