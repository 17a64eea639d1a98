"""Load test: ``kvstore serve`` against plain ``mlx_lm.server``, side by side.

Both servers run the same model with the same flags and get the same request stream:
a shared system prompt of ``--system-tokens`` tokens plus a distinct user turn per
request, streamed, greedy, ``--max-tokens`` generated (end of sequence forbidden by a
logit bias, so every request generates the same number of tokens).

* **Warm throughput.** Both servers up; each first answers one request holding the
  system prompt (kvstore: it is then in RAM and in the store). Then, per round, for
  each concurrency: ``c`` clients, each sending ``--requests-per-level / c``
  requests back to back. Requests/s over the level's wall time, time to first token (TTFT)
  p50/p99, and the longest gap between two streamed tokens of one request (a stall
  of the generation loop: prefill of a joining request, a save, a lock). Rounds
  alternate which server goes first; kvstore's write-behind backlog left after a
  level is drained (and timed) before the other server runs.
* **First request after a restart.** A fresh server process per sample, alternating:
  plain (cold: the whole prompt is computed) and kvstore on the warm store (the
  system prompt restored from disk; page cache warm). TTFT of its first request.

Targets: kvstore's requests/s >= 0.95x plain's at every concurrency; kvstore's first
TTFT after a restart <= 0.1x plain's cold TTFT. Ratios are of medians within this
run; every sample is in ``--json``.

The default model is a random-weight llama built here (no download): SmolLM2-like
layout per layer (head_dim 64, grouped KV heads), fewer and narrower layers so that a
run takes minutes on a CPU, float16, with a word-level tokenizer (one token per word,
so prompt lengths are exact). ``--model DIR`` runs any mlx-lm model directory instead.

    python tools/bench_serve.py --json docs/serve-load.json
"""

import argparse
import http.client
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

# -- the model -------------------------------------------------------------------------


def build_model(path: str, args) -> str:
    """Write a random-weight llama and a word-level tokenizer as an mlx-lm directory."""
    import mlx.core as mx
    from mlx_lm.models import llama
    from mlx_lm.utils import save_config, save_model

    from kvstore.bench.models import word_tokenizer

    config = dict(
        model_type="llama",
        hidden_size=args.heads * 64,
        num_hidden_layers=args.layers,
        intermediate_size=args.intermediate,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=64,
        rms_norm_eps=1e-5,
        vocab_size=args.vocab,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
    )
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(mx.float16)
    mx.eval(model.parameters())
    save_model(path, model)
    save_config({**config, "torch_dtype": "float16"}, config_path=f"{path}/config.json")
    word_tokenizer(args.vocab).save_pretrained(path)
    return path


def words(rng: random.Random, n: int, vocab: int) -> str:
    return " ".join(f"w{rng.randrange(8, vocab)}" for _ in range(n))


class Texts:
    """Random texts of a given token count for a model's tokenizer: one word per
    token with the built model's word-level tokenizer, else cut to length."""

    def __init__(self, model_dir: str, vocab: Optional[int]):
        self.vocab = vocab
        self.eos = 2
        self.tokenizer = None
        if vocab is None:
            from pathlib import Path

            from mlx_lm.utils import load_tokenizer

            self.tokenizer = load_tokenizer(Path(model_dir))
            self.eos = self.tokenizer.eos_token_id

    def make(self, rng: random.Random, n: int) -> str:
        if self.tokenizer is None:
            return words(rng, n, self.vocab)
        ids = self.tokenizer.encode(words(rng, n, 10000), add_special_tokens=False)
        return self.tokenizer.decode(ids[:n])


# -- servers -------------------------------------------------------------------------


