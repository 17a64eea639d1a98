"""The ``kvstore`` command line, run as a subprocess on temporary stores."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import random_tokens

pytestmark = pytest.mark.slow


def kvstore(*args, env=None, timeout=300):
    """Run ``python -m kvstore ARGS``; return the CompletedProcess."""
    return subprocess.run(
        [sys.executable, "-m", "kvstore", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(row if isinstance(row, str) else json.dumps(row))
            f.write("\n")
    return path


def words(tokens):
    return " ".join(f"w{t}" for t in tokens)


GOOD = [
    {"id": "t", "tokens": random_tokens(150, 1)},
    {"prompt": words(t for t in random_tokens(90, 2) if t >= 3)},
    {
        "messages": [
            {
                "role": "system",
                "content": words(t for t in random_tokens(80, 3) if t >= 3),
            },
            {"role": "user", "content": "w10 w11 w12"},
        ],
        "pin": True,
    },
]


def prefill(model_dir, prompts, store, *extra):
    """``kvstore prefill`` with the tiny model and 64-token chunks."""
    return kvstore(
        "prefill",
        prompts,
        "--model",
        model_dir,
        "--store",
        store,
        "--chunk-tokens",
        64,
        *extra,
    )


def summary(proc):
    return json.loads(proc.stdout.strip().splitlines()[-1])


def stored_prefix(model_dir, store, tokens):
    """How many tokens of ``tokens`` a fresh KVStore restores (in this process)."""
    from mlx_lm import load

    from kvstore import KVStore

    model, tokenizer = load(model_dir)
    with KVStore(store, model, tokenizer, chunk_tokens=64) as s:
        return s.fetch(tokens)[1]


def test_mixed_file_reports_each_bad_line_and_stores_the_good(tmp_path, tiny_model_dir):
    rows = [
        GOOD[0],
        "",  # blank: skipped silently
        "{not json",
        {"tokens": [1, "x"]},
        GOOD[1],
        {"promt": "typo"},
        {"prompt": ""},
        {"tokens": [1, 2], "kind": "robot"},
        {"tokens": [3] * 5000},  # longer than the model's 4096 context
        GOOD[2],
    ]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    store = tmp_path / "store"
    proc = prefill(tiny_model_dir, prompts, store, "--json")
    assert proc.returncode == 1, proc.stderr
    errors = [
        line for line in proc.stderr.splitlines() if line.startswith(str(prompts))
    ]
    assert [int(e.split(":")[1]) for e in errors] == [3, 4, 6, 7, 8, 9]
    assert "invalid JSON" in errors[0] and "tokens[1]" in errors[1]
    assert "unknown" in errors[2] or "exactly one" in errors[2]
    assert "empty" in errors[3] and "kind" in errors[4] and "4096" in errors[5]
    s = summary(proc)
    assert s["prompts"] == 9 and s["prefilled"] == 3 and s["failed"] == 6
    assert stored_prefix(tiny_model_dir, store, GOOD[0]["tokens"] + [5]) == 150

    # --strict stops at the first bad line.
    proc = prefill(tiny_model_dir, prompts, tmp_path / "s2", "--json", "--strict")
    assert proc.returncode == 1 and summary(proc)["failed"] == 1


def test_second_run_computes_nothing(tmp_path, tiny_model_dir):
    prompts = write_jsonl(tmp_path / "p.jsonl", GOOD)
    args = (tiny_model_dir, prompts, tmp_path / "store", "--json")
    first = prefill(*args)
    assert first.returncode == 0, first.stderr
    assert summary(first)["tokens_computed"] > 0
    second = summary(prefill(*args))
    assert (
        second["tokens_computed"] == 0
        and second["skipped"] == 3
        and second["prefilled"] == 0
    )
    assert second["bytes_written"] == 0


def test_clear_errors_for_missing_file_bad_model_and_foreign_store(
    tmp_path, tiny_model_dir
):
    prompts = write_jsonl(tmp_path / "p.jsonl", GOOD[:1])
    store = tmp_path / "store"
    proc = kvstore(
        "prefill", tmp_path / "nope.jsonl", "--model", tiny_model_dir, "--store", store
    )
    assert proc.returncode == 2 and "no such file" in proc.stderr
    proc = kvstore(
        "prefill", prompts, "--model", tmp_path / "no-model", "--store", store
    )
    assert proc.returncode == 2 and "cannot load model" in proc.stderr
    assert not store.exists()  # nothing written
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "cat.jpg").write_bytes(b"meow")
    proc = kvstore(
        "prefill", prompts, "--model", tiny_model_dir, "--store", tmp_path / "photos"
    )
    assert proc.returncode == 2 and "not a kvstore" in proc.stderr
    assert os.listdir(tmp_path / "photos") == ["cat.jpg"]


def test_store_of_another_format_version_is_refused(tmp_path, tiny_model_dir):
    import lmdb

    prompts = write_jsonl(tmp_path / "p.jsonl", GOOD[:1])
    store = tmp_path / "store"
    assert prefill(tiny_model_dir, prompts, store).returncode == 0
    env = lmdb.open(str(store / "index"), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.put(b"format_version", b"999", db=env.open_db(b"meta", txn=txn))
    env.close()
    proc = prefill(tiny_model_dir, prompts, store)
    assert proc.returncode == 2 and "format version 999" in proc.stderr


@pytest.mark.stress
def test_killed_mid_file_then_rerun_completes(tmp_path, tiny_model_dir):
    rows = [{"tokens": random_tokens(200, 1000 + i)} for i in range(300)]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    store = tmp_path / "store"
    args = [
        "prefill",
        prompts,
        "--model",
        tiny_model_dir,
        "--store",
        store,
        "--chunk-tokens",
        64,
        "--json",
    ]
    child = subprocess.Popen(
        [sys.executable, "-m", "kvstore", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + 120
    blobs = store / "blobs"
    while time.time() < deadline and child.poll() is None:
        n = sum(len(files) for _, _, files in os.walk(blobs)) if blobs.exists() else 0
        if n >= 40:
            break
        time.sleep(0.05)
    assert child.poll() is None, "prefill finished before it could be killed"
    child.send_signal(signal.SIGKILL)
    child.wait()

    rerun = kvstore(*args)
    assert rerun.returncode == 0, rerun.stderr
    s = summary(rerun)
    assert (
        s["prefilled"] + s["skipped"] == 300 and s["skipped"] >= 1 and s["failed"] == 0
    )
    verify = kvstore("verify", "--store", store, "--json")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    again = summary(kvstore(*args))
    assert again["tokens_computed"] == 0


def _blob_files(store):
    out = []
    for dirpath, _, files in os.walk(store / "blobs"):
        out += sorted(
            os.path.join(dirpath, f) for f in files if f.endswith(".safetensors")
        )
    return out


def test_verify_catches_truncation_and_flipped_byte(tmp_path, tiny_model_dir):
    prompts = write_jsonl(tmp_path / "p.jsonl", GOOD[:1])
    store = tmp_path / "store"
    prefill(tiny_model_dir, prompts, store)
    assert kvstore("verify", "--store", store).returncode == 0
    first, second = _blob_files(store)[:2]
    with open(first, "r+b") as f:
        f.truncate(os.path.getsize(first) - 7)
    with open(second, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x40]))
    proc = kvstore("verify", "--store", store, "--json")
    assert proc.returncode == 1
    report = json.loads(proc.stdout)
    assert (
        len([p for p in report["problems"] if p["kind"] not in ("orphan", "temp")]) >= 2
    )
    assert kvstore("verify", "--store", store, "--fix").returncode == 1
    assert kvstore("verify", "--store", store).returncode == 0
    assert stored_prefix(tiny_model_dir, store, GOOD[0]["tokens"] + [5]) < 150


def test_gc_removes_orphans_and_respects_budget_and_pins(tmp_path, tiny_model_dir):
    rows = [{"tokens": random_tokens(128, 2000 + i)} for i in range(6)]
    rows[0]["pin"] = True
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    store = tmp_path / "store"
    prefill(tiny_model_dir, prompts, store)
    files = _blob_files(store)
    orphan = os.path.join(os.path.dirname(files[0]), "ab" * 16 + ".safetensors")
    with open(orphan, "wb") as f:
        f.write(b"orphan")
    size = sum(os.path.getsize(f) for f in files)
    per_prompt = size // 6
    proc = kvstore(
        "gc",
        "--store",
        store,
        "--max-bytes",
        per_prompt * 2 + per_prompt // 2,
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    assert not os.path.exists(orphan)
    left = _blob_files(store)
    assert sum(os.path.getsize(f) for f in left) <= per_prompt * 2 + per_prompt // 2
    assert (
        stored_prefix(tiny_model_dir, store, rows[0]["tokens"] + [5]) == 128
    )  # pinned
    assert kvstore("verify", "--store", store).returncode == 0


def test_stats_and_ls(tmp_path, tiny_model_dir):
    prompts = write_jsonl(tmp_path / "p.jsonl", GOOD)
    store = tmp_path / "store"
    prefill(tiny_model_dir, prompts, store)
    stats = json.loads(kvstore("stats", "--store", store, "--json").stdout)
    (ns,) = stats["namespaces"]
    assert ns["nodes"] > 0 and ns["pinned_bytes"] > 0
    text = kvstore("stats", "--store", store).stdout
    assert ns["id"][:12] in text
    tree = json.loads(kvstore("ls", "--store", store, "--json").stdout)
    assert tree and tree[0]["children"]
    listing = kvstore("ls", "--store", store, "--model", tiny_model_dir)
    assert (
        listing.returncode == 0 and "w5" in listing.stdout
    )  # decoded: the system role word
    assert "w5" not in kvstore("ls", "--store", store, "--no-decode").stdout
    proc = kvstore("stats", "--store", tmp_path / "nothing")
    assert proc.returncode == 2 and "no kvstore" in proc.stderr


@pytest.mark.model
def test_real_model_prefill_then_generate_in_a_fresh_process(tmp_path, smollm2):
    """`kvstore prefill` on the default model; a new process restores and generates."""
    system = "You are a geography tutor. Answer with the city name only."
    prompts = write_jsonl(
        tmp_path / "p.jsonl", [{"messages": [{"role": "system", "content": system}]}]
    )
    store = tmp_path / "store"
    home = os.environ.get("KVSTORE_HOME") or str(tmp_path / "home")
    env = {"KVSTORE_HOME": home}
    proc = kvstore("prefill", prompts, "--store", store, "--json", env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert summary(proc)["tokens_computed"] > 0
    code = f"""
