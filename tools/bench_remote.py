#!/usr/bin/env python
"""Restore from the shared remote tier (S3) vs cold prefill vs the local disk tier.

Usage::

    python tools/bench_remote.py [--model PATH|default|wide] [--tokens 2048]
                                 [--repeats 3] [--remote s3://bucket/prefix | --ceph]
                                 [--sync-prompts 0]

Without ``--remote`` a moto S3 server is started on 127.0.0.1 in a subprocess (moto is
a Python server: its throughput, not the network's, bounds the remote case); with
``--ceph`` a one-machine Ceph cluster and its S3 gateway (``tools/ceph_cluster.py``).
Endpoint and credentials of a real ``--remote`` come from the usual ``AWS_*``
variables. The model defaults to a tiny random llama (fast, but its prefill is no
measure of a real model's); ``wide`` is a random llama with 8 layers and 16 KiB of
float32 KV per token (bytes enough to time transfers); ``default`` is
SmolLM2-135M-Instruct.

Cases, each timed from the prompt's tokens to a cache holding its KV (``mx.eval``):

* cold prefill: the model over the whole prompt, no store;
* local disk: ``fetch`` in a freshly opened store that holds the prompt (RAM tier off);
* remote (S3): ``fetch`` in a fresh, empty store directory with the remote tier: the
  manifests are looked up, the node files downloaded, validated, written and
  committed locally, then restored from the local disk.

With ``--sync-prompts N`` (N prompts of ``--tokens`` sharing a quarter of their
tokens), also: ``kvstore push`` of that store, ``pull`` into an empty one, and a new
machine's warm start (open an empty store, pull, restore the first prompt), next to
plain boto3 copying the same node files up and down with as many threads in the same
run (downloads twice: into files, then with an fsync per file, a pull's floor).

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
from concurrent.futures import ThreadPoolExecutor

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


def _sync_prompts(vocab, *, prompts, tokens):
    """``prompts`` random prompts of ``tokens`` sharing their first quarter."""
    rng = np.random.default_rng(1)
    shared = rng.integers(0, vocab, size=tokens // 4).tolist()
    return [
        shared + rng.integers(0, vocab, size=tokens - len(shared)).tolist()
        for _ in range(prompts)
    ]


def _delete_prefix(s3, bucket, prefix):
    """Delete every object under ``prefix`` (the bench's own keys)."""
    for page in s3.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=prefix
    ):
        objects = [{"Key": o["Key"]} for o in page.get("Contents", ())]
        if objects:
            s3.delete_objects(Bucket=bucket, Delete={"Objects": objects})


