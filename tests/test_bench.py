"""``kvstore bench`` end to end on a tiny random model. Nothing here checks a timing."""

import json
import statistics
import subprocess
import sys

import pytest
from conftest import compute_cache, random_tokens

from kvstore.bench import main, parse_args
from kvstore.bench.measure import (
    FetchProbe,
    can_drop_page_cache,
    mlx_default_cache_limit,
    resident_fraction,
    set_page_cache,
    timed_fetch,
)

pytestmark = pytest.mark.stress


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def bench_run(tiny_model_dir, tmp_path_factory):
    """One small run of every section; returns (json result, png path or None)."""
    out = tmp_path_factory.mktemp("bench")
    png = out / "bench.png" if _has_matplotlib() else None
    argv = [
        "--model",
        tiny_model_dir,
        "--quick",
        "--lengths",
        "40",
        "--restore-lengths",
        "100",
        "--scale-counts",
        "3",
        "12",
        "--write-tokens",
        "8",
        "--repeats",
        "1",
        "--chunk-tokens",
        "16",
        "--fresh-lengths",
        "100",
        "--repeat-lengths",
        "100",
        "--restore-repeats",
        "1",
        "--durable-tokens",
        "64",
        "--dir",
        str(out),
        "--json",
        str(out / "bench.json"),
    ]
    if png is not None:
        argv += ["--plot", str(png)]
    assert main(argv) == 0
    with open(out / "bench.json") as f:
        return json.load(f), png, out