import json
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
import mlx.core as mx
from kvstore import KVStore
from kvstore.platform.default_model import ensure_default_model
model, tok = load(ensure_default_model())
msgs = [{{"role": "system", "content": {system!r}}}, {{"role": "user", "content": "Capital of Italy?"}}]
tokens = tok.apply_chat_template(msgs, add_generation_prompt=True)
def run(cache, rest):
    out = []
    for t, _ in generate_step(mx.array(rest), model, prompt_cache=cache, max_tokens=6):
        out.append(int(t))
    return out
with KVStore({str(store)!r}, model, tok) as s:
    cache, n = s.fetch(tokens)
warm = run(cache, tokens[n:])
cold = run(make_prompt_cache(model), tokens)
print(json.dumps({{"n": n, "same": warm == cold, "text": tok.decode(warm)}}))
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, **env},
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert (
        result["n"] > 10 and result["same"]
    ), result  # the system prompt came from the store


def test_pin_and_unpin_by_text_and_file(tmp_path, tiny_model_dir):
    text = GOOD[1]["prompt"]
    prompts = write_jsonl(tmp_path / "p.jsonl", [GOOD[1]])
    store = tmp_path / "store"
    common = ("--model", tiny_model_dir, "--store", store, "--chunk-tokens", 64)
    assert kvstore("prefill", prompts, *common).returncode == 0

    def pinned_bytes():
        stats = json.loads(kvstore("stats", "--store", store, "--json").stdout)
        return stats["namespaces"][0]["pinned_bytes"]

    assert pinned_bytes() == 0
    proc = kvstore("pin", text, *common)
    assert proc.returncode == 0 and "pinned 2 nodes" in proc.stdout, proc.stderr
    assert pinned_bytes() > 0
    proc = kvstore("unpin", "--file", prompts, *common)
    assert proc.returncode == 0 and "unpinned 2 nodes" in proc.stdout, proc.stderr
    assert pinned_bytes() == 0
    assert kvstore("pin", *common).returncode == 2  # nothing to pin: a clear error


