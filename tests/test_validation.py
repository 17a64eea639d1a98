"""Input validation of every public entry point: the library, the CLI, ``kvstore serve``.

Every wrong input is a clear error naming what was wrong (the argument, option or
file), never a traceback from deep inside and never a failure later in a background
thread. The CLI exits with status 2.
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import VOCAB, compute_cache, random_tokens, run_cli

from kvstore import KVStore, StoreError, server

C = 32
TOKENS = random_tokens(50, seed=40)


@pytest.fixture(scope="module")
def files(tmp_path_factory, model):
    root = tmp_path_factory.mktemp("validation")
    (root / "afile").write_text("x")
    (root / "adir").mkdir()
    (root / "binary.jsonl").write_bytes(b"\xff\xfe{")
    (root / "prompts.jsonl").write_text('{"tokens": [5, 6, 7, 8]}\n')
    with KVStore(root / "store", model, chunk_tokens=C) as s:
        s.save(TOKENS, compute_cache(model, TOKENS))
    return root


@pytest.fixture
def store(files, model):
    with KVStore(files / "store", model, chunk_tokens=C) as s:
        yield s


# -- library ---------------------------------------------------------------------------

CACHE = "cache"  # stands for a matching cache in the tables below

CONSTRUCTOR = [
    ({"path": None}, TypeError, "path must be a str"),
    ({"path": 42}, TypeError, "path must be a str"),
    ({"path": "{files}/afile"}, StoreError, "not a directory"),
    ({"path": "{files}/afile/sub"}, StoreError, "cannot create the store directory"),
    ({"path": "{files}/adir-with-photos"}, StoreError, "not a kvstore directory"),
    ({"model": None}, TypeError, "model must be an mlx-lm model"),
    ({"model": "SmolLM2"}, TypeError, "model must be an mlx-lm model"),
    ({"tokenizer": 5}, TypeError, "tokenizer must be"),
    ({"chunk_tokens": 0}, ValueError, "chunk_tokens must be >= 1"),
    ({"chunk_tokens": True}, TypeError, "chunk_tokens must be an int, got bool"),
    ({"chunk_tokens": 32.0}, TypeError, "chunk_tokens must be an int"),
    ({"ram_bytes": -1}, ValueError, "ram_bytes must be >= 0"),
    ({"ram_bytes": 1.5}, TypeError, "ram_bytes must be an int"),
    ({"disk_bytes": -1}, ValueError, "disk_bytes must be >= 1"),
    ({"disk_bytes": 0}, ValueError, "disk_bytes must be >= 1"),
    ({"disk_bytes": "1G"}, TypeError, "disk_bytes must be an int"),
    ({"disk_bytes": False}, TypeError, "disk_bytes must be an int, got bool"),
    ({"max_pending_bytes": -5}, ValueError, "max_pending_bytes must be >= 0"),
    ({"max_pending_bytes": None}, TypeError, "max_pending_bytes must be an int"),
    ({"read_threads": 0}, ValueError, "read_threads must be >= 1"),
    ({"restore_room": -1}, ValueError, "restore_room must be >= 0"),
    ({"restore_room": 1.5}, TypeError, "restore_room"),
]


@pytest.mark.parametrize("kwargs, error, message", CONSTRUCTOR)
def test_constructor_arguments(files, model, kwargs, error, message):
    (files / "adir-with-photos").mkdir(exist_ok=True)
    (files / "adir-with-photos" / "cat.jpg").write_bytes(b"meow")
    args = {"path": str(files / "new-store"), "model": model, **kwargs}
    if isinstance(args["path"], str):
        args["path"] = args["path"].format(files=files)
    with pytest.raises(error, match=message):
        KVStore(**args)
    assert not (files / "new-store").exists()


CALLS = [
    # fetch
    ("fetch", (None,), {}, TypeError, "tokens must be a list of ints, got NoneType"),
    ("fetch", ("hello",), {}, TypeError, "tokens must be a list of ints, got str"),
    ("fetch", ({1: 2},), {}, TypeError, "tokens must be a list of ints, got dict"),
    ("fetch", ({1, 2},), {}, TypeError, "tokens must be a list of ints, got set"),
    ("fetch", (iter([1, 2]),), {}, TypeError, "list of ints"),
    ("fetch", ([1, 2.5],), {}, TypeError, r"tokens\[1\] is float"),
    ("fetch", ([3, -1],), {}, ValueError, r"tokens\[1\] = -1 is negative"),
    ("fetch", ([2**40],), {}, ValueError, "does not fit in int32"),
    ("fetch", (np.zeros((2, 2), int),), {}, TypeError, "one-dimensional"),
    ("fetch", (np.zeros(3),), {}, TypeError, "must hold integers"),
    # save
    ("save", ([], []), {}, ValueError, "tokens is empty: nothing to save"),
    ("save", (TOKENS, CACHE), {"kind": "robot"}, ValueError, "kind must be one of"),
    ("save", (TOKENS, CACHE), {"kind": None}, ValueError, "kind must be one of"),
    ("save", (TOKENS, CACHE), {"pin": "yes"}, TypeError, "pin must be True or False"),
    ("save", (TOKENS, CACHE), {"pin": 1}, TypeError, "pin must be True or False"),
    ("save", (TOKENS, CACHE), {"boundaries": None}, TypeError, "boundaries must be"),
    ("save", (TOKENS, CACHE), {"boundaries": "10"}, TypeError, "boundaries must be"),
    ("save", (TOKENS, CACHE), {"boundaries": [2.5]}, TypeError, r"boundaries\[0\]"),
    ("save", (TOKENS, CACHE), {"boundaries": [True]}, TypeError, "got bool|is bool"),
    ("save", (TOKENS, CACHE), {"boundaries": [-1]}, ValueError, "outside the 50"),
    ("save", (TOKENS, CACHE), {"boundaries": [51]}, ValueError, "outside the 50"),
    ("save", (TOKENS, None), {}, TypeError, "cache must be a list of cache objects"),
    ("save", (TOKENS[:10], CACHE), {}, ValueError, "holds 50 tokens but 10"),
    # save_prefix
    ("save_prefix", ([], CACHE), {}, ValueError, "tokens is empty"),
    ("save_prefix", (TOKENS, CACHE), {"pin": "no"}, TypeError, "pin must be"),
    ("save_prefix", (TOKENS + [1, 2], CACHE), {}, ValueError, "holds 50 tokens"),
    # prefill
    ("prefill", ([],), {}, ValueError, "tokens is empty: nothing to prefill"),
    ("prefill", (TOKENS,), {"step_tokens": 0}, ValueError, "step_tokens must be >= 1"),
    (
        "prefill",
        (TOKENS,),
        {"step_tokens": True},
        TypeError,
        "step_tokens must be an int",
    ),
    ("prefill", (TOKENS,), {"pin": "no"}, TypeError, "pin must be True or False"),
    ("prefill", (TOKENS,), {"kind": "bot"}, ValueError, "kind must be one of"),
    ("prefill", (TOKENS,), {"boundaries": 5}, TypeError, "boundaries must be"),
    ("prefill", ([1, 2, VOCAB],), {}, ValueError, r"tokens\[2\] = 512 is not below"),
    # pin
    ("pin", ([],), {}, ValueError, "tokens is empty: nothing to pin"),
    ("pin", (None,), {}, TypeError, "tokens must be a list of ints"),
    ("pin", (TOKENS,), {"pinned": "false"}, TypeError, "pinned must be True or False"),
]


@pytest.mark.parametrize(
    "method, args, kwargs, error, message",
    CALLS,
    ids=[f"{c[0]}-{i}" for i, c in enumerate(CALLS)],
)
def test_method_arguments(store, model, method, args, kwargs, error, message):
    cache = compute_cache(model, TOKENS)
    args = [cache if a is CACHE else a for a in args]
    before = store.stats()
    with pytest.raises(error, match=message):
        getattr(store, method)(*args, **kwargs)
    store.flush()
    after = store.stats()
    assert after["nodes"] == before["nodes"]  # nothing was queued
    assert after["writes_failed"] == after["errors"] == 0


# -- command line ----------------------------------------------------------------------


def cli_cases(files, model_dir):
    store, missing = files / "store", files / "missing.jsonl"
    prompts = files / "prompts.jsonl"
    prefill = ["prefill", prompts, "--model", model_dir, "--store", store, "--quiet"]
    return [
        ([], "command"),
        (["frobnicate"], "frobnicate"),
        (["gc", "--store", store, "--max-bytes", "-1"], "--max-bytes"),
        (["gc", "--store", store, "--max-bytes", "abc"], "--max-bytes"),
        (["gc", "--store", store, "--max-bytes", "1e400"], "--max-bytes"),
        (["gc", "--store", store, "--max-bytes"], "--max-bytes"),
        (["gc", "--store", store, "--drop-model", "zz"], "--drop-model"),
        (["gc", "--store", store, "--drop-model", "0123456789abcdef"], "no namespace"),
        (["gc", "--store", files / "nowhere"], "no kvstore here"),
        (["stats", "--store", files / "afile"], "no kvstore here"),
        (["verify", "--store", files / "nowhere"], "no kvstore here"),
        (["ls", "--store", store, "--depth", "0"], "--depth"),
        (["ls", "--store", store, "--depth", "x"], "--depth"),
        (["prefill", missing, "--model", model_dir, "--store", store], "missing.jsonl"),
        (
            ["prefill", files / "adir", "--model", model_dir, "--store", store],
            "adir: is a directory",
        ),
        (prefill + ["--disk-bytes", "0"], "--disk-bytes: a budget of 0 would keep"),
        (prefill + ["--disk-bytes", "infG"], "--disk-bytes: not a size"),
        (prefill + ["--ram-bytes", "nanM"], "--ram-bytes: not a size"),
        (prefill + ["--disk-bytes", "1e30G"], "--disk-bytes: .*larger than any disk"),
        (["gc", "--store", store, "--max-bytes", "infG"], "--max-bytes: not a size"),
        (["gc", "--store", store, "--max-bytes", "9" * 30], "larger than any disk"),
        (prefill + ["--chunk-tokens", "9" * 20], "--chunk-tokens: must be <="),
        (prefill + ["--kv-bits", "1000"], "--kv-bits: must be <="),
        (prefill[:-3] + ["--store", files / "afile"], "afile exists and is not a dir"),
        (prefill[:-3] + ["--store", files / "afile" / "s"], "cannot create the store"),
        (
            ["prefill", prompts, "--model", files / "no-model", "--store", store],
            "no-model'?: no such directory",
        ),
        (prefill + ["--chunk-tokens", "0"], "--chunk-tokens"),
        (prefill + ["--chunk-tokens", "many"], "--chunk-tokens"),
        (prefill + ["--max-tokens-per-prompt", "-1"], "--max-tokens-per-prompt"),
        (prefill + ["--kind", "robot"], "--kind"),
        (
            ["pin", "--store", store, "--model", model_dir, "--file", missing],
            "missing.jsonl: no such file",
        ),
        (["pin", "--store", store, "--node", "abcdef12"], "--node needs --namespace"),
        (
            ["unpin", "--store", store, "--node", "zz", "--namespace", "0123456789"],
            "--namespace/--node",
        ),
        (["pin", "--store", files / "nowhere", "w5 w6"], "no kvstore here"),
    ]


def test_cli_arguments(files, tiny_model_dir, capsys):
    for argv, message in cli_cases(files, tiny_model_dir):
        status, _, err = run_cli(capsys, *argv)
        assert status == 2, (argv, err)
        assert "Traceback" not in err, (argv, err)
        assert re.search(message, err), (argv, err)


def test_cli_exit_status_in_a_real_process(files):
    proc = subprocess.run(
        [sys.executable, "-m", "kvstore", "gc", "--store", files / "store"]
        + ["--max-bytes", "-1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "--max-bytes: size must not be negative: '-1'" in proc.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_prompts_file_and_store(files, tiny_model_dir, capsys, model):
    secret = files / "secret.jsonl"
    secret.write_text('{"tokens": [5, 6]}\n')
    secret.chmod(0)
    locked = files / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        status, _, err = run_cli(
            capsys,
            *["prefill", secret, "--model", tiny_model_dir, "--store", files / "s2"],
        )
        assert status == 2 and "secret.jsonl: cannot read" in err
        with pytest.raises(StoreError, match="cannot create the store directory"):
            KVStore(locked / "store", model)
    finally:
        secret.chmod(0o600)
        locked.chmod(0o700)


# -- kvstore serve -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--strip-pattern", "("], "bad --strip-pattern"),
        (["--strip-pattern", "[a-"], "bad --strip-pattern"),
        (["--store", "{files}/afile"], "bad --store: .*not a directory"),
        (["--store", "{files}/afile/sub"], "bad --store: cannot create"),
        (["--store", "{files}/adir-with-photos"], "bad --store: .*not a kvstore"),
        (["--store"], "--store: expected one argument"),
        (["--strip-pattern"], "--strip-pattern: expected one argument"),
        (["--disk-bytes", "-5"], "--disk-bytes: size must not be negative"),
        (["--ram-bytes", "2X"], "--ram-bytes: not a size"),
        (["--disk-bytes", "infG"], "--disk-bytes: not a size"),
        (["--disk-bytes", "0"], "--disk-bytes: a budget of 0"),
        (["--disk-bytes", "1e30G"], "--disk-bytes: .*larger than any disk"),
    ],
)
def test_serve_arguments(files, capsys, argv, message):
    (files / "adir-with-photos").mkdir(exist_ok=True)
    (files / "adir-with-photos" / "cat.jpg").write_bytes(b"meow")
    argv = [a.format(files=files) for a in argv]
    try:
        status = server.main(argv, hard_exit=False)
    except SystemExit as e:  # argparse
        status = e.code
    err = capsys.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err
    assert re.search(message, err), err
