"""Multi-round chat load: ``kvstore serve`` against plain ``mlx_lm.server``, fresh,
restarted, and restarted on a cold page cache.

The model is a directory of a real model's shape (Llama-3.1-8B's by default): mlx-lm's
own model class with random bf16 weights (fixed seed; speed does not depend on weight
values), the vocabulary of the tokenizer, and the default model's tokenizer and chat
template (SmolLM2's, ``kvstore.platform.default_model``). It is built and saved once, in a
child process, before any server starts.

The load: ``--users`` concurrent users hold chats of ``--rounds`` rounds each. Every
user has a long system prompt that it shares with one other user (``--systems``
prompts of ``--system-tokens`` tokens, users 0-1 on the first, 2-3 on the second, ...),
a first question of ``--first-tokens`` tokens, and a follow-up question of
``--followup-tokens`` tokens in each later round, sent with the whole history (the
answers are what the server streamed). Requests are streamed
``/v1/chat/completions``, greedy, ``--max-tokens`` tokens out, with a logit bias of
-1000 on ids below ``--ban-below`` (special tokens, end of sequence) so that every
request runs to ``--max-tokens``. The users of a round send at once; the next round
starts when every answer is in.

Phases, each a server process of its own, after one short warm-up request (the model
loads then, and a fresh machine compiles its kernels):

- ``plain``: ``mlx_lm.server``;
- ``kvstore-fresh``: ``kvstore serve`` on an empty store;
- ``kvstore-restart``: ``kvstore serve`` restarted on that store: the same users come
  back with the same chats;
- ``plain-restart``: ``mlx_lm.server`` again (a second plain sample, next to the
  restarts);
- ``kvstore-dropped``: as ``kvstore-restart``, with the page cache dropped
  (``/proc/sys/vm/drop_caches``, root) before the server starts; where that is not
  permitted the phase runs anyway and its sample says so.
- ``kvstore-rerestart`` (only when named in ``--phases``): restarted once more, last
  of a store's phases, so that the server starts with the restore rate the restarts
  before it measured and kept, as any later restart of a server that has restored
  does (the first restart knows none, and restores every returning user).

Before the first phase, two discarded plain rounds at the largest ``--users`` value:
the first large batched prefill on a machine compiles MLX's kernels, and so does the
first batched prefill of a follow-up over caches of thousands of tokens (seen on an
H200: round 2 of whichever phase ran first took 1.3-1.9 s where later phases took
0.6 s), and the first time a batch drops one of its members while others decode
(``gather`` of the batch's tokens: 3-4 s of every stream on an H100; the requests
of the final priming round end one step apart for it), and the first time prompts
join a batch while it prefills (7.5 s on an H200; a round of half as many other users
first, in two waves 0.5 s apart). Then, where restarted
phases are measured, one discarded ``kvstore serve`` round on a scratch store and
one after its restart: returning users' requests join a running batch one by one as
their restores end, which compiles kernels of its own (6 s of every stream, once on
a machine). Seconds that no measured phase should pay (``--no-prime`` skips it).

Per round: time to first token (TTFT) of every request, its decode rate (tokens
after the first over the time between the first and the last), and the round's
aggregate output tokens/s. Each ``--users`` value gets a fresh store per repeat; the
phases' order alternates between repeats (a store's fresh phase always comes first).
Every sample goes into ``--json``, rewritten after each phase, so a run stopped
early keeps what it measured (with ``--kvstore-args "--kvstore-log-level DEBUG"``, a
kvstore phase's sample also lists each prefetch its server logged: ``prefetches``);
``--budget`` stops starting phases that would not end in time. ``--report JSON``
prints the tables of a (partial) run.

On the GPU machine (see docs/gpu.md)::

    python tools/bench_serve_gpu.py --users 1 8 16 --repeats 1 \\
        --dir /tmp/bsg --json OUT.json --logs LOGDIR

On an H100 (80 GB), 16 users with 6,000-token system prompts run out of GPU memory
in plain ``mlx_lm.server`` too; ``--users 16 --system-tokens 3000`` holds as much KV as
8 users with 6,000.

On a CPU, in seconds (the check the test suite runs)::

    python tools/bench_serve_gpu.py --shape tiny --tokenizer word --users 2 \\
        --system-tokens 64 --first-tokens 16 --followup-tokens 8 --max-tokens 4 ...
"""

import argparse
import json
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from importlib import metadata
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu import SHAPES  # noqa: E402
from bench_serve import Server, stream  # noqa: E402

PHASES = (
    "plain",
    "kvstore-fresh",
    "kvstore-restart",
    "plain-restart",
    "kvstore-dropped",
    "kvstore-rerestart",
)
DEFAULT_PHASES = PHASES[:-1]
# Alternated over repeats; a store's fresh phase comes before its restarted ones, and
# the rerestart after them.
ORDERS = (
    PHASES,
    (
        "kvstore-fresh",
        "plain",
        "kvstore-dropped",
        "plain-restart",
        "kvstore-restart",
        "kvstore-rerestart",
    ),
)
FIRST_GUESS_S = 60.0  # --budget's guess at a phase before one has run
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)

