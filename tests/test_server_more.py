"""More ``kvstore serve`` scenarios: the real model across a restart, a store shared
by several processes, a store holding another model's prefixes, a full disk."""

import errno
import glob
import json
import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from conftest import compute_cache, random_tokens, save_tiny_model
from test_server import KEY, SYSTEM, Server, answer, chat_body, provider, request

import kvstore.fsutil
from kvstore.prompts import render_messages
from kvstore.server import PersistentPromptCache

pytestmark = pytest.mark.slow

SUBPROCESS_TIMEOUT = 120


def run_kvstore(*args, timeout=SUBPROCESS_TIMEOUT):
    """``python -m kvstore ARGS``: the CompletedProcess (never raises on exit status)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [os.getcwd(), env.get("PYTHONPATH")])
    )
    return subprocess.run(
        [sys.executable, "-m", "kvstore", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


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


def stop_all(servers):
    """Stop every server; the exit codes (all are stopped even if one fails)."""
    codes = []
    for s in servers:
        try:
            codes.append(s.stop())
        except AssertionError as e:
            codes.append(str(e))
    return codes


# -- 1. the real model across a restart ---------------------------------------------


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    """The converted SmolLM2 directory (under $KVSTORE_HOME when set, like ``smollm2``)."""
    from kvstore.default_model import ensure_default_model

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
        stats1 = request(s1.port, "/kvstore/stats")
    finally:
        assert s1.stop() == 0, s1.output()
    assert got_first == want_first
    assert stats1["misses"] == 1 and stats1["saves"] >= 1

    s2 = Server(kv, tmp_path / "run2.log")  # a restart: nothing in RAM
    try:
        got_second = answer(s2.chat(second))
        stats2 = request(s2.port, "/kvstore/stats")
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
            results.append((r, request(s.port, "/kvstore/stats")))
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
        stats = request(s.port, "/kvstore/stats")
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


# -- 4. disk full while writing -----------------------------------------------------------


def store_files(root, pattern):
    return sorted(
        glob.glob(os.path.join(root, "**", pattern), recursive=True)
    ) + sorted(glob.glob(os.path.join(root, "**", "." + pattern), recursive=True))


def test_disk_full_at_write_time(tmp_path, model, tokenizer, monkeypatch, caplog):
    caplog.set_level(logging.WARNING)
    root = str(tmp_path / "s")
    pc = PersistentPromptCache(root, provider(model, tokenizer))
    store = pc.open_store(KEY)

    # Keep what an earlier save stored: a failed write must not touch it.
    kept = random_tokens(40, seed=10)
    pc.insert_cache(KEY, kept, compute_cache(model, kept))
    pc.flush()
    before = store.stats()
    assert before["nodes"] >= 1 and before["writes_failed"] == 0
    files_before = store_files(root, "*.safetensors")

    # Writes of chunk files (kvstore.fsutil): a few bytes land, then the disk is full.
    real_os, calls = os, {"n": 0}

    def full_write(fd, data):
        calls["n"] += 1
        if calls["n"] == 1:
            return real_os.write(fd, bytes(data[:100]))
        raise OSError(errno.ENOSPC, "No space left on device")

    def full_writev(fd, buffers):
        return full_write(fd, b"".join(bytes(b) for b in buffers))

    fake_os = SimpleNamespace(
        **{k: getattr(real_os, k) for k in dir(real_os) if not k.startswith("__")}
    )
    fake_os.write, fake_os.writev = full_write, full_writev
    monkeypatch.setattr(kvstore.fsutil, "os", fake_os)

    tokens = random_tokens(300, seed=11)
    cache = compute_cache(model, tokens)
    pc.insert_cache(KEY, tokens, cache)  # must not raise
    pc.flush()
    assert calls["n"] >= 2  # the write really was attempted

    after = store.stats()
    assert after["writes_failed"] == before["writes_failed"] + 1
    assert (after["nodes"], after["stored_tokens"], after["bytes_on_disk"]) == (
        before["nodes"],
        before["stored_tokens"],
        before["bytes_on_disk"],
    )
    assert store_files(root, "*.tmp") == []
    assert store_files(root, "*.safetensors") == files_before
    failures = [
        r for r in caplog.records if r.levelno >= logging.WARNING and r.exc_info
    ]
    assert any(
        "No space left on device" in str(r.exc_info[1]) for r in failures
    ), caplog.text
    # The RAM cache still serves the prompt.
    got, rest = pc.fetch_nearest_cache(KEY, tokens + [5])
    assert rest == [5] and got[0].offset == 300

    # Space again: a later save is stored.
    monkeypatch.undo()
    later = random_tokens(200, seed=12)
    pc.insert_cache(KEY, later, compute_cache(model, later))
    pc.flush()
    final = store.stats()
    assert (
        final["nodes"] > before["nodes"]
        and final["writes_failed"] == after["writes_failed"]
    )
    assert store_files(root, "*.tmp") == []
    pc.close()

    fresh = PersistentPromptCache(root, provider(model, tokenizer))  # from disk alone
    got, rest = fresh.fetch_nearest_cache(KEY, later + [7])
    assert rest == [7] and got[0].offset == 200
    got, rest = fresh.fetch_nearest_cache(KEY, tokens + [7])
    assert got is None and len(rest) == 301  # the failed save left nothing behind
    fresh.close()