def test_every_case_in_json(bench_run):
    res, _, out = bench_run
    conds = res["page_cache_conditions"]
    assert conds[0] == "warm"
    (row,) = res["ttft"]
    assert row["tokens"] == 40 and row["cold_s"] > 0
    expected = {"ram_hot"} | {
        f"{case}_{c}" for case in ("disk", "nearest", "restart") for c in conds
    }
    assert set(row["cases"]) == expected
    for case in row["cases"].values():
        assert len(case["ttft_s"]) == 1
        assert case["reused"] in (39, 40 - 20)  # exact prefix, or the nearest one
        assert None not in case["lookup_s"] + case["read_s"] + case["assemble_s"]
    assert row["cases"]["ram_hot"]["in_ram"]
    assert row["cases"]["restart_warm"]["open_s"]

    (rr,) = res["restore"]
    expected = {"ram_hot"} | {
        f"{case}_{c}"
        for case in ("disk", "load_prompt_cache", "raw", "restart")
        for c in conds
    }
    assert set(rr["cases"]) == expected
    assert rr["cases"]["disk_warm"]["reused"] == 100
    assert rr["disk"]["ratio"] > 1

    w = res["write"]
    assert len(w["plain_s"]) == len(w["saving_s"]) == 1
    assert w["nodes_written"] >= 1 and w["writes_failed"] == 0

    assert [s["chunks"] for s in res["scale"]] == [3, 12]

    # After a restart: every case in its own child process, with its measurements.
    (fresh,) = res["fresh"]
    assert (fresh["dtype"], fresh["tokens"]) == ("float16", 100)
    # The largest length also runs kvstore without prefaulting.
    assert set(fresh["cases"]) == {
        "kvstore",
        "kvstore_no_prefault",
        "load_prompt_cache",
        "floor",
    }
    for case in fresh["cases"].values():
        (sample,) = case["samples"]
        assert sample["wall_s"] > 0 and sample["faults"] >= 0
    assert fresh["cases"]["kvstore"]["samples"][0]["forward_s"] > 0
    (rep,) = res["repeat"]
    assert set(rep["cases"]) == {"kvstore", "load_prompt_cache", "floor"}
    assert all(len(c["restore_s"]) == 1 for c in rep["cases"].values())
    assert set(res["open"]["cases"]) == {"known", "new"}
    assert res["open"]["split_ms"]["total"] > 0
    d = res["durable"]
    assert len(d["kvstore_s"]) == len(d["one_file_s"]) == 1 and d["files"] == 4
    assert len(d["per_node_files_s"]) == len(d["save_returned_s"]) == 1
    assert rr["first_s"] > 0 and rr["first_faults"] >= 0
    assert rr["restored_equal"] is True

    # Freed memory recycled: the repeat cases again, MLX's buffer cache raised above
    # the KV during the section and put back after it.
    (rec,) = res["recycled"]
    assert (rec["dtype"], rec["tokens"], rec["memory"]) == ("float16", 100, "recycled")
    assert rec["mlx_cache_limit"] > rec["kv_bytes"]
    assert rep["memory"] == "freed" and rep["mlx_cache_limit"] is None
    assert set(rec["cases"]) == {"kvstore", "load_prompt_cache", "floor"}
    for r in (rep, rec):  # the copy alone, split like a fetch's reads
        assert (
            r["cases"]["floor"]["label"] == "floor: readinto reused buffers, 2 threads"
        )
    fresh_floor = res["fresh"][0]["cases"]["floor"]["label"]
    assert fresh_floor == "floor: readinto fresh buffers, 2 threads"
    assert all(len(c["restore_s"]) == 1 for c in rec["cases"].values())
    assert mlx_default_cache_limit() == res["environment"]["mlx_cache_limit"]

    m = res["miss"]
    assert m["tokens"] == 32768 and len(m["fetch_s"]) == m["calls"] == 200
    assert len(m["as_token_array_s"]) == len(m["make_prompt_cache_s"]) == 200
    h = res["hash"]
    assert (h["tokens"], h["spans"], len(h["total_s"])) == (100000, 6250, 100)
    assert h["total_s"][0] == h["as_token_array_s"][0] + h["chain_hashes_s"][0]
    s = res["save"]
    assert s["nodes_per_save"] == [64]  # 1024 tokens in chunks of 16: a new prompt
    assert len(s["save_return_s"]) == len(s["flush_s"]) == 1

    whats = " ".join(t["what"] for t in res["targets"])
    for part in (
        "TTFT disk-hot, same process",
        "TTFT disk-hot after restart",
        "RAM-hot assemble",
        "load_prompt_cache",
        "raw read",
        "open time",
        "fetch-hit lookup",
        "fetch-miss",
        "prefill tokens/s with saving",
        "bytes on disk",
        "after a restart, kvstore speed / load_prompt_cache",
        "after a restart, kvstore speed / floor",
        "repeated restores, kvstore speed / load_prompt_cache",
        "open a store, model seen before",
        "save until durable",
        "memory recycled, kvstore speed / load_prompt_cache",
        "fetch that finds nothing, 32768 tokens",
        "hash chain, 100000 tokens",
        "save() return / (return + flush), 1024 tokens",
    ):
        assert part in whats
    assert all(t["ok"] in (True, False, None) for t in res["targets"])
    # The temporary stores are gone; only the outputs stay.
    assert not [p for p in out.iterdir() if p.name.startswith("kvstore-bench-")]


def test_markdown_tables_of_a_saved_run(bench_run, capsys):
    res, _, out = bench_run
    assert main(["--from-json", str(out / "bench.json"), "--markdown"]) == 0
    text = capsys.readouterr().out
    fresh = res["fresh"][0]["cases"]
    kv_ms = f"{statistics.median(s['wall_s'] for s in fresh['kvstore']['samples']) * 1e3:.1f}"
    row = next(
        line for line in text.splitlines() if line.startswith("| float16 | 100 |")
    )
    assert kv_ms in row and row.endswith(("PASS |", "MISS |", "MISS, floor |"))
    assert "| model seen before |" in text and "kvstore / one file:" in text
    assert "Repeated restores, freed memory recycled" in text
    with pytest.raises(SystemExit):
        parse_args(["--markdown"])


def test_plot_is_a_png(bench_run):
    _, png, _ = bench_run
    if png is None:
        pytest.skip("matplotlib is not installed")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_so(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit):
        parse_args(["--plot", "x.png"])
    assert "pip install 'kvstore[plot]'" in capsys.readouterr().err