@pytest.mark.stress  # the slow tier: keeps the README's test command short
def test_prefill_disk_budget_is_kept_by_later_runs(tmp_path, tiny_model_dir):
    """--disk-bytes holds the store to a budget, and a later prefill without it keeps
    the budget the store recorded; a bad size is a clear error."""
    rows = [{"tokens": random_tokens(128, 3000 + i)} for i in range(6)]
    store = tmp_path / "store"
    first = write_jsonl(tmp_path / "a.jsonl", rows[:2])
    assert prefill(tiny_model_dir, first, store).returncode == 0
    per_prompt = sum(os.path.getsize(f) for f in _blob_files(store)) // 2
    budget = per_prompt * 3 + per_prompt // 2
    second = write_jsonl(tmp_path / "b.jsonl", rows[2:4])
    proc = prefill(tiny_model_dir, second, store, "--disk-bytes", budget)
    assert proc.returncode == 0, proc.stderr
    assert sum(os.path.getsize(f) for f in _blob_files(store)) <= budget
    third = write_jsonl(tmp_path / "c.jsonl", rows[4:])
    proc = prefill(tiny_model_dir, third, store)  # no --disk-bytes: the recorded one
    assert proc.returncode == 0, proc.stderr
    assert sum(os.path.getsize(f) for f in _blob_files(store)) <= budget
    # The newest prompts are the ones kept.
    assert stored_prefix(tiny_model_dir, store, rows[5]["tokens"] + [5]) == 128

    proc = prefill(tiny_model_dir, third, store, "--disk-bytes", "lots")
    assert proc.returncode == 2 and "--disk-bytes" in proc.stderr
    assert "not a size" in proc.stderr