# -- the model directory ---------------------------------------------------------------


def model_spec(args) -> dict:
    config = dict(SHAPES[args.shape], vocab_size=args.vocab)
    return {"shape": args.shape, "config": config, "tokenizer": args.tokenizer}


def build_model_dir(path: str, spec: dict) -> dict:
    """Random bf16 weights of ``spec``'s shape (seeded) saved as an mlx-lm model
    directory with the tokenizer's files. Runs in a child process."""
    sys.modules.setdefault("torch", None)  # transformers would import it: 10+ s
    import importlib

    import mlx.core as mx
    from mlx_lm.utils import save_config, save_model

    config = spec["config"]
    t0 = time.perf_counter()
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    t_build = time.perf_counter() - t0
    os.makedirs(path, exist_ok=True)
    save_model(path, model)
    save_config(
        {**config, "torch_dtype": "bfloat16"}, config_path=f"{path}/config.json"
    )
    if spec["tokenizer"] == "word":
        from kvstore.bench.models import word_tokenizer

        word_tokenizer(config["vocab_size"]).save_pretrained(path)
    else:
        for name in TOKENIZER_FILES:
            src = os.path.join(spec["tokenizer"], name)
            if os.path.exists(src):
                shutil.copy(src, os.path.join(path, name))
    with open(os.path.join(path, "bench-spec.json"), "w") as f:
        json.dump(spec, f)
    size = sum(
        os.path.getsize(os.path.join(path, n))
        for n in os.listdir(path)
        if n.endswith(".safetensors")
    )
    return {
        "build_s": t_build,
        "save_s": time.perf_counter() - t0 - t_build,
        "bytes": size,
    }


