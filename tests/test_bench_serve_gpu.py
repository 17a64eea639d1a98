"""``tools/bench_serve_gpu.py`` (the multi-round chat load) at a tiny size on the CPU:
plain (the priming round), a fresh kvstore and a restarted one each answer every round
of every chat to its full length; the restarted server restores the chats from the
store; the JSON holds every sample and ``--report`` prints the same tables. The phase
order and the verdicts are checked on their own, without servers. No timing is
checked."""

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import _load_tool

tool = _load_tool("bench_serve_gpu")
bench_gpu = _load_tool("bench_gpu")
probe_restore_decode = _load_tool("probe_restore_decode")

ROUNDS, MAX_TOKENS, SYSTEM = 2, 3, 48


def run_tool(name: str, *args: str) -> dict:
    """``tools/NAME.py ARGS`` in a process of its own (exit status 0 checked); the
    JSON it wrote to the path after ``--json``."""
    tool = os.path.join(os.path.dirname(__file__), "..", "tools", f"{name}.py")
    run = subprocess.run(
        [sys.executable, tool, *args], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = args[list(args).index("--json") + 1]
    with open(out) as f:
        return json.load(f)


@pytest.mark.stress
def test_chat_load_end_to_end(tmp_path):
    out = tmp_path / "serve.json"
    argv = [
        sys.executable,
        tool.__file__,
        "--shape",
        "tiny",
        "--vocab",
        "512",
        "--tokenizer",
        "word",
        "--users",
        "3",
        "--rounds",
        str(ROUNDS),
        "--system-tokens",
        str(SYSTEM),
        "--first-tokens",
        "8",
        "--followup-tokens",
        "4",
        "--max-tokens",
        str(MAX_TOKENS),
        # The restarted phase's code with the page cache left alone (a shared machine);
        # plain runs as the priming round (the plain phases run the same code).
        "--phases",
        "kvstore-fresh",
        "kvstore-dropped",
        "kvstore-rerestart",
        "--drop-caches",
        "skip",
        "--sample-stacks",
        "--dir",
        str(tmp_path / "work"),
        "--json",
        str(out),
    ]
    # An earlier run's log in a phase's folder (the same --dir on the same machine)
    # is not read into this run's sample.
    stale = tmp_path / "work" / "logs" / "r0-u3-kvstore-dropped" / "kvstore.log"
    stale.parent.mkdir(parents=True)
    stale.write_text(
        "2026-01-01 00:00:00,000 - DEBUG - kvstore: prefetch of 99999 tokens (0 in "
        "RAM): waited 0.1 ms (for joins), restored 0-99998 in 1.0 ms\n"
    )
    run = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    data = json.loads(out.read_text())
    phases = {s["phase"]: s for s in data["samples"]}
    prefetched = [p["tokens"] for p in phases["kvstore-dropped"]["prefetches"]]
    assert 99999 not in prefetched
    assert list(phases) == ["kvstore-fresh", "kvstore-dropped", "kvstore-rerestart"]
    assert len(data["priming"]["rounds"]) == 2  # two discarded rounds
    wave = data["priming"]["wave_round"]  # and other users arriving in two waves
    assert wave["users"] >= 2 and wave["errors"] == [], wave
    # Then a discarded kvstore round and one after its restart (restores taken).
    fresh, restart = data["priming_kvstore"]
    assert [len(s["rounds"]) for s in (fresh, restart)] == [1, 1]
    assert restart["store"]["restores_chosen"] > 0, restart
    phases["plain"] = data["priming"]
    for name, s in phases.items():
        assert "error" not in s, s["error"]
        assert len(s["rounds"]) == (2 if name == "plain" else ROUNDS)
        # Special tokens are banned: every request runs to max_tokens, which the
        # last priming round gives one token fewer per user (its requests end apart).
        for i, rnd in enumerate(s["rounds"]):
            stagger = name == "plain" and i == len(s["rounds"]) - 1
            want = [MAX_TOKENS - (u if stagger else 0) for u in range(3)]
            assert [q["user"] for q in rnd["requests"]] == [0, 1, 2]
            assert [q["completion_tokens"] for q in rnd["requests"]] == want
            assert rnd["output_tokens"] == sum(want)
    # Later rounds send the whole history: each prompt is longer than the last.
    for s in (phases["kvstore-fresh"], phases["kvstore-dropped"]):
        for u in range(3):
            lengths = [r["requests"][u]["prompt_tokens"] for r in s["rounds"]]
            assert lengths[0] > SYSTEM and lengths[1] > lengths[0] + MAX_TOKENS
    # The same chats in every phase (greedy, same weights).
    prompts = {
        name: [q["prompt_tokens"] for r in s["rounds"] for q in r["requests"]]
        for name, s in phases.items()
    }
    assert prompts["kvstore-fresh"] == prompts["kvstore-dropped"]
    assert prompts["kvstore-rerestart"] == prompts["kvstore-fresh"]
    assert prompts["plain"] == prompts["kvstore-fresh"][:6]
    # Restarted: every round-1 prompt comes back from the store (all but its last
    # token), where plain computed it.
    # Unless the server weighed prefilling one cheaper (the Backlog, restore="auto":
    # on a tiny model both take milliseconds, and a busy machine can tip them).
    dropped = phases["kvstore-dropped"]
    first = dropped["rounds"][0]["requests"]
    missed = sum(q["cached_tokens"] < q["prompt_tokens"] - 2 for q in first)
    weighed = dropped["kvstore"]["prefilled_instead"]
    weighed += dropped["store"]["recomputes_chosen"]
    assert missed <= weighed and missed < len(first), (
        [(q["cached_tokens"], q["prompt_tokens"]) for q in first],
        dropped["kvstore"],
        dropped["store"],
    )
    assert phases["kvstore-dropped"]["kvstore"]["disk_hits"] >= 3
    assert phases["kvstore-dropped"]["log_lines"].get("disk", 0) >= 3
    assert phases["kvstore-fresh"]["store"]["nodes_written"] > 0
    assert phases["kvstore-dropped"]["page_cache_dropped"] is False
    # --sample-stacks: each round lists the loop's steps up to its last first token.
    for s in (phases["kvstore-fresh"], phases["kvstore-dropped"], phases["plain"]):
        for rnd in s["rounds"]:
            assert any(step[2] > 0 for step in rnd["steps"]), (s["phase"], rnd["steps"])
    table = "\n".join(data["table"])
    assert "steps to the first token" in table and "| kvstore-fresh | 0 |" in table
    assert "| kvstore-dropped |" in table and "fresh saves lost = 0" in table
    assert "page cache not dropped" in table
    again = subprocess.run(
        [sys.executable, tool.__file__, "--report", str(out)],
        capture_output=True,
        text=True,
    )
    assert again.stdout.strip() == "\n".join(data["table"]).strip()


def test_phase_order_alternates_and_fresh_comes_first():
    steps = tool.plan([1, 8], 2, list(tool.PHASES))
    assert len(steps) == 2 * 2 * len(tool.PHASES)
    assert [u for r, u, _ in steps if r == 0][0] == 1
    assert [u for r, u, _ in steps if r == 1][0] == 8  # users reversed too
    for rep in (0, 1):
        for users in (1, 8):
            order = [p for r, u, p in steps if (r, u) == (rep, users)]
            assert sorted(order) == sorted(tool.PHASES)
            fresh = order.index("kvstore-fresh")
            assert fresh < order.index("kvstore-restart")
            assert fresh < order.index("kvstore-dropped")
            # Last of the store's phases: the restarts before it kept their rates.
            assert order[-1] == "kvstore-rerestart"
    first = [[p for r, u, p in steps if (r, u) == (rep, 1)] for rep in (0, 1)]
    assert first[0][0] == "plain" and first[1][0] == "kvstore-fresh"
    # A subset keeps the order.
    assert tool.plan([2], 1, ["kvstore-dropped", "plain"]) == [
        (0, 2, "plain"),
        (0, 2, "kvstore-dropped"),
    ]


def _sample(phase, ttfts, decode, tok_s, *, server=None, **store):
    rounds = [
        {
            "wall_s": 1.0,
            "output_tokens": tok_s,
            "requests": [
                {"ttft_s": t, "decode_tok_s": decode, "completion_tokens": tok_s}
            ],
        }
        for t in ttfts
    ]
    return {
        "phase": phase,
        "users": 4,
        "repeat": 0,
        "rounds": rounds,
        "store": store or None,
        "kvstore": server,
    }


def test_verdicts_are_ratios_of_medians():
    data = {
        "samples": [
            _sample("plain", [4.0, 2.0], 30.0, 100),
            _sample("plain-restart", [4.0, 2.0], 30.0, 100),
            _sample(
                "kvstore-fresh",
                [4.1, 2.2],
                29.0,
                98,
                server={"saves_lost": 3},
                writes_dropped=5,  # refused by the writer, then saved: not lost
                restores_chosen=0,
                bytes_written=2e9,
            ),
            _sample("kvstore-restart", [1.6, 1.8], 30.0, 99, restores_chosen=8),
            _sample("kvstore-rerestart", [3.0, 1.8], 30.0, 99, restores_chosen=5),
        ]
    }
    lines = tool.report(data)
    text = "\n".join(lines)
    assert "4 users, fresh aggregate >= 0.97x: 0.98x (PASS)" in text
    assert "4 users, fresh TTFT round 2 <= 1.05x: 1.10x (MISS)" in text
    assert "4 users, fresh decode round 1 >= 0.95x: 0.97x (PASS)" in text
    assert "4 users, fresh saves lost = 0: 3 (MISS)" in text
    assert "4 users, restart TTFT round 1 <= 0.5x: 0.40x (PASS)" in text
    assert "4 users, restart TTFT round 2 <= 1.0x: 0.90x (PASS)" in text
    assert (
        "4 users, restart again (rates kept) TTFT round 1 <= 0.5x: 0.75x (MISS)" in text
    )
    assert "| kvstore-rerestart | 3.00 (0.75x) |" in text
    assert "| kvstore-fresh | 4.10 (1.02x) | 2.20 (1.10x) |" in text
    assert "0 / 3 / 2.00 |" in text  # restores / saves lost / GB written
    assert "page cache dropped" not in text  # no such phase ran


def test_prefetch_lines_of_the_log_are_read(tmp_path):
    """The DEBUG line kvstore serve logs for each prefetch (its format, as the
    prompt cache writes it) read back; other lines skipped."""
    import logging

    from kvstore.serve import prompt_cache

    log_path = tmp_path / "kvstore.log"
    handler = logging.FileHandler(log_path)
    handler.setFormatter(logging.Formatter("%(asctime)s - %(levelname)s - %(message)s"))
    logger = prompt_cache.log
    logger.addHandler(handler)
    # setLevel, not the attribute: it also clears the logger's cache of enabled
    # levels, which an earlier test's debug call (at INFO) may have filled.
    level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        fmt = prompt_cache.PREFETCH_LOG
        logger.debug(fmt, 2514, 3, 0.1, "for joins", "0-2513", 228.6)
        logger.info("kvstore: prompt 2514 tokens: reused 2513 (disk), computing 1")
        logger.debug(fmt, 2789, 2578, 0.5, "for a shared prefix", "nothing", 5.6)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        handler.close()
    got = tool.kvstore_prefetches(str(log_path))
    assert [
        (p["tokens"], p["held"], p["joined"], p["restored"], p["ms"]) for p in got
    ] == [
        (2514, 3, False, [0, 2513], 228.6),
        (2789, 2578, True, None, 5.6),
    ]
    assert abs(got[0]["t"] - time.time()) < 60 and got[1]["waited_ms"] == 0.5
    assert tool.kvstore_prefetches(str(tmp_path / "missing.log")) == []


def test_bench_gpu_order_is_a_latin_square():
    for n in (2, 5, 6, 7):
        cases = [f"c{i}" for i in range(n)]
        for start in (0, 3):  # a later length starts further on
            rows = [bench_gpu.case_order(cases, start + r) for r in range(n)]
            assert all(sorted(row) == cases for row in rows)
            for position in range(n):
                assert sorted(row[position] for row in rows) == cases
    # Repeat 0 opens each length with another case.
    cases = ["cold", "kvstore", "load_prompt_cache"]
    assert [bench_gpu.case_order(cases, li)[0] for li in range(3)] == cases


def test_a_stream_that_ends_early_is_a_failure_not_a_sample():
    """mlx-lm's generation thread dying mid-stream (out of GPU memory, say) ends the
    streams without their usage: the round says so instead of counting them."""
    import http.server
    import threading

    class Dying(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            delta = {"choices": [{"delta": {"content": "w9"}}]}
            self.wfile.write(b"data: " + json.dumps(delta).encode() + b"\n\n")
            self.wfile.flush()  # then the connection closes: no usage, no [DONE]

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Dying)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        results, wall, errors = tool.run_round(server.server_address[1], [{}, {}])
    finally:
        server.shutdown()
    assert [r["tokens"] for r in results] == [1, 1]
    assert len(errors) == 1 and errors[0].startswith("users [0, 1]: the stream ended")


def test_bench_tail_runs_every_case_on_the_cpu(tmp_path):
    """``tools/bench_tail.py`` (a tail past a RAM copy: restore or prefill) at the
    tiny shape: every case timed every repeat, the restore reading only the nodes
    past the RAM copy."""
    result = run_tool(
        "bench_tail",
        *("--shape", "tiny", "--head", "300", "--tail", "40", "--repeats", "2"),
        *("--chunk-tokens", "64", "--json", str(tmp_path / "tail.json")),
    )
    assert {k: len(v) for k, v in result["samples"].items()} == {
        "plain": 2,
        "kvstore": 2,
        "batch8": 2,
    }
    # The node holding token 300 (256-319) and the next one up to 340: 84 tokens.
    assert result["medians"]["kvstore"]["restored_tokens"] == 340 - 256
    assert all(s["total"] > 0 for rows in result["samples"].values() for s in rows)


@pytest.mark.stress
def test_probe_restore_decode_runs_every_case_on_the_cpu(tmp_path):
    """``tools/probe_restore_decode.py`` at the tiny shape: every case in its own
    process every repeat, the restores taking the whole stored prompt, the cache's
    rows recorded after each part (``--more`` decodes past the room), the saved
    cases' saves holding every token, and each user turn timed."""
    samples = run_tool(
        "probe_restore_decode",
        *("--shape", "tiny", "--lengths", "300", "--repeats", "2", "--more", "40"),
        *("--turns", "2", "--turn-tokens", "20"),
        *("--dir", str(tmp_path / "work"), "--json", str(tmp_path / "decode.json")),
    )["samples"]["300"]
    assert {c: len(rows) for c, rows in samples.items()} == {
        c: 2 for c in probe_restore_decode.CASES
    }
    assert [s["restored"] for s in samples["restore"]] == [299, 299]
    assert [s["rows_before"] for s in samples["restore-room0"]] == [299, 299]
    assert all(
        s[part]["tok_s"] > 0 for s in samples["cold"] for part in ("a", "b", "c")
    )
    # 299 + 1 + 64 + 32 + 40 tokens: past the first cache step, whatever the start.
    assert all(s["rows_c"] >= 436 for rows in samples.values() for s in rows)
    assert all(s["saved"] >= 436 for s in samples["cold-saved"])
    assert all(
        len(s["turns"]) == 2 and min(s["turns"]) > 0
        for rows in samples.values()
        for s in rows
    )


def test_sample_stacks_records_a_launched_server_and_lets_sigterm_end_it(tmp_path):
    """``--sample-stacks``: the launcher samples every busy thread's stack into
    BENCH_STACKS and times each BatchGenerator step; SIGTERM (how the benchmark
    stops a server) flushes the file and still ends the process at once."""
    import signal
    import time

    sys.path.insert(0, os.path.dirname(tool.__file__))
    import stack_sampler

    out = tmp_path / "stacks.jsonl"
    env = dict(os.environ, BENCH_STACKS=str(out))
    body = "import time\nwhile True: sum(range(10000)); time.sleep(0.001)"
    proc = subprocess.Popen(
        [sys.executable, tool.__file__, "--launch", "timeit", "-n", "1", body],
        env=env,
    )
    deadline = time.monotonic() + 120  # mlx-lm's import first, then the body
    while "<timeit-src>" not in (out.read_text() if out.exists() else ""):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.2)
    tic = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) != 0  # ended by the signal, not by a timeout
    assert time.monotonic() - tic < 10
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    main = [s for s in lines if s.get("thread") == "MainThread" and "stack" in s]
    assert any("<timeit-src>:inner" in s["stack"][0] for s in main)
    stack_sampler.main([str(out), "--thread", "Main", "--top", "3"])