def test_restore_room_option(tmp_path, model, tiny_model_dir):
    """--restore-room reaches the store that prefill and serve open; a negative or
    non-integer value is a clear error naming the option."""
    from kvstore.cli import build_parser, open_store
    from kvstore.server import build_parser as serve_parser

    args = build_parser().parse_args(
        ["prefill", "p.jsonl", "--restore-room", "0", "--chunk-tokens", "64"]
    )
    with open_store(str(tmp_path / "s"), model, None, args) as store:
        assert store.restore_room == 0
    args = build_parser().parse_args(["prefill", "p.jsonl"])
    with open_store(str(tmp_path / "s"), model, None, args) as store:
        assert store.restore_room == 2048  # KVStore's default
    assert (
        serve_parser().parse_known_args(["--restore-room", "64"])[0].restore_room == 64
    )

    prompts = write_jsonl(tmp_path / "p.jsonl", GOOD[:1])
    for bad in ("-1", "lots"):
        proc = prefill(tiny_model_dir, prompts, tmp_path / "s", "--restore-room", bad)
        assert proc.returncode == 2 and "--restore-room" in proc.stderr, proc.stderr
    proc = kvstore("serve", "--restore-room", "-1")
    assert proc.returncode == 2 and "--restore-room" in proc.stderr, proc.stderr


_NO_MODEL = """
import sys
from kvstore.cli import main
status = main(sys.argv[1:])
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {"mlx", "mlx_lm", "transformers"})
print(status, ",".join(loaded) or "-")
"""


def test_commands_that_run_no_model_load_no_mlx(tmp_path, model):
    """stats, ls --no-decode, verify and gc read files only: they start without
    loading MLX, mlx-lm or transformers (seconds of imports a cron job pays)."""
    from conftest import compute_cache

    from kvstore import KVStore

    store = str(tmp_path / "store")
    with KVStore(store, model, chunk_tokens=16) as s:
        for seed in range(4):
            tokens = random_tokens(100, seed)
            s.save(tokens, compute_cache(model, tokens))
    for argv in (
        ["stats"],
        ["stats", "--full"],
        ["ls", "--no-decode"],
        ["verify"],
        ["gc", "--max-bytes", "20K"],
    ):
        proc = subprocess.run(
            [sys.executable, "-c", _NO_MODEL, *argv, "--store", store],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, (argv, proc.stderr)
        status, loaded = proc.stdout.strip().splitlines()[-1].split(" ")
        assert (status, loaded) == ("0", "-"), (argv, loaded)
    proc = kvstore("stats", "--store", store, "--json")
    assert json.loads(proc.stdout)["totals"]["bytes"] <= 20 << 10