def ensure_model_dir(path: str, spec: dict) -> dict:
    """The model directory at ``path``, built unless one of the same spec is there."""
    try:
        with open(os.path.join(path, "bench-spec.json")) as f:
            if json.load(f) == spec:
                return {"reused": True}
    except (OSError, ValueError):
        pass
    shutil.rmtree(path, ignore_errors=True)
    proc = subprocess.run(
        [sys.executable, __file__, "--build", path, json.dumps(spec)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"building the model failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def default_tokenizer_dir() -> str:
    from kvstore.platform.default_model import ensure_default_model

    return ensure_default_model()


# -- the chats ------------------------------------------------------------------------


class Texts:
    """Random texts of about a given token count for the model's tokenizer."""

    def __init__(self, model_dir: str, *, word_level: bool, vocab: int):
        self.word_level = word_level
        self.vocab = vocab
        if not word_level:
            sys.modules.setdefault("torch", None)
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def make(self, seed, n: int) -> str:
        rng = random.Random(repr(seed))
        if self.word_level:  # one word, one token
            return " ".join(f"w{rng.randrange(17, self.vocab)}" for _ in range(n))
        text = " ".join(f"w{rng.randrange(1, 10000)}" for _ in range(n))
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.decode(ids[:n])


class Chat:
    """One user's conversation: its system prompt, its questions, the answers."""

    def __init__(self, user: int, workload: "Workload", texts: Texts):
        w = workload
        self.user = user
        self.system = user // 2 % w.systems  # two users per system prompt
        self.messages = [
            {
                "role": "system",
                "content": texts.make(("system", self.system), w.system_tokens),
            }
        ]
        self.questions = [texts.make(("first", user), w.first_tokens)] + [
            texts.make(("followup", user, r), w.followup_tokens)
            for r in range(1, w.rounds)
        ]

    def request(self, rnd: int, workload: "Workload") -> dict:
        self.messages.append({"role": "user", "content": self.questions[rnd]})
        return {
            "model": "default_model",
            "messages": list(self.messages),
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0,
            "max_tokens": workload.max_tokens,
            "logit_bias": {str(i): -1000.0 for i in range(workload.ban_below)},
        }

    def answer(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})


class Workload:
    """The load's sizes (see the module's docstring)."""

    def __init__(self, args):
        self.systems = args.systems
        self.system_tokens = args.system_tokens
        self.first_tokens = args.first_tokens
        self.followup_tokens = args.followup_tokens
        self.rounds = args.rounds
        self.max_tokens = args.max_tokens
        self.ban_below = args.ban_below

    def describe(self) -> dict:
        return dict(vars(self))


def run_round(port: int, bodies: List[dict], delays: Optional[List[float]] = None):
    """Every body at once (a thread each; body ``i`` ``delays[i]`` seconds later);
    the results and the round's wall time."""
    start = threading.Barrier(len(bodies))
    results: List[Optional[dict]] = [None] * len(bodies)
    errors: Dict[str, List[int]] = {}  # what went wrong: the users it happened to

    def client(i):
        start.wait()
        if delays and delays[i]:
            time.sleep(delays[i])
        try:
            r = results[i] = stream(port, bodies[i])
        except Exception as e:  # the server died (e.g. out of memory): say so
            errors.setdefault(f"{type(e).__name__}: {e}", []).append(i)
            return
        if r["completion"] is None:  # mlx-lm's generation thread died mid-stream
            why = "the stream ended early, without its usage (see the server's log)"
            errors.setdefault(why, []).append(i)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
    tic = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - tic
    return results, wall, [f"users {sorted(us)}: {why}" for why, us in errors.items()]


# -- the machine ---------------------------------------------------------------------


class GpuMemory:
    """Peak GPU memory in use (``nvidia-smi``, once a second) while it runs."""

    def __init__(self):
        self.peak_mib: Optional[int] = None
        self.total_mib: Optional[int] = None
        self._stop = threading.Event()
        self._thread = None
        if shutil.which("nvidia-smi"):
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()

    def _poll(self):
        while not self._stop.is_set():
            try:
                out = subprocess.run(
                    [
                        "nvidia-smi",
                        "--query-gpu=memory.used,memory.total",
                        "--format=csv,noheader,nounits",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=10,
                ).stdout.split("\n")[0]
                used, total = (int(x) for x in out.split(","))
                self.peak_mib = max(self.peak_mib or 0, used)
                self.total_mib = total
            except (OSError, ValueError, subprocess.SubprocessError):
                return
            self._stop.wait(1.0)

    def stop(self) -> dict:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return {"gpu_peak_mib": self.peak_mib, "gpu_total_mib": self.total_mib}


def machine() -> dict:
    out = {
        "host": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
    }
    for dist in ("mlx", "mlx-cuda-13", "mlx-cpu", "mlx-lm", "transformers"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    if shutil.which("nvidia-smi"):
        q = "--query-gpu=name,driver_version,memory.total"
        out["gpu"] = subprocess.run(
            ["nvidia-smi", q, "--format=csv,noheader"], capture_output=True, text=True
        ).stdout.strip()
    return out


def drop_page_cache(mode: str) -> dict:
    """Drop the page cache (root, Linux); what happened, for the sample."""
    if mode == "skip":
        return {"page_cache_dropped": False, "note": "not dropped (--drop-caches skip)"}
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return {"page_cache_dropped": True}
    except OSError as e:
        return {"page_cache_dropped": False, "note": f"not permitted here: {e}"}


# -- a phase ---------------------------------------------------------------------------


class Phase:
    """One phase: a server process, its warm-up, the rounds, its counters."""

    def __init__(self, args, model_dir: str, texts: Texts, workload: Workload):
        self.args = args
        self.model_dir = model_dir
        self.texts = texts
        self.workload = workload
        self.launcher = [sys.executable, os.path.abspath(__file__), "--launch"]

    def command(self, phase: str, store: Optional[str]) -> List[str]:
        extra = self.args.server_args.split()
        if not phase.startswith("kvstore"):  # plain, plain-restart, prime
            return ["mlx_lm", "server", "--model", self.model_dir, *extra]
        return [
            "kvstore",
            "serve",
            "--model",
            self.model_dir,
            "--store",
            store,
            "--api-metrics",  # this benchmark's only client reads the counters
            *extra,
            *self.args.kvstore_args.split(),
        ]

    def warm_up_body(self) -> dict:
        w = self.workload
        return {
            "model": "default_model",
            "messages": [{"role": "user", "content": self.texts.make("warm-up", 32)}],
            "stream": True,
            "temperature": 0,
            "max_tokens": 2,
            "logit_bias": {str(i): -1000.0 for i in range(w.ban_below)},
        }

    def run(
        self,
        phase: str,
        users: int,
        store: Optional[str],
        log_dir: str,
        *,
        rounds: Optional[int] = None,
    ) -> dict:
        out: Dict[str, object] = {"phase": phase, "users": users}
        if phase == "kvstore-fresh":
            shutil.rmtree(store, ignore_errors=True)
        if phase == "kvstore-dropped":
            out.update(drop_page_cache(self.args.drop_caches))
        os.makedirs(log_dir, exist_ok=True)
        name = "kvstore" if phase.startswith("kvstore") else "plain"
        log = os.path.join(log_dir, f"{name}.log")
        stacks = os.path.join(log_dir, f"{name}-stacks.jsonl")
        for old in (log, stacks):  # an earlier run's: the server appends
            if os.path.exists(old):
                os.remove(old)
        memory = GpuMemory()
        tic = time.perf_counter()
        server = None
        if self.args.sample_stacks:
            os.environ["BENCH_STACKS"] = stacks
        try:
            server = Server(
                name, self.command(phase, store), log_dir, launcher=self.launcher
            )
            out["start_s"] = time.perf_counter() - tic
            self._rounds(server, users, out, rounds or self.workload.rounds)
        except Exception as e:  # one failed phase does not end the run: say why
            out["error"] = f"{type(e).__name__}: {e}"
        finally:
            if server is not None:
                server.stop()
            out.update(memory.stop())
            out["phase_s"] = time.perf_counter() - tic
        out["log_lines"] = kvstore_log(log)
        out["prefetches"] = kvstore_prefetches(log)
        if self.args.sample_stacks:
            round_steps(out, os.environ["BENCH_STACKS"])
        return out

    def _wave_round(self, server: Server, users: int) -> dict:
        """A priming round of half as many other users, in two waves (:func:`waves`):
        with all of them, prompts joining a batch mid-prefill ran plain
        ``mlx_lm.server`` out of memory on an 80 GB H100 (8 users, 6.5K tokens)."""
        n = max(2, users // 2)
        bodies = first_questions(self, users, n)
        _, wall, errors = run_round(server.port, bodies, waves(n))
        return {"users": n, "wall_s": wall, "errors": errors}

    def _rounds(self, server: Server, users: int, out: dict, rounds: int) -> None:
        tic = time.perf_counter()
        warm = stream(server.port, self.warm_up_body())
        out["warm_up_s"] = time.perf_counter() - tic
        out["warm_up_tokens"] = warm["completion"]
        server.settle()
        chats = [Chat(u, self.workload, self.texts) for u in range(users)]
        out["rounds"] = []
        for rnd in range(rounds):
            if out["phase"] == "prime" and rnd == 0:
                out["wave_round"] = self._wave_round(server, users)
            bodies = [chat.request(rnd, self.workload) for chat in chats]
            if out["phase"] == "prime" and rnd == rounds - 1:
                stagger(bodies)  # the final one: answers make the next prompts
            results, wall, errors = run_round(server.port, bodies)
            if errors:
                out["error"] = f"round {rnd + 1}: " + "; ".join(errors)
                return
            for chat, r in zip(chats, results):
                chat.answer(r["text"])
            out["rounds"].append(round_record(results, wall))
        out["drain_s"] = server.settle()
        if server.name == "kvstore":
            stats = server.get("/kvstore/stats")
            out["kvstore"] = {k: v for k, v in stats.items() if k != "stores"}
            out["store"] = stats["stores"][0] if stats["stores"] else None


def round_steps(out: dict, stacks: str) -> None:
    """Put on each round (``--sample-stacks``) the generation loop's steps from its
    requests' sending to its last first token: ``[seconds after sending, seconds
    taken, prompts, generated tokens]`` each (tools/stack_sampler.py's step lines)."""
    try:
        with open(stacks) as f:
            steps = [s for s in map(json.loads, f) if s.get("thread") == "step"]
    except (OSError, ValueError):
        return
    for rnd in out.get("rounds", []):
        sent = min(r["sent_at"] for r in rnd["requests"])
        last = sent + max(r["ttft_s"] for r in rnd["requests"])
        rnd["steps"] = [
            [round(s["t"] - sent, 4), s["dur"], s["prompts"], s["tokens"]]
            for s in steps
            if sent <= s["t"] <= last
        ]


def waves(users: int) -> List[float]:
    """Send the second half of the users 0.5 s after the first: their prompts join a
    batch while it prefills, whose first time on a machine compiles MLX's kernels
    for it (7.5 s of every stream on an H200: a plain server pays it whenever a
    request arrives late, as one of eight did through the listen backlog)."""
    return [0.0 if u < (users + 1) // 2 else 0.5 for u in range(users)]


def first_questions(phase: "Phase", first_user: int, users: int) -> List[dict]:
    """Round-1 requests of ``users`` chats numbered from ``first_user``."""
    w = phase.workload
    return [Chat(first_user + u, w, phase.texts).request(0, w) for u in range(users)]


def stagger(bodies: List[dict]) -> None:
    """Give each request one output token fewer than the one before: the batch then
    drops members one step at a time, whose first time on a machine compiles MLX's
    kernels for it (3-4 s of every stream on an H100; the measured rounds' requests
    end together in a plain server, not always in kvstore's)."""
    for i, body in enumerate(bodies):
        body["max_tokens"] = max(1, body["max_tokens"] - i)


def round_record(results: List[dict], wall: float) -> dict:
    requests = []
    for user, r in enumerate(results):
        span = (r["last_at"] or 0) - (r["first_at"] or 0)
        n = r["completion"] if r["completion"] is not None else r["tokens"]
        requests.append(
            {
                "user": user,
                "ttft_s": r["ttft"],
                "sent_at": r.get("sent_at"),
                "seconds": r["seconds"],
                "prompt_tokens": r["prompt"],
                "cached_tokens": r["cached"],
                "completion_tokens": n,
                "streamed_events": r["tokens"],
                "decode_tok_s": (r["tokens"] - 1) / span if span > 0 else None,
                "max_gap_s": r["max_gap"],
                "retries": r["retries"],
            }
        )
    tokens = sum(q["completion_tokens"] or 0 for q in requests)
    return {
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tok_s": tokens / wall,
        "requests": requests,
    }


def kvstore_log(path: str) -> Dict[str, int]:
    """How kvstore's per-request log lines say each prompt was served."""
    counts: Dict[str, int] = {}
    try:
        with open(path, errors="replace") as f:
            for line in f:
                if "kvstore: prompt " in line and " reused " in line:
                    how = line.split("(", 1)[1].split(")", 1)[0]
                    counts[how] = counts.get(how, 0) + 1
                elif "dropped" in line and "kvstore" in line:
                    counts["save_dropped_lines"] = (
                        counts.get("save_dropped_lines", 0) + 1
                    )
    except (OSError, IndexError):
        pass
    return counts


# kvstore serve's DEBUG line for each prefetch (kvstore/serve/prompt_cache.py).
_PREFETCH = re.compile(
    r"^(\S+ \S+) - DEBUG - kvstore: prefetch of (\d+) tokens \((\d+) in RAM\): "
    r"waited ([\d.]+) ms \(for (joins|a shared prefix)\), "
    r"restored (nothing|\d+-\d+) in ([\d.]+) ms"
)


def kvstore_prefetches(path: str) -> List[dict]:
    """Each prefetch the server logged at DEBUG (``--kvstore-args
    "--kvstore-log-level DEBUG"``): when it ended (the log's local time, as Unix
    seconds), its prompt, what RAM held, how long it waited and for what, what it
    restored (``[start, end]`` tokens, None: nothing) and in how long."""
    out = []
    try:
        with open(path, errors="replace") as f:
            for line in f:
                m = _PREFETCH.match(line)
                if m is None:
                    continue
                stamp, tokens, held, waited, why, restored, ms = m.groups()
                day, clock = stamp.split(" ")
                whole, frac = clock.split(",")
                t = time.mktime(time.strptime(f"{day} {whole}", "%Y-%m-%d %H:%M:%S"))
                out.append(
                    {
                        "t": t + int(frac) / 1000,
                        "tokens": int(tokens),
                        "held": int(held),
                        "waited_ms": float(waited),
                        "joined": why == "a shared prefix",
                        "restored": (
                            None
                            if restored == "nothing"
                            else [int(x) for x in restored.split("-")]
                        ),
                        "ms": float(ms),
                    }
                )
    except OSError:
        pass
    return out


# -- the run ---------------------------------------------------------------------------


def plan(users: List[int], repeats: int, phases: List[str]) -> List[tuple]:
    """(repeat, users, phase) in the order they run."""
    steps = []
    for rep in range(repeats):
        order = [p for p in ORDERS[rep % 2] if p in phases]
        for u in users if rep % 2 == 0 else users[::-1]:
            steps += [(rep, u, p) for p in order]
    return steps


def run(args) -> dict:
    t_start = time.perf_counter()
    os.makedirs(args.dir, exist_ok=True)
    logs = args.logs or os.path.join(args.dir, "logs")
    spec = model_spec(args)
    if spec["tokenizer"] is None:
        spec["tokenizer"] = default_tokenizer_dir()
    model_dir = args.model_dir or os.path.join(args.dir, "model")
    print(f"model directory {model_dir}: {json.dumps(spec['config'])}", flush=True)
    built = ensure_model_dir(model_dir, spec)
    print(f"model: {json.dumps(built)}", flush=True)
    workload = Workload(args)
    texts = Texts(model_dir, word_level=args.tokenizer == "word", vocab=args.vocab)
    data = {
        "tool": "tools/bench_serve_gpu.py",
        "command": " ".join(["tools/bench_serve_gpu.py", *sys.argv[1:]]),
        "machine": machine(),
        "model": {**spec, "dir": model_dir, **built},
        "workload": workload.describe(),
        "args": vars(args),
        "samples": [],
        "notes": [],
    }
    phase = Phase(args, model_dir, texts, workload)
    if args.prime:
        # The first large batched prefills on a machine compile MLX's kernels
        # (seconds): discarded plain rounds, so that no measured phase pays for them.
        users, rounds = max(args.users), min(2, args.rounds)
        sample = phase.run(
            "prime", users, None, os.path.join(logs, "prime"), rounds=rounds
        )
        data["priming"] = sample
        print(
            f"priming ({users} users, {rounds} round(s), not measured): "
            + (sample.get("error") or f"{sample['phase_s']:.1f} s"),
            flush=True,
        )
        restarted = ("kvstore-restart", "kvstore-dropped", "kvstore-rerestart")
        if any(p in args.phases for p in restarted):
            data["priming_kvstore"] = prime_restores(phase, args, users, logs)
    else:
        note = (
            "--no-prime: the first phase compiled MLX's kernels (seconds in its round "
            "1 on a fresh machine); its figures, and ratios against them, are no "
            "measure"
        )
        data["notes"].append(note)
        print(f"note: {note}", flush=True)
    steps = plan(args.users, args.repeats, args.phases)
    durations: Dict[int, float] = {}  # the longest phase seen, per --users value
    for i, (rep, users, name) in enumerate(steps):
        elapsed = time.perf_counter() - t_start
        guess = durations.get(users, max(durations.values(), default=FIRST_GUESS_S))
        if args.budget and elapsed + guess > args.budget:
            note = f"stopped before {name} (users {users}, repeat {rep}): --budget"
            print(note, flush=True)
            data["notes"].append(note)
            break
        store = os.path.join(args.dir, f"store-u{users}-r{rep}")
        log_dir = os.path.join(logs, f"r{rep}-u{users}-{name}")
        sample = phase.run(name, users, store, log_dir)
        sample.update(repeat=rep, position=i)
        durations[users] = max(durations.get(users, 0.0), sample["phase_s"])
        data["samples"].append(sample)
        print(summary_line(sample), flush=True)
        if args.json:
            write_json(args.json, data)
        done = all((r, u) != (rep, users) for r, u, _ in steps[i + 1 :])
        if done and not args.keep_stores:
            shutil.rmtree(store, ignore_errors=True)  # this store's phases are done
    data["table"] = report(data)
    if args.json:
        write_json(args.json, data)
    return data


def prime_restores(phase: "Phase", args, users: int, logs: str) -> List[dict]:
    """A discarded round of ``kvstore serve`` on a scratch store, then one after a
    restart: returning users' requests join a running batch one by one as their
    restores end, whose first time on a machine compiles MLX's kernels for it (6 s
    of every stream in a restarted 8-user round on an H100; plain's priming rounds
    never insert into a running batch)."""
    store = os.path.join(args.dir, "store-prime")
    samples = []
    for name in ("kvstore-fresh", "kvstore-restart"):
        sample = phase.run(
            name, users, store, os.path.join(logs, f"prime-{name}"), rounds=1
        )
        samples.append(sample)
        print(
            f"priming {name} ({users} users, 1 round, not measured): "
            + (sample.get("error") or f"{sample['phase_s']:.1f} s"),
            flush=True,
        )
    shutil.rmtree(store, ignore_errors=True)
    return samples


def write_json(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def summary_line(s: dict) -> str:
    head = f"r{s['repeat']} u={s['users']:>2} {s['phase']:<16}"
    if s.get("error"):
        return f"{head} ERROR {s['error']}"
    ttft = " ".join(
        f"{statistics.median(q['ttft_s'] for q in r['requests']):6.2f}"
        for r in s["rounds"]
    )
    agg = sum(r["output_tokens"] for r in s["rounds"]) / sum(
        r["wall_s"] for r in s["rounds"]
    )
    line = f"{head} TTFT s {ttft}  agg {agg:6.1f} tok/s  phase {s['phase_s']:5.1f} s"
    store = s.get("store") or {}
    if store:
        line += (
            f"  restores {store.get('restores_chosen')} dropped "
            f"{store.get('writes_dropped')} written {store.get('bytes_written', 0) / 1e9:.2f} GB"
        )
    if s.get("gpu_peak_mib"):
        line += f"  GPU peak {s['gpu_peak_mib'] / 1024:.1f} GiB"
    return line


# -- the tables --------------------------------------------------------------------------


def _med(xs) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


class Figures:
    """Medians of one phase at one ``--users`` value, over its repeats."""

    def __init__(self, samples: List[dict]):
        self.samples = [s for s in samples if not s.get("error") and s.get("rounds")]
        self.rounds = max((len(s["rounds"]) for s in self.samples), default=0)

    def _requests(self, rnd: int) -> List[dict]:
        return [
            q
            for s in self.samples
            if rnd < len(s["rounds"])
            for q in s["rounds"][rnd]["requests"]
        ]

    def ttft(self, rnd: int) -> Optional[float]:
        return _med(q["ttft_s"] for q in self._requests(rnd))

    def decode(self, rnd: Optional[int] = None) -> Optional[float]:
        rounds = range(self.rounds) if rnd is None else [rnd]
        return _med(q["decode_tok_s"] for r in rounds for q in self._requests(r))

    def aggregate(self) -> Optional[float]:
        return _med(
            sum(r["output_tokens"] for r in s["rounds"])
            / sum(r["wall_s"] for r in s["rounds"])
            for s in self.samples
        )

    def store_sum(self, key: str, *, part: str = "store") -> Optional[float]:
        """The sum over the samples of a counter of the store (``part`` "store")
        or of the server (``part`` "kvstore": ``/kvstore/stats``)."""
        xs = [(s.get(part) or {}).get(key) for s in self.samples]
        xs = [x for x in xs if x is not None]
        return sum(xs) if xs else None

    def saves_lost(self) -> Optional[float]:
        """Saves that never reached the disk: deferred ones whose prefix left RAM."""
        return self.store_sum("saves_lost", part="kvstore")


def _cell(value: Optional[float], base: Optional[float], fmt: str) -> str:
    if value is None:
        return "-"
    if base:
        return f"{value:{fmt}} ({value / base:.2f}x)"
    return f"{value:{fmt}}"


def report(data: dict) -> List[str]:
    """Tables (one per ``--users`` value) and verdicts against the targets; kvstore's
    phases as ratios of the two plain phases' pooled samples (a plain server keeps
    nothing across a restart)."""
    samples = data["samples"]
    rows: List[str] = []
    for users in sorted({s["users"] for s in samples}):
        mine = [s for s in samples if s["users"] == users]
        plain = Figures([s for s in mine if s["phase"].startswith("plain")])
        n_rounds = max(
            (Figures([s for s in mine if s["phase"] == p]).rounds for p in PHASES),
            default=0,
        )
        if not n_rounds:
            rows += ["", f"{users} user(s): no phase finished a round (below)"]
            continue
        rows += [
            "",
            f"{users} user(s): TTFT s (median over users and repeats), decode tok/s "
            "(median per stream), aggregate output tok/s (median over repeats); "
            "(x) = of plain",
            "",
            "| phase | "
            + " | ".join(f"TTFT round {r + 1}" for r in range(n_rounds))
            + " | "
            + " | ".join(f"decode round {r + 1}" for r in range(n_rounds))
            + " | aggregate | samples | restores / saves lost / GB written |",
            "|---|" + "---|" * (2 * n_rounds + 3),
        ]
        figures = {}
        for name in PHASES:
            f = Figures([s for s in mine if s["phase"] == name])
            errors = [s for s in mine if s["phase"] == name and s.get("error")]
            if not f.samples and not errors:
                continue
            figures[name] = f
            base = None if name.startswith("plain") else plain
            cells = [
                _cell(f.ttft(r), base and base.ttft(r), ".2f") for r in range(n_rounds)
            ]
            cells += [
                _cell(f.decode(r), base and base.decode(r), ".1f")
                for r in range(n_rounds)
            ]
            cells.append(_cell(f.aggregate(), base and base.aggregate(), ".1f"))
            cells.append(
                f"{len(f.samples)}" + (f" ({len(errors)} failed)" if errors else "")
            )
            if name.startswith("kvstore"):
                written = f.store_sum("bytes_written")
                cells.append(
                    f"{f.store_sum('restores_chosen')} / {f.saves_lost()}"
                    f" / {written / 1e9:.2f}"
                    if written is not None
                    else "-"
                )
            else:
                cells.append("")
            rows.append(f"| {name} | " + " | ".join(cells) + " |")
        rows += [""] + verdicts(figures, plain, n_rounds, users)
        rows += step_rows(mine, n_rounds)
    for s in samples:
        if s.get("error"):
            rows.append(
                f"failed: repeat {s['repeat']}, {s['users']} users, {s['phase']}: {s['error']}"
            )
        if s["phase"] == "kvstore-dropped" and not s.get("page_cache_dropped"):
            rows.append(
                f"note: repeat {s['repeat']}, {s['users']} users: page cache {s.get('note')}"
            )
    return rows + data.get("notes", [])


def step_rows(samples: List[dict], n_rounds: int) -> List[str]:
    """With ``--sample-stacks``: each sample's steps up to its round's last first
    token: the wait from sending to the first step, the prompt steps' seconds, and
    the first decode step's."""
    timed = [s for s in samples if any("steps" in r for r in s.get("rounds", []))]
    if not timed:
        return []
    rows = [
        "",
        "steps to the first token, s: wait for the first step / prompt steps / "
        "first decode step",
        "",
        "| phase | repeat | "
        + " | ".join(f"round {r + 1}" for r in range(n_rounds))
        + " |",
        "|---|---|" + "---|" * n_rounds,
    ]
    for s in timed:
        cells = []
        for rnd in s["rounds"]:
            steps = rnd.get("steps") or []
            prompt = [f"{d:.3f}" for _, d, p, _ in steps if p]
            decode = [d for _, d, p, t in steps if not p and t]
            cells.append(
                f"{steps[0][0]:.3f} / {'+'.join(prompt) or '-'} / "
                + (f"{decode[0]:.3f}" if decode else "-")
                if steps
                else "-"
            )
        cells += ["-"] * (n_rounds - len(cells))
        rows.append(
            f"| {s['phase']} | {s.get('repeat', '-')} | " + " | ".join(cells) + " |"
        )
    return rows


def verdicts(
    figures: Dict[str, Figures], plain: Figures, n: int, users: int
) -> List[str]:
    """The targets, each PASS or MISS with its ratio (ratios of medians)."""
    out = []

    def check(label, value, base, ok):
        if value is None or not base:
            return
        ratio = value / base
        out.append(
            f"{users} users, {label}: {ratio:.2f}x ({'PASS' if ok(ratio) else 'MISS'})"
        )

    fresh = figures.get("kvstore-fresh")
    if fresh:
        check(
            "fresh aggregate >= 0.97x",
            fresh.aggregate(),
            plain.aggregate(),
            lambda x: x >= 0.97,
        )
        for r in range(n):
            check(
                f"fresh decode round {r + 1} >= 0.95x",
                fresh.decode(r),
                plain.decode(r),
                lambda x: x >= 0.95,
            )
            check(
                f"fresh TTFT round {r + 1} <= 1.05x",
                fresh.ttft(r),
                plain.ttft(r),
                lambda x: x <= 1.05,
            )
        lost = fresh.saves_lost()
        if lost is not None:
            out.append(
                f"{users} users, fresh saves lost = 0: {lost} ({'PASS' if lost == 0 else 'MISS'})"
            )
    for name, label in (
        ("kvstore-restart", "restart"),
        ("kvstore-rerestart", "restart again (rates kept)"),
    ):
        restart = figures.get(name)
        if not restart:
            continue
        for r in range(n):
            limit = 0.5 if r == 0 else 1.0
            check(
                f"{label} TTFT round {r + 1} <= {limit}x",
                restart.ttft(r),
                plain.ttft(r),
                lambda x, l=limit: x <= l,
            )
        check(
            f"{label} aggregate >= 0.97x",
            restart.aggregate(),
            plain.aggregate(),
            lambda x: x >= 0.97,
        )
    cold = figures.get("kvstore-dropped")
    if cold and n:
        check(
            "page cache dropped, TTFT round 1 <= 1.0x",
            cold.ttft(0),
            plain.ttft(0),
            lambda x: x <= 1.0,
        )
    return out


# -- entry points ------------------------------------------------------------------------


def launch(argv: List[str]) -> None:
    """``python -m MODULE ARGS`` without PyTorch (transformers would import it: 10+ s)."""
    import runpy

    sys.modules["torch"] = None
    stacks = os.environ.get("BENCH_STACKS")
    if stacks:  # --sample-stacks
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from stack_sampler import StackSampler

        sampler = StackSampler(stacks)
        sampler.start()
        sampler.trace_steps()  # imports mlx_lm.generate: after torch is kept out
    sys.argv = argv
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--launch"]:
        launch(argv[1:])
        return 0
    if argv[:1] == ["--build"]:
        print(json.dumps(build_model_dir(argv[1], json.loads(argv[2]))))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    p.add_argument("--vocab", type=int, default=49152, help="the tokenizer's")
    p.add_argument(
        "--tokenizer",
        help="a directory with tokenizer files (default: the default model's), or "
        "'word' (a word-level tokenizer built here: one token per word)",
    )
    p.add_argument("--users", type=int, nargs="+", default=[8])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--systems", type=int, default=4, help="system prompts")
    p.add_argument("--system-tokens", type=int, default=6000)
    p.add_argument("--first-tokens", type=int, default=500)
    p.add_argument("--followup-tokens", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ban-below", type=int, default=17, help="ids banned by logit bias")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--phases", nargs="+", choices=PHASES, default=list(DEFAULT_PHASES))
    p.add_argument(
        "--sample-stacks",
        action="store_true",
        help="each server samples its threads' stacks into LOGS/PHASE/NAME-stacks.jsonl "
        "(tools/stack_sampler.py)",
    )
    p.add_argument(
        "--drop-caches",
        choices=("auto", "skip"),
        default="auto",
        help="kvstore-dropped: drop the page cache (auto: where permitted)",
    )
    p.add_argument(
        "--no-prime",
        dest="prime",
        action="store_false",
        help="skip the discarded plain round that compiles the kernels first",
    )
    p.add_argument("--server-args", default="", help="extra flags for both servers")
    p.add_argument("--kvstore-args", default="", help="extra flags for kvstore serve")
    p.add_argument("--dir", help="work directory (model, stores, logs)")
    p.add_argument(
        "--keep-stores",
        action="store_true",
        help="keep the stores at the end (a later run's kvstore-restart reuses them)",
    )
    p.add_argument("--model-dir", help="the model directory (default: DIR/model)")
    p.add_argument("--logs", help="server logs here (default: DIR/logs)")
    p.add_argument("--json", help="every sample, rewritten after each phase")
    p.add_argument(
        "--budget", type=float, help="seconds: start no phase that would end later"
    )
    p.add_argument("--report", metavar="JSON", help="print the tables of a run")
    args = p.parse_args(argv)
    if args.report:
        with open(args.report) as f:
            print("\n".join(report(json.load(f))))
        return 0
    if not args.dir:
        p.error("--dir is required")
    data = run(args)
    print("\n".join(data["table"]))
    if args.json:
        print(f"\nevery sample: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