class Server:
    """A server process (``python -m ...``) on a free port, ready when it answers.

    ``launcher`` replaces ``python -m`` in front of ``module_args`` (e.g. a script
    that sets up the interpreter, then runs the module's main).
    """

    def __init__(
        self,
        name: str,
        module_args: List[str],
        log_dir: str,
        *,
        launcher: Optional[List[str]] = None,
    ):
        from kvstore.bench.ports import free_ports

        self.name = name
        self.port = free_ports(1)[0]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        self.log = open(os.path.join(log_dir, f"{name}.log"), "ab")
        launcher = launcher or [sys.executable, "-m"]
        cmd = [*launcher, *module_args, "--port", str(self.port)]
        self.proc = subprocess.Popen(
            cmd + ["--host", "127.0.0.1"],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{self.port}/health", timeout=2
                ) as r:
                    if json.loads(r.read()).get("status") == "ok":
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{name} did not start")
            time.sleep(0.2)

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}") as r:
            return json.loads(r.read())

    def settle(self, timeout: float = 600) -> float:
        """kvstore: wait until no save is queued and the writer is idle; the seconds
        waited (0 for plain)."""
        if self.name != "kvstore":
            return 0.0
        tic = time.perf_counter()
        last = None
        while time.perf_counter() - tic < timeout:
            stats = self.get("/kvstore/stats")
            idle = not stats.get("saves_queued") and not any(
                s.get("pending_write_jobs") for s in stats["stores"]
            )
            if idle and last == stats["saves"]:
                break
            last = stats["saves"] if idle else None
            time.sleep(0.05)
        return max(0.0, time.perf_counter() - tic - 0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# -- requests -------------------------------------------------------------------------


def chat(system: str, user: str, max_tokens: int, eos: int = 2) -> dict:
    return {
        "model": "default_model",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
        ],
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "max_tokens": max_tokens,
        "logit_bias": {str(eos): -1000.0},  # no end of sequence: fixed lengths
    }


def stream(port: int, body: dict) -> dict:
    """One streamed request: TTFT, gaps between tokens, tokens, cached tokens.

    A connection reset before any response (the HTTP server's listen backlog is 5:
    16 clients connecting at once can overflow it) is retried; the time counts.
    """
    tic, sent_at = time.perf_counter(), time.time()
    for retries in range(5):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
        try:
            conn.request(
                "POST",
                "/v1/chat/completions",
                json.dumps(body),
                {"Content-Type": "application/json"},
            )
            resp = conn.getresponse()
            break
        except (ConnectionResetError, http.client.RemoteDisconnected):
            conn.close()
            time.sleep(0.05)
    else:
        raise RuntimeError("the server kept resetting the connection")
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
    times, cached, prompt, completion, text = [], None, None, None, []
    for line in resp:
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[6:])
        now = time.perf_counter()
        usage = event.get("usage")
        if usage:
            prompt = usage.get("prompt_tokens")
            completion = usage.get("completion_tokens")
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        choices = event.get("choices") or []
        content = choices and (choices[0].get("delta") or {}).get("content")
        if content:
            times.append(now)
            text.append(content)
    conn.close()
    end = time.perf_counter()
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {
        "ttft": times[0] - tic if times else end - tic,
        "sent_at": sent_at,  # the wall clock, to match a server's log lines
        "seconds": end - tic,
        "tokens": len(times),
        "max_gap": max(gaps, default=0.0),
        "gaps": gaps,
        "cached": cached,
        "prompt": prompt,
        "completion": completion,
        "text": "".join(text),
        "first_at": times[0] if times else None,
        "last_at": times[-1] if times else None,
        "retries": retries,
    }


def run_level(server: Server, bodies: List[List[dict]]) -> dict:
    """Clients at once, each sending its bodies back to back; the level's numbers."""
    start = threading.Barrier(len(bodies))

    def client(mine):
        start.wait()
        return [stream(server.port, b) for b in mine]

    tic = time.perf_counter()
    with ThreadPoolExecutor(len(bodies)) as pool:
        results = [r for rs in pool.map(client, bodies) for r in rs]
    wall = time.perf_counter() - tic
    drain = server.settle()
    gaps = sorted(g for r in results for g in r["gaps"])
    return {
        "requests": len(results),
        "wall": wall,
        "rps": len(results) / wall,
        "ttft": [r["ttft"] for r in results],
        "max_gap": max((r["max_gap"] for r in results), default=0.0),
        "gap_p99": percentile(gaps, 99) if gaps else 0.0,
        "tokens": sum(r["tokens"] for r in results),
        "cached": [r["cached"] for r in results],
        "retries": sum(r["retries"] for r in results),
        "drain": drain,
    }