def test_quick_defaults_and_explicit_options():
    args = parse_args(["--quick", "--repeats", "5", "--lengths", "64", "32", "64"])
    assert args.repeats == 5 and args.lengths == [32, 64]
    assert args.restore_lengths == [1024, 8192]
    with pytest.raises(SystemExit):
        parse_args(["--lengths", "1"])


def test_cli_dispatches_bench():
    proc = subprocess.run(
        [sys.executable, "-m", "kvstore", "bench", "--help"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0
    assert "--restore-lengths" in proc.stdout


def test_page_cache_helpers(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * (1 << 20))
    assert set_page_cache([str(path)], "warm") in (1.0, None)
    if can_drop_page_cache(str(tmp_path)):
        assert set_page_cache([str(path)], "dropped") < 0.5
    assert resident_fraction([]) in (1.0, None)


def test_probe_restores_what_it_wraps(model, tmp_path):
    from kvstore import KVStore
    from kvstore.engine import assemble

    toks = random_tokens(40, seed=3)
    init = assemble.AssemblyPlan.__dict__["__init__"]
    with KVStore(str(tmp_path / "s"), model, chunk_tokens=16) as store:
        store.save(toks, compute_cache(model, toks))
        store.flush()
        phases, cache = timed_fetch(store, toks, expect=39)
        assert phases.lookup is not None and phases.assemble is not None
        assert "read" not in store.index.__dict__
        assert assemble.AssemblyPlan.__dict__["__init__"] is init
        assert cache[0].offset == 39
        with FetchProbe(store) as probe:
            store.fetch(toks)
        assert probe.times["index.read"]


def _tool(name: str, *args: str) -> subprocess.CompletedProcess:
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run(
        [sys.executable, os.path.join(root, "tools", name), *args],
        capture_output=True,
        text=True,
        check=True,
    )


def test_tools_wrap_the_bench_sections(tiny_model_dir, tmp_path):
    """tools/bench_save.py and tools/bench_open.py run kvstore.bench's measuring code
    (one place for it) and print the same sections and targets as ``kvstore bench``."""
    out = _tool(
        "bench_save.py",
        *("--tokens", "64", "--repeats", "1", "--chunk-tokens", "16"),
        *("--per-node-files", "--dir", str(tmp_path), "--json", str(tmp_path / "s")),
    )
    assert "Saving until durable, 64 tokens of float16" in out.stdout
    assert "save until durable GB/s / one file" in out.stdout
    with open(tmp_path / "s") as f:
        d = json.load(f)["durable"]
    assert d["files"] == 4 and len(d["per_node_files_s"]) == 1
    out = _tool(
        "bench_open.py",
        *("--model", tiny_model_dir, "--repeats", "1", "--json", str(tmp_path / "o")),
    )
    assert "open a store, model seen before" in out.stdout
    with open(tmp_path / "o") as f:
        o = json.load(f)["open"]
    assert {k: len(c["samples"]) for k, c in o["cases"].items()} == {
        "known": 1,
        "new": 1,
    }


def test_call_targets_pass_and_miss():
    """The miss, hash and save targets turn on the medians of every sample."""
    from kvstore.bench.report import call_targets

    def oks(miss, hash_, ret, flush):
        res = {
            "miss": {"tokens": 10, "fetch_s": miss},
            "hash": {"tokens": 10, "total_s": hash_},
            "save": {"tokens": 10, "save_return_s": ret, "flush_s": flush},
        }
        return [t["ok"] for t in call_targets(res)]

    assert oks([0.001, 0.009, 0.0015], [0.004], [0.01], [0.99]) == [True] * 3
    assert oks([0.003, 0.001, 0.0025], [0.006], [0.06], [0.94]) == [False] * 3
    assert call_targets({}) == []


def test_restore_targets_say_when_the_floor_misses_too():
    """A speed target against load_prompt_cache is "MISS, floor" when the floor of
    the same run (the same bytes, plain reads) is itself below the target."""
    from kvstore.bench.report import markdown, restart_targets

    def row(kv, lpc, floor):
        cases = {
            name: {"label": f"{name} label", "samples": [{"wall_s": t}]}
            for name, t in (("kvstore", kv), ("load_prompt_cache", lpc))
        }
        cases["floor"] = {
            "label": "floor: readinto fresh buffers, 2 threads",
            "samples": [{"wall_s": floor}],
        }
        return {"dtype": "float16", "tokens": 8, "kv_bytes": 1 << 20, "cases": cases}

    res = {
        "fresh": [
            row(kv=0.9, lpc=1.0, floor=0.8),  # faster than lpc
            row(kv=1.1, lpc=1.0, floor=0.9),  # slower; the floor is not
            row(kv=1.1, lpc=1.0, floor=1.05),  # slower; so is the floor
        ]
    }
    got = [
        (t["ok"], t.get("floor_bound", False))
        for t in restart_targets(res)
        if t["ok"] is not None
    ]
    assert got == [(True, False), (False, False), (False, True)]
    rows = [line for line in markdown(res).splitlines() if line.startswith("| float16")]
    assert [r.rsplit("|", 2)[1].strip() for r in rows] == [
        "PASS",
        "MISS",
        "MISS, floor",
    ]
    assert "fresh buffers, 2 threads" in markdown(res)


def test_floor_reads_every_byte_on_threads(tmp_path):
    """The floor's reads, on this thread or split between a pool's threads, hold
    every file's bytes in order."""
    from concurrent.futures import ThreadPoolExecutor

    from kvstore.bench.cases import FLOOR_THREADS, read_floor, read_into

    paths = []
    for i in range(5):
        p = tmp_path / f"f{i}"
        p.write_bytes(bytes([i]) * (1000 + i))
        paths.append(str(p))
    want = [open(p, "rb").read() for p in paths]
    with ThreadPoolExecutor(FLOOR_THREADS) as pool:
        for fresh in (False, True):
            for use in (None, pool):
                got = read_floor(paths, fresh_pages=fresh, pool=use)
                assert [bytes(b) for b in got] == want
        bufs = read_floor(paths)
        for b in bufs:
            b[:] = 255
        read_into(paths, bufs, pool=pool)
        assert [bytes(b) for b in bufs] == want


def test_fresh_restores_are_judged_like_for_like_with_the_room_trade_beside():
    """After a restart, the restore without room is held against load_prompt_cache's
    exactly full caches; the default room's cost and saving are reported beside it."""
    from kvstore.bench.report import markdown, restart_targets

    def case(label, wall, forward=None):
        sample = {"wall_s": wall}
        if forward is not None:
            sample["forward_s"] = forward
        return {"label": label, "samples": [sample]}

    cases = {
        "kvstore": case("kvstore fetch (restore_room=2048)", 0.030, forward=0.080),
        "load_prompt_cache": case("lpc", 0.025, forward=0.120),
        "floor": case("floor: readinto fresh buffers, 2 threads", 0.015),
        "kvstore_room0": case("kvstore fetch (restore_room=0)", 0.020, forward=0.125),
    }
    res = {
        "fresh": [
            {"dtype": "float16", "tokens": 8, "kv_bytes": 1 << 20, "cases": cases}
        ]
    }
    judged, *info = [t for t in restart_targets(res)]
    assert "restore_room=0" in judged["what"] and judged["ok"] is True
    assert judged["value"] == "1.25 (20.0 / 25.0 ms; the floor 1.67)"
    trade = info[-1]
    assert trade["ok"] is None and trade["value"].startswith("0.83; the room costs")
    assert "+10.0 ms" in trade["value"] and "saves the first forward pass 45.0 ms" in (
        trade["value"]
    )
    (row,) = [r for r in markdown(res).splitlines() if r.startswith("| float16")]
    assert row.startswith("| float16 | 8 | 1.0 | 20.0 | 25.0 | 15.0 | 1.25 |")
    assert row.endswith("| PASS | 30.0, 0.83 | +10.0 / -45.0 |")
