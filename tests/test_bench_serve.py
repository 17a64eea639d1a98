"""``tools/bench_serve.py`` end to end at a tiny size: both servers answer the same
request stream, every request streams its tokens, the restarted kvstore server
restores the system prompt, and the table names both targets. No timing is checked."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.stress

TOOL = os.path.join(os.path.dirname(__file__), "..", "tools", "bench_serve.py")


@pytest.mark.slow
def test_bench_serve_small_run(tmp_path):
    out = tmp_path / "load.json"
    argv = [
        sys.executable,
        TOOL,
        "--layers",
        "1",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--intermediate",
        "64",
        "--vocab",
        "512",
        "--system-tokens",
        "64",
        "--user-tokens",
        "4",
        "--max-tokens",
        "3",
        "--concurrency",
        "1",
        "2",
        "--requests-per-level",
        "2",
        "--rounds",
        "1",
        "--restarts",
        "1",
        "--json",
        str(out),
    ]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())

    for name in ("plain", "kvstore"):
        for c in ("1", "2"):
            (level,) = result["levels"][name][c]
            assert level["requests"] == 2
            # Every request streamed all its tokens (end of sequence is banned).
            assert level["tokens"] == 2 * 3
            assert len(level["ttft"]) == 2
    # Warm: kvstore reuses at least the system prompt, from RAM or the store.
    cached = [
        n for c in ("1", "2") for n in result["levels"]["kvstore"][c][0]["cached"]
    ]
    assert all(n >= 60 for n in cached), cached
    # After a restart: plain computes everything, kvstore restores the system prompt.
    (plain,) = result["restart"]["plain"]
    (kv,) = result["restart"]["kvstore"]
    assert plain["cached"] == 0
    assert kv["cached"] >= 60 and kv["prompt"] == plain["prompt"]
    assert kv["tokens"] == plain["tokens"] == 3
    table = "\n".join(result["table"])
    assert "throughput at 1 clients" in table and "throughput at 2 clients" in table
    assert "first TTFT after a restart" in table
    assert result["kvstore_stats"]["saves"] > 0