def run_sync(
    model,
    url,
    workdir,
    *,
    prompts=4,
    tokens=2048,
    chunk_tokens=256,
    repeats=3,
    threads=8,
    tokenizer=None,
    cleanup=None,
):
    """Time ``push``, ``pull`` and a new machine's warm start against ``url``, and
    plain boto3 copying the same node files (as many threads) in the same run.

    Each repeat uses its own prefix under ``url`` (deleted after it; then
    ``cleanup()``, e.g. the gateway's garbage collection). Returns
    ``[{"case", "s", "mb", "samples"}]`` (seconds are medians).
    """
    import boto3
    from botocore.config import Config

    from kvstore.remote import parse_url, push

    workdir = str(workdir)
    vocab = getattr(getattr(model, "args", None), "vocab_size", 512)
    texts = _sync_prompts(vocab, prompts=prompts, tokens=tokens)
    options = dict(chunk_tokens=chunk_tokens, ram_bytes=0)
    source = os.path.join(workdir, "sync-source")
    with KVStore(source, model, tokenizer, **options) as s:
        for p in texts:
            s.save(p, _cold(model, p))
        s.flush()
    files = sorted(
        os.path.join(d, f)
        for d, _, names in os.walk(os.path.join(source, "blobs"))
        for f in names
        if f.endswith(".safetensors")
    )
    mb = sum(os.path.getsize(f) for f in files) / 1e6
    bucket, prefix = parse_url(url)
    s3 = boto3.client("s3", config=Config(max_pool_connections=threads + 4))
    samples = {
        name: []
        for name in (
            "push (kvstore)",
            "upload (boto3)",
            "pull (kvstore)",
            "download (boto3)",
            "+ fsync (boto3)",
            "warm start",
        )
    }
    for r in range(repeats):
        run_prefix = f"{prefix}/sync-{uuid.uuid4().hex[:8]}".lstrip("/")

        def new_tier():
            kv = f"s3://{bucket}/{run_prefix}/kv"
            return RemoteTier(kv, upload=False, threads=threads, read_timeout=60.0)

        tier = new_tier()
        tic = time.perf_counter()
        report = push(source, tier)
        samples["push (kvstore)"].append(time.perf_counter() - tic)
        tier.close()
        if report["uploaded"] != report["nodes"] or report["problems"]:
            raise RuntimeError(f"push did not upload every node: {report}")

        keys = [f"{run_prefix}/boto3/{i}" for i in range(len(files))]

        def upload(item):
            path, key = item
            with open(path, "rb") as f:
                s3.put_object(Bucket=bucket, Key=key, Body=f.read())

        tic = time.perf_counter()
        with ThreadPoolExecutor(threads) as io:
            list(io.map(upload, zip(files, keys)))
        samples["upload (boto3)"].append(time.perf_counter() - tic)

        # A new machine: an empty store, pull, then its first request.
        fresh = os.path.join(workdir, f"fresh-sync-{r}")
        tic = time.perf_counter()
        tier = new_tier()
        with KVStore(fresh, model, tokenizer, remote=tier, **options) as st:
            pulling = time.perf_counter()
            report = tier.pull()
            samples["pull (kvstore)"].append(time.perf_counter() - pulling)
            cache, n = st.fetch(texts[0] + [0])
            mx.eval([c.state for c in cache])
            samples["warm start"].append(time.perf_counter() - tic)
        if report["invalid"] or n != len(texts[0]):
            raise RuntimeError(f"pull incomplete: {report}; restored {n}")

        copies = os.path.join(workdir, f"boto3-{r}")
        os.makedirs(copies)

        def download(item, durable=False):
            i, key = item
            data = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
            with open(os.path.join(copies, f"{i}.{durable}"), "wb") as f:
                f.write(data)
                if durable:  # the floor of a pull, which keeps what it acknowledges
                    f.flush()
                    os.fsync(f.fileno())

        for name, durable in (("download (boto3)", False), ("+ fsync (boto3)", True)):
            tic = time.perf_counter()
            with ThreadPoolExecutor(threads) as io:
                list(io.map(lambda item: download(item, durable), enumerate(keys)))
            samples[name].append(time.perf_counter() - tic)
        shutil.rmtree(fresh)
        shutil.rmtree(copies)
        _delete_prefix(s3, bucket, run_prefix + "/")
        if cleanup is not None:
            cleanup()
    return [
        {
            "case": name,
            "s": statistics.median(values),
            "mb": mb,
            "samples": [round(v, 3) for v in values],
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
    p.add_argument(
        "--model", default=None, help="mlx-lm model path, 'default' or 'wide'"
    )
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--remote", default=None, help="s3://bucket/prefix")
    where.add_argument(
        "--ceph", action="store_true", help="a one-machine Ceph cluster's gateway"
    )
    p.add_argument(
        "--sync-prompts", type=int, default=0, help="time push/pull/warm start too"
    )
    p.add_argument("--threads", type=int, default=8, help="parallel requests")
    args = p.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the moto subprocess is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    tokenizer = None
    if args.model in (None, "wide"):
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
        from conftest import tiny_llama

        if args.model is None:
            model, name = tiny_llama(0), "tiny random llama (tests/conftest.py)"
        else:
            model = tiny_llama(0, layers=8, hidden=512)
            name = "random llama, 8 layers, 16 KiB of KV per token"
    else:
        from kvstore.bench.models import load

        model, tokenizer = load(None if args.model == "default" else args.model)
        name = args.model

    proc = cluster = None
    url = args.remote
    workdir = tempfile.mkdtemp(prefix="kvstore-bench-remote-")
    try:
        if url is None:
            import boto3

            if args.ceph:
                sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
                from ceph_cluster import CephCluster

                cluster = CephCluster(os.path.join(workdir, "ceph")).start()
                os.environ.update(cluster.env())
                print(
                    f"{cluster.version()}: one monitor, one memstore OSD, radosgw "
                    f"(started in {cluster.startup_seconds:.2f} s)"
                )
            else:
                proc, endpoint = _start_moto()
                os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
                os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
                os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
                os.environ["AWS_ENDPOINT_URL"] = endpoint
            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            boto3.client("s3").create_bucket(Bucket=bucket)
            url = f"s3://{bucket}/bench"
        common = dict(chunk_tokens=args.chunk_tokens, repeats=args.repeats)
        rows = run(
            model, url, workdir, tokens=args.tokens, tokenizer=tokenizer, **common
        )
        sync = []
        if args.sync_prompts:
            sync = run_sync(
                model,
                url,
                workdir,
                prompts=args.sync_prompts,
                tokens=args.tokens,
                threads=args.threads,
                tokenizer=tokenizer,
                cleanup=cluster.gc if cluster is not None else None,
                **common,
            )
    finally:
        if cluster is not None:
            cluster.stop()
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
    if sync:
        mb = sync[0]["mb"]
        print(
            f"\n{args.sync_prompts} prompts of {args.tokens} tokens sharing a quarter: "
            f"{mb:.1f} MB of node files; {args.threads} threads"
        )
        print(f"{'case':<18} {'s (median)':>10} {'MB/s':>8}  samples s")
        for r in sync:
            rate = "" if r["case"] == "warm start" else f"{mb / r['s']:8.1f}"
            print(f"{r['case']:<18} {r['s']:10.3f} {rate:>8}  {r['samples']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