def percentile(xs: List[float], p: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


# -- the run --------------------------------------------------------------------------


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="an mlx-lm model directory (default: built here)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=4, help="query heads (head_dim 64)")
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--system-tokens", type=int, default=2048)
    p.add_argument("--user-tokens", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument(
        "--requests-per-level",
        type=int,
        default=32,
        help="requests per concurrency level, split among its clients",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--restarts", type=int, default=3)
    p.add_argument(
        "--server-args",
        default="",
        help="extra flags for both servers (mlx_lm.server options), one string",
    )
    p.add_argument("--kvstore-args", default="", help="extra flags for kvstore serve")
    p.add_argument("--json", help="write every sample here")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    args = p.parse_args(argv)

    work = tempfile.mkdtemp(prefix="bench-serve-")
    try:
        return _run(args, work)
    finally:
        if args.keep:
            print(f"work directory: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def _run(args, work: str) -> int:
    model = args.model or build_model(os.path.join(work, "model"), args)
    text = Texts(model, None if args.model else args.vocab)
    # The chat template adds a few tokens of its own to the system message.
    system = text.make(random.Random(0), args.system_tokens - 4)
    extra = args.server_args.split()
    plain_cmd = ["mlx_lm", "server", "--model", model, *extra]
    store = os.path.join(work, "store")
    # One client (this benchmark): the store's counters on the API port.
    kv_cmd = ["kvstore", "serve", "--model", model, "--store", store, "--api-metrics"]
    kv_cmd += extra
    kv_cmd += args.kvstore_args.split()
    describe = f"model {'random llama' if not args.model else args.model}: " + (
        f"{args.layers} layers, hidden {args.heads * 64}, {args.heads} heads / "
        f"{args.kv_heads} KV heads x 64, MLP {args.intermediate}, vocab "
        f"{args.vocab}, float16 (random weights, word-level tokenizer)"
        if not args.model
        else "its own weights and tokenizer"
    )
    machine = (
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}"
    )
    print(describe)
    print(machine)
    print(
        f"system prompt {args.system_tokens} tokens, user turns {args.user_tokens} "
        f"tokens, {args.max_tokens} generated, streaming, greedy; "
        f"{args.requests_per_level} requests per level, {args.rounds} rounds"
    )
    out: Dict[str, object] = {
        "model": describe,
        "machine": machine,
        "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
        "args": vars(args),
        "levels": {},
        "restart": {},
    }

    def body(tag) -> dict:
        user = text.make(random.Random(repr(tag)), args.user_tokens)
        return chat(system, user, args.max_tokens, text.eos)

    # -- warm throughput ----------------------------------------------------------
    servers = {
        "plain": Server("plain", plain_cmd, work),
        "kvstore": Server("kvstore", kv_cmd, work),
    }
    try:
        for name, server in servers.items():  # the system prompt: RAM (and store)
            first = stream(server.port, body(("warm", name)))
            server.settle()
            print(f"{name}: first request (cold) TTFT {first['ttft'] * 1e3:.0f} ms")
        levels = {name: {c: [] for c in args.concurrency} for name in servers}
        for rnd in range(args.rounds):
            order = list(servers) if rnd % 2 == 0 else list(servers)[::-1]
            for c in args.concurrency:
                each = max(1, args.requests_per_level // c)
                bodies = [
                    [body((rnd, c, client, i)) for i in range(each)]
                    for client in range(c)
                ]
                for name in order:
                    level = run_level(servers[name], bodies)
                    levels[name][c].append(level)
                    print(
                        f"round {rnd} c={c:>2} {name:<8} {level['rps']:6.2f} req/s  "
                        f"TTFT p50 {percentile(level['ttft'], 50) * 1e3:7.0f} ms  "
                        f"max gap {level['max_gap'] * 1e3:6.0f} ms  "
                        f"gap p99 {level['gap_p99'] * 1e3:5.0f} ms  "
                        f"drain {level['drain'] * 1e3:5.0f} ms"
                        + (
                            f"  ({level['retries']} retried)"
                            if level["retries"]
                            else ""
                        ),
                        flush=True,
                    )
        kv_stats = servers["kvstore"].get("/kvstore/stats")
    finally:
        for server in servers.values():
            server.stop()
    out["levels"] = levels
    out["kvstore_stats"] = {k: v for k, v in kv_stats.items() if k != "stores"}

    # -- first request after a restart ---------------------------------------------
    restart = {"plain": [], "kvstore": []}
    for i in range(args.restarts):
        order = ["plain", "kvstore"] if i % 2 == 0 else ["kvstore", "plain"]
        b = body(("restart", i))
        for name in order:
            server = Server(name, plain_cmd if name == "plain" else kv_cmd, work)
            try:
                r = stream(server.port, b)
                server.settle()
            finally:
                server.stop()
            restart[name].append(r)
            print(
                f"restart {i} {name:<8} TTFT {r['ttft'] * 1e3:8.0f} ms  "
                f"cached {r['cached']}/{r['prompt']}",
                flush=True,
            )
    out["restart"] = {
        name: [{k: v for k, v in r.items() if k not in ("gaps", "text")} for r in rs]
        for name, rs in restart.items()
    }

    # -- the table ------------------------------------------------------------------
    print()
    rows = report(levels, restart, args.concurrency)
    for line in rows:
        print(line)
    out["table"] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=float)
        print(f"\nevery sample: {args.json}")
    return 0


def report(levels, restart, concurrency) -> List[str]:
    med = statistics.median
    rows = [
        "| clients | server | req/s (median) | x plain | TTFT p50 ms | TTFT p99 ms "
        "| longest stall ms | gap p99 ms | req/s samples |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for c in concurrency:
        base = med(lv["rps"] for lv in levels["plain"][c])
        for name in ("plain", "kvstore"):
            lvs = levels[name][c]
            rps = med(lv["rps"] for lv in lvs)
            ttfts = [t for lv in lvs for t in lv["ttft"]]
            rows.append(
                f"| {c} | {name} | {rps:.2f} | {rps / base:.3f} | "
                f"{percentile(ttfts, 50) * 1e3:.0f} | {percentile(ttfts, 99) * 1e3:.0f} | "
                f"{max(lv['max_gap'] for lv in lvs) * 1e3:.0f} | "
                f"{med(lv['gap_p99'] for lv in lvs) * 1e3:.0f} | "
                f"{', '.join(format(lv['rps'], '.2f') for lv in lvs)} |"
            )
            if name == "kvstore":
                verdicts.append(
                    f"throughput at {c} clients: {rps / base:.3f}x plain "
                    f"({'PASS' if rps / base >= 0.95 else 'MISS'}, target >= 0.95x)"
                )
    if not restart["plain"]:
        return rows + [""] + verdicts
    plain = med(r["ttft"] for r in restart["plain"])
    kv = med(r["ttft"] for r in restart["kvstore"])
    rows += [
        "",
        "| first request after a restart | TTFT ms (median) | samples ms | cached tokens |",
        "|---|---|---|---|",
    ]
    for name, value in (("plain (cold)", plain), ("kvstore (warm store)", kv)):
        rs = restart["plain" if name.startswith("plain") else "kvstore"]
        rows.append(
            f"| {name} | {value * 1e3:.0f} | "
            f"{', '.join(format(r['ttft'] * 1e3, '.0f') for r in rs)} | "
            f"{', '.join(str(r['cached']) for r in rs)} |"
        )
    verdicts.append(
        f"first TTFT after a restart: {kv / plain:.4f}x plain's cold TTFT "
        f"({'PASS' if kv / plain <= 0.1 else 'MISS'}, target <= 0.1x)"
    )
    return rows + [""] + verdicts


if __name__ == "__main__":
    sys.exit(main())
