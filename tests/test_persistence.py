"""Snapshots outlive the process that wrote them: save in one process, fetch in another."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))

SAVE = """
import sys; sys.path.insert(0, {tests!r})
from conftest import tiny_llama, random_tokens, compute_cache
from kvstore import KVStore
model = tiny_llama(0)
tokens = random_tokens(700, seed=11)
with KVStore({path!r}, model, chunk_tokens=128) as store:
    store.save(tokens, compute_cache(model, tokens), kind="system", pin=True)
# close() waits for the background writer: nothing is lost at exit
"""

FETCH = """
import json, sys; sys.path.insert(0, {tests!r})
import mlx.core as mx
from conftest import tiny_llama, random_tokens, compute_cache, next_logits, greedy
from kvstore import KVStore
model = tiny_llama(0)
tokens = random_tokens(700, seed=11)
prompt = tokens + random_tokens(20, seed=12)
with KVStore({path!r}, model, chunk_tokens=128) as store:
    ram_entries = store.stats()["ram_entries"]
    cache, n = store.fetch(prompt)
    warm = next_logits(model, cache, prompt[n:])
    cold = next_logits(model, compute_cache(model, []), prompt)
    warm_tokens = greedy(model, store.fetch(prompt)[0], prompt[n:], 20)
    cold_tokens = greedy(model, compute_cache(model, []), prompt, 20)
    print(json.dumps({{
        "n": n,
        "allclose": mx.allclose(warm, cold, atol=1e-4, rtol=1e-4).item(),
        "same_tokens": warm_tokens == cold_tokens,
        "ram_entries_at_open": ram_entries,
        "stats": {{k: v for k, v in store.stats().items() if k in ("hits", "corrupt", "errors")}},
    }}))
"""


def run(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.slow
def test_fetch_in_a_fresh_process(tmp_path):
    path = str(tmp_path / "store")
    run(SAVE.format(tests=TESTS, path=path))
    result = json.loads(
        run(FETCH.format(tests=TESTS, path=path)).strip().splitlines()[-1]
    )
    assert result["n"] == 700
    assert result["allclose"] and result["same_tokens"]
    assert (
        result["ram_entries_at_open"] == 6
    )  # pinned: 5 chunks of 128 and a 60-token tail
    assert result["stats"] == {"hits": 2, "corrupt": 0, "errors": 0}
