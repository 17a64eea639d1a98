#!/usr/bin/env python
"""Restore from the shared remote tier (S3) vs cold prefill vs the local disk tier.

Usage::

    python tools/bench_remote.py [--model PATH|default] [--tokens 2048]
                                 [--repeats 3] [--remote s3://bucket/prefix]

Without ``--remote`` a moto S3 server is started on 127.0.0.1 in a subprocess (moto is
a Python server: its throughput, not the network's, bounds the remote case; on real
S3 or MinIO expect other numbers). Endpoint and credentials of a real ``--remote``
come from the usual ``AWS_*`` variables. The model defaults to a tiny random llama
(fast, but its prefill is no measure of a real model's); ``--model default`` is
SmolLM2-135M-Instruct.

Cases, each timed from the prompt's tokens to a cache holding its KV (``mx.eval``):

* cold prefill: the model over the whole prompt, no store;
* local disk: ``fetch`` in a freshly opened store that holds the prompt (RAM tier off);
* remote (S3): ``fetch`` in a fresh, empty store directory with the remote tier: the
  manifests are looked up, the node files downloaded, validated, written and
  committed locally, then restored from the local disk.

Medians of ``--repeats`` (cold prefill runs once); nothing is asserted. This is a tool, not a test: pytest
never collects it (``tests/test_remote.py`` runs a small version).
"""

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import mlx.core as mx
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvstore import KVStore  # noqa: E402
from kvstore.remote import RemoteTier  # noqa: E402


def _cold(model, tokens, step=512):
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    for s in range(0, len(tokens), step):
        model(mx.array(tokens[s : s + step])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def run(
    model, url, workdir, *, tokens=2048, chunk_tokens=256, repeats=3, tokenizer=None
):
    """Time the three cases; returns ``[{"case", "ms", "restored", "samples"}]``."""
    workdir = str(workdir)
    vocab = getattr(getattr(model, "args", None), "vocab_size", 512)
    prompt = np.random.default_rng(0).integers(0, vocab, size=tokens).tolist()
    fetch_prompt = prompt + [0]  # a fetch leaves the last token: restore all of prompt
    options = dict(chunk_tokens=chunk_tokens, ram_bytes=0)

    def tier():
        return RemoteTier(url, lookup_timeout=600.0, read_timeout=60.0)

    samples = {"cold prefill": [], "local disk": [], "remote (S3)": []}
    restored = {name: None for name in samples}
    source = os.path.join(workdir, "source")
    with KVStore(source, model, tokenizer, remote=tier(), **options) as s:
        # Cold prefill runs once (minutes for a real model on a CPU): it fills the source.
        tic = time.perf_counter()
        cache = _cold(model, prompt)
        samples["cold prefill"].append(time.perf_counter() - tic)
        restored["cold prefill"] = len(prompt)
        s.save(prompt, cache)
        s.flush()
        if not s.remote.wait_uploads(600):
            raise RuntimeError(f"uploads to {url} did not finish: {s.stats()}")

    for r in range(repeats):
        with KVStore(source, model, tokenizer, **options) as s:
            tic = time.perf_counter()
            cache, n = s.fetch(fetch_prompt)
            mx.eval([c.state for c in cache])
            samples["local disk"].append(time.perf_counter() - tic)
            restored["local disk"] = n

        fresh = os.path.join(workdir, f"fresh-{r}")
        with KVStore(fresh, model, tokenizer, remote=tier(), **options) as s:
            tic = time.perf_counter()
            cache, n = s.fetch(fetch_prompt)
            mx.eval([c.state for c in cache])
            samples["remote (S3)"].append(time.perf_counter() - tic)
            restored["remote (S3)"] = n
            stats = s.stats()
            if stats["remote_errors"] or stats["remote_corrupt"]:
                raise RuntimeError(f"remote problems: {stats['remote_last_error']}")
        shutil.rmtree(fresh)
    return [
        {
            "case": name,
            "ms": 1000 * statistics.median(values),
            "restored": restored[name],
            "samples": [round(1000 * v, 2) for v in values],
        }
        for name, values in samples.items()
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_moto():
    """A moto S3 server in a subprocess (its own GIL); returns (process, endpoint)."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, endpoint
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto server did not start")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="mlx-lm model path, or 'default'")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--remote", default=None, help="s3://bucket/prefix (default: moto)")
    args = p.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the moto subprocess is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    tokenizer = None
    if args.model is None:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
        from conftest import tiny_llama

        model, name = tiny_llama(0), "tiny random llama (tests/conftest.py)"
    else:
        from kvstore.bench.models import load

        model, tokenizer = load(None if args.model == "default" else args.model)
        name = args.model

    proc = None
    url = args.remote
    if url is None:
        import boto3

        proc, endpoint = _start_moto()
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        boto3.client("s3").create_bucket(Bucket=bucket)
        url = f"s3://{bucket}/bench"
    workdir = tempfile.mkdtemp(prefix="kvstore-bench-remote-")
    try:
        rows = run(
            model,
            url,
            workdir,
            tokens=args.tokens,
            chunk_tokens=args.chunk_tokens,
            repeats=args.repeats,
            tokenizer=tokenizer,
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if proc is not None:
            proc.kill()
            proc.wait()
    cold = rows[0]["ms"]
    print(f"model: {name}; {args.tokens} tokens; chunk {args.chunk_tokens}; {url}")
    print(f"{'case':<14} {'ms (median)':>12} {'x cold':>8} {'restored':>9}  samples ms")
    for r in rows:
        print(
            f"{r['case']:<14} {r['ms']:12.1f} {r['ms'] / cold:8.4f} "
            f"{r['restored']:>9}  {r['samples']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