@pytest.mark.stress
def test_probe_round_step_runs_every_case_on_the_cpu(tmp_path):
    """``tools/probe_round_step.py`` at the tiny shape: every case in its own process,
    round 1's prompts restored whole (but their last token) where asked."""
    probe = _load_tool("probe_round_step")
    CASES, PLAIN_VARIANTS = probe.CASES, probe.PLAIN_VARIANTS
    samples = run_tool(
        "probe_round_step",
        *("--shape", "tiny", "--users", "3", "--system", "40", "--question", "8"),
        *("--new", "5", "--decode", "3", "--repeats", "1", "--gap", "0"),
        *("--cases", *CASES, *PLAIN_VARIANTS),
        *("--dir", str(tmp_path / "work"), "--json", str(tmp_path / "step.json")),
    )["samples"]
    assert set(samples) == set(CASES) | set(PLAIN_VARIANTS)
    assert all(len(rows) == 1 for rows in samples.values())
    for case in ("restored", "restored-clear"):
        assert samples[case][0]["restored"] == [47, 47, 47]
    for rows in samples.values():
        steps = rows[0]["round2"]["steps"]
        assert steps[0]["prompts"] == 3 and rows[0]["round2"]["ttft"] > 0


@pytest.mark.stress
def test_probe_concurrent_restores_runs_every_case_on_the_cpu(tmp_path):
    """``tools/probe_concurrent_restores.py`` at the tiny shape: every case in its
    own process every repeat, each restore taking its whole stored prompt."""
    samples = run_tool(
        "probe_concurrent_restores",
        *("--shape", "tiny", "--prompts", "4", "--length", "300", "--system", "200"),
        *("--threads", "1", "2", "--read-threads", "2", "--repeats", "2"),
        *("--dir", str(tmp_path / "work"), "--json", str(tmp_path / "pcr.json")),
    )["samples"]
    cases = {}
    for s in samples:
        cases.setdefault((s["case"], s["threads"]), []).append(s)
    assert {k: len(v) for k, v in cases.items()} == {
        ("floor", 1): 2,
        ("floor", 2): 2,
        ("restore", 1): 2,
        ("restore", 2): 2,
        ("serial", 2): 2,
        ("per-tensor", 1): 2,
        ("per-tensor", 2): 2,
    }
    for s in samples:
        assert s["bytes"] > 0 and s["wall_s"] > 0
        if s["case"] != "floor":
            assert s["tokens"] == 4 * 300 and len(s["each_s"]) == 4


@pytest.mark.stress
def test_bench_gpu_runs_its_restore_cases_on_the_cpu(tmp_path):
    """``tools/bench_gpu.py`` at the tiny shape: every case restores the stored prompt
    and agrees on the first token; a case's ``open_s`` times the open, not the first
    import of kvstore's modules (imported lazily, compiled from source where no
    bytecode is written)."""
    data = run_tool(
        "bench_gpu",
        *("--shape", "tiny", "--lengths", "300", "--repeats", "1"),
        *("--cases", "cold", "kvstore", "kvstore-room0", "load_prompt_cache"),
        *("--dir", str(tmp_path / "work"), "--json", str(tmp_path / "gpu.json")),
    )
    cases = {s["case"]: s for s in data["samples"]}
    assert set(cases) == {"cold", "kvstore", "kvstore-room0", "load_prompt_cache"}
    assert len({s["first_token"] for s in cases.values()}) == 1
    for name in ("kvstore", "kvstore-room0"):
        assert cases[name]["restored"] == 299 and cases[name]["corrupt"] == 0
        assert cases[name]["store_module_imported"] is True
