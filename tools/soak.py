"""Soak test: one budgeted store used by many processes for minutes, as in production.

What runs at once on one store (``--dir``/store, a disk budget recorded in it):

* ``kvstore serve --salt-header X-Tenant --salt-disk-bytes`` with ``--clients``
  concurrent clients (tenants by header, some narrowing with a body ``cache_salt``, a
  few with a header and body salt over 256 bytes together: each an answer or a 400,
  never the end of the generation thread);
* ``--writers`` library writer processes (``KVStore.prefill`` + ``flush``, unsalted
  and salted, some pinning their system prompt), each acknowledging a prompt once
  ``flush`` returned with no failed or dropped write;
* ``kvstore prefill`` runs of small prompt files (salted and pinned lines too),
  acknowledged when the command exits 0;
* a reader process fetching acknowledged prompts and comparing each restore with
  the KV recomputed from scratch, and a second one doing the same a few descriptors
  short of its ``RLIMIT_NOFILE`` half of the time;
* ``kvstore gc --max-bytes`` (every third one deep: most of the store in one
  transaction), ``kvstore verify`` and ``kvstore pull`` (from a moto S3 server a second
  store pushed to) on timers;
* a SIGKILL every ``--kill-every`` seconds of a random one of them, restarted;
* every process opening the index with a small LMDB map (``--map-bytes``, through
  ``KVSTORE_INITIAL_MAP_BYTES``), so the map grows many times while the others read
  and write.

At the end, with everything stopped: ``verify`` is clean before and after a ``gc``,
the store opens, every acknowledged prompt restores bit-identically to KV recomputed
from scratch (or its missing part is accounted for by a budgeted eviction: nothing
was quarantined and evictions happened; a pinned prompt is never missing), every
stored prompt of every tree restores bit-identically (as far as the walk reaches it:
a longer sibling diverging near its end can shadow its last tokens), each
tenant's trees fit its quota, no process reported corruption (no quarantined file,
no "is broken" log line, ``corrupt`` 0 in every process's stats), no traceback in
any log, and the server never stayed up unable to answer. Prints the figures and
the failures; exit status 0 only when there are none.

    python tools/soak.py --seconds 300 --json soak.json

The model is a random-weight llama built here (float32, word-level tokenizer, one
token per word): its KV recomputed from scratch is bit-identical to what a store
holds. Needs the ``test`` extra (moto) for the remote; ``--no-remote`` runs without.
"""

import argparse
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from typing import Any, Dict, List, Optional

VOCAB = 512
FIRST_WORD = 8  # tokens below are special or the chat template's role words
HERE = os.path.abspath(__file__)
TENANTS = [f"tenant-{i}" for i in range(3)]
NARROW = ["a", "b", "c", "d", "e"]  # body cache_salts narrowing a tenant's tree
LONG_TENANT, LONG_NARROW = "t" * 200, "b" * 60  # over 256 bytes together

# -- the model and the prompts ----------------------------------------------------------


def build_model(path: str) -> str:
    """Write a tiny random-weight float32 llama (2 layers, one KV head of 16: 256 bytes
    of KV a token) and a word-level tokenizer as an mlx-lm model directory."""
    import dataclasses

    import mlx.core as mx
    from mlx_lm.utils import save_config, save_model

    from kvstore.bench.models import tiny_model, word_tokenizer

    model = tiny_model(layers=2, heads=1, head_dim=16, vocab=VOCAB, dtype=mx.float32)
    save_model(path, model)
    config = {k: v for k, v in dataclasses.asdict(model.args).items() if v is not None}
    save_config(config, config_path=os.path.join(path, "config.json"))
    word_tokenizer(VOCAB).save_pretrained(path)
    return path


def random_tokens(rng: random.Random, n: int) -> List[int]:
    return [rng.randrange(FIRST_WORD, VOCAB) for _ in range(n)]


def system_prompts(seed: int, count: int = 6) -> List[List[int]]:
    """Shared system prompts: the prefixes every writer's prompts start from."""
    rng = random.Random(seed)
    return [random_tokens(rng, rng.randrange(280, 700)) for _ in range(count)]


def words(tokens: List[int]) -> str:
    return " ".join(f"w{t}" for t in tokens)


def recompute(model, tokens: List[int]):
    """KV of ``tokens`` computed from scratch."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def same_kv(model, cache, tokens: List[int], n: int) -> bool:
    """Whether the first ``n`` positions of ``cache`` are bit-identical to the KV of
    ``tokens[:n]`` recomputed from scratch."""
    import mlx.core as mx

    ref = recompute(model, tokens[:n])
    return all(
        mx.array_equal(got.keys[..., :n, :], want.keys[..., :n, :]).item()
        and mx.array_equal(got.values[..., :n, :], want.values[..., :n, :]).item()
        for got, want in zip(cache, ref)
    )


# -- the small LMDB map ------------------------------------------------------------------


def small_map(nbytes: int) -> None:
    """Open every index of this process, and of the processes it starts, with an LMDB
    map of ``nbytes`` (it grows)."""
    from kvstore.disk.index import INITIAL_MAP_ENV

    os.environ[INITIAL_MAP_ENV] = str(nbytes)


def map_size(data_mdb: str) -> Optional[int]:
    """The map size the newest meta page of an LMDB ``data.mdb`` records (None if
    unreadable): ``mm_mapsize`` at offset 32, the newer page by ``mm_txnid``."""
    try:
        with open(data_mdb, "rb") as f:
            first = f.read(4096 + 152)
    except OSError:
        return None
    metas = []
    for off in (0, 4096):
        page = first[off : off + 152]
        if len(page) == 152 and struct.unpack_from("<I", page, 16)[0] == 0xBEEFC0DE:
            txnid = struct.unpack_from("<Q", page, 144)[0]
            metas.append((txnid, struct.unpack_from("<Q", page, 32)[0]))
    return max(metas)[1] if metas else None


# -- worker processes (``soak.py worker ROLE ...``) -------------------------------------


def emit(msg: Dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def stopping_flag() -> threading.Event:
    """Install the SIGTERM handler, then say so: the harness sends SIGTERM only
    after the ``ready`` line (before it, SIGTERM would kill the worker)."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    emit({"ready": True})
    return stop


def counters(stats: Dict[str, Any]) -> Dict[str, Any]:
    keys = ("corrupt", "errors", "nodes_evicted", "writes_failed", "writes_dropped")
    return {k: stats[k] for k in keys} | {"problem": stats["store_problem"]}


def worker_writer(a) -> int:
    """Prefill prompts (a system prompt + a random tail), acknowledge each."""
    from mlx_lm import load

    from kvstore import KVStore

    stop = stopping_flag()
    small_map(a.map_bytes)
    model, tokenizer = load(a.model)
    rng = random.Random(a.seed)
    systems = system_prompts(a.prompt_seed)
    with KVStore(
        a.store, model, tokenizer, disk_bytes=a.disk_bytes, ram_bytes=1 << 20
    ) as store:
        while not stop.is_set():
            system = rng.choice(systems)
            pin = rng.random() < a.pin_rate
            tokens = (
                system if pin else system + random_tokens(rng, rng.randrange(40, 500))
            )
            before = store.stats()
            store.prefill(
                tokens,
                kind=rng.choice(["system", "user", "assistant"]),
                pin=pin,
                boundaries=() if pin else (len(system),),
                salt=a.salt,
            )
            store.flush()
            after = store.stats()
            ok = not after["store_problem"] and all(
                after[k] == before[k] for k in ("writes_failed", "writes_dropped")
            )
            emit(
                {
                    "ack": ok,
                    "tokens": tokens,
                    "salt": a.salt,
                    "pin": pin,
                    **counters(after),
                }
            )
            stop.wait(rng.random() * a.pause)  # leave the CPU to the others too
        emit({"final": counters(store.stats())})
    return 0


def _hold_descriptors(spare: int) -> List[int]:
    """Open /dev/null until EMFILE, then close ``spare`` of them: the process is
    ``spare`` descriptors short of its limit."""
    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    for _ in range(min(spare, len(held))):
        os.close(held.pop())
    return held


def worker_reader(a) -> int:
    """Fetch acknowledged prompts; compare every restore with recomputed KV."""
    import resource

    from mlx_lm import load

    from kvstore import KVStore

    stop = stopping_flag()
    small_map(a.map_bytes)
    model, tokenizer = load(a.model)
    rng = random.Random(a.seed)
    if a.fd_pressure:  # a low limit: few descriptors to fill
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 256), hard))
    acked, offset = [], 0
    figures = Counter()
    last_report = time.monotonic()
    with KVStore(a.store, model, tokenizer, ram_bytes=0) as store:
        while not stop.is_set():
            with open(a.acks, "rb") as f:
                f.seek(offset)
                data = f.read()
            cut = data.rfind(b"\n") + 1
            offset += cut
            acked += [json.loads(line) for line in data[:cut].splitlines()]
            if not acked:
                time.sleep(0.2)
                continue
            held = []
            if a.fd_pressure and rng.random() < 0.5:
                held = _hold_descriptors(rng.randrange(0, 5))
                figures["pressure_rounds"] += 1
            try:
                for _ in range(8):
                    p = rng.choice(acked)
                    tokens = p["tokens"] + random_tokens(rng, rng.randrange(1, 20))
                    cache, n = store.fetch(tokens, salt=p["salt"])
                    figures["fetches"] += 1
                    figures["hits"] += n > 0
                    if n and not same_kv(model, cache, tokens, n):
                        figures["wrong"] += 1
            finally:
                for fd in held:
                    os.close(fd)
            if time.monotonic() - last_report > 1:
                emit({"progress": dict(figures), **counters(store.stats())})
                last_report = time.monotonic()
        emit({"final": counters(store.stats()), "progress": dict(figures)})
    return 0


def worker_cli(a) -> int:
    """``kvstore ARGV`` with the small LMDB map."""
    from kvstore import cli

    small_map(a.map_bytes)
    return cli.main(a.argv)


def worker_main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(prog="soak.py worker")
    p.add_argument("role", choices=["writer", "reader", "cli"])
    p.add_argument("--store")
    p.add_argument("--model")
    p.add_argument("--map-bytes", type=int, required=True)
    p.add_argument("--disk-bytes", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-seed", type=int, default=0)
    p.add_argument("--salt")
    p.add_argument("--pin-rate", type=float, default=0.0)
    p.add_argument("--pause", type=float, default=1.0)
    p.add_argument("--acks")
    p.add_argument("--fd-pressure", action="store_true")
    p.add_argument("argv", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    if a.argv and a.argv[0] == "--":
        a.argv = a.argv[1:]
    return {"writer": worker_writer, "reader": worker_reader, "cli": worker_cli}[
        a.role
    ](a)


# -- the orchestrator --------------------------------------------------------------------


def http(port: int, path: str, body=None, headers=None, timeout=60):
    """``(status, json or None)``; status 0: no connection."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except ValueError:
            return e.code, None
    except (OSError, ValueError):
        return 0, None


class Proc:
    """A child process with its log file; JSON lines on its stdout go to
    ``on_line`` (when given), everything else to the log."""

    def __init__(self, soak: "Soak", role: str, argv: List[str], on_line=None):
        soak.started[role] += 1
        self.role = role
        self.name = f"{role}-{soak.started[role]}"
        self.log_path = os.path.join(soak.logs, self.name + ".log")
        self.log = open(self.log_path, "wb")
        self.on_line = on_line
        self.killed = False
        self.ready = threading.Event()  # the worker's SIGTERM handler is installed
        self.lines: List[dict] = []
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE if on_line else self.log,
            stderr=self.log,
            env=soak.env,
        )
        self.reader = None
        if on_line:
            self.reader = threading.Thread(target=self._read, daemon=True)
            self.reader.start()

    def _read(self):
        for raw in self.proc.stdout:
            try:
                msg = json.loads(raw)
            except ValueError:
                self.log.write(raw)
                continue
            if msg.get("ready"):
                self.ready.set()
                continue
            self.lines.append(msg)
            self.on_line(self, msg)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.killed = True
        self.proc.send_signal(signal.SIGKILL)
        self.wait(30)

    def wait(self, timeout: float) -> Optional[int]:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        if self.reader is not None:
            self.reader.join(10)
        return rc

    def output(self) -> str:
        self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()


class Soak:
    def __init__(self, a):
        self.a = a
        self.rng = random.Random(a.seed)
        self.dir = a.dir
        self.store = os.path.join(a.dir, "store")
        self.logs = os.path.join(a.dir, "logs")
        self.acks_path = os.path.join(a.dir, "acked.jsonl")
        os.makedirs(self.logs, exist_ok=True)
        open(self.acks_path, "wb").close()
        small_map(a.map_bytes)  # here, and through the environment in every child
        # Every fetch restores what is stored (auto would recompute some): each is checked.
        os.environ["KVSTORE_RESTORE"] = "always"
        self.env = dict(
            os.environ,
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            PYTHONUNBUFFERED="1",
        )
        self.started: Counter = Counter()
        self.kills: Counter = Counter()
        self.lock = threading.Lock()
        self.acked: Dict[tuple, dict] = {}  # (salt, tokens) -> {"pin", "t"}
        self.failures: List[str] = []
        self.failure_counts: Counter = Counter()
        self.events: Counter = Counter()
        self.evictions = Counter()  # by who: gc, and each process's last count
        self.corrupt = Counter()  # by process: the last "corrupt" it reported
        self.map_sizes: List[int] = []
        self.stop = threading.Event()
        self.procs: Dict[str, Proc] = {}  # long-lived role -> its current process
        self.jobs: Dict[str, Proc] = {}  # periodic CLI jobs running now
        self.due: Dict[str, float] = {}
        self.server_port: Optional[int] = None
        self.server_ready = threading.Event()
        self.reader_progress: Dict[str, dict] = {}
        self.server_stats: Dict[str, dict] = {}
        self.remote_prompts: List[List[int]] = []
        self.remote_url: Optional[str] = None
        self.cli_prefill_seq = self.gc_seq = 0
        self.gc_evicted_pinned = 0
        self.systems = system_prompts(a.seed)

    # -- helpers ---------------------------------------------------------------------

    def fail(self, what: str) -> None:
        """Record a failure; the same text again only counts."""
        with self.lock:
            seen = self.failure_counts[what]
            self.failure_counts[what] += 1
            if not seen:
                self.failures.append(what)
        if not seen:
            print(f"soak: FAIL {what}", file=sys.stderr, flush=True)

    def worker(self, role: str, *extra: str) -> List[str]:
        """``soak.py worker [options] ROLE``: options first, the role last."""
        return [
            sys.executable,
            HERE,
            "worker",
            "--map-bytes",
            str(self.a.map_bytes),
            *extra,
            role,
        ]

    def cli(self, *argv: str) -> List[str]:
        return self.worker("cli") + ["--", *argv]

    def prefill_argv(self, path: str, *extra: str, store: Optional[str] = None):
        """``kvstore prefill PATH`` into the store (or ``store``), its summary as JSON."""
        store = store or self.store
        return self.cli(
            "prefill",
            path,
            "--store",
            store,
            "--model",
            self.model_dir,
            "--json",
            "--quiet",
            *extra,
        )

    def ack(self, tokens: List[int], salt: Optional[str], pin: bool) -> None:
        key = (salt, tuple(tokens))
        with self.lock:
            new = key not in self.acked
            entry = self.acked.setdefault(key, {"pin": False})
            entry["pin"] = entry["pin"] or pin
            entry["t"] = time.time()
            if new:
                with open(self.acks_path, "a") as f:
                    f.write(json.dumps({"tokens": tokens, "salt": salt}) + "\n")

    def note_counters(self, proc: Proc, msg: dict) -> None:
        c = msg.get("final", msg)
        if "corrupt" in c:
            self.corrupt[proc.name] = c["corrupt"]
            self.evictions[proc.name] = c["nodes_evicted"]
            if c.get("problem"):
                self.fail(f"{proc.name}: store problem: {c['problem']}")

    # -- setup -----------------------------------------------------------------------

    def setup(self) -> None:
        self.model_dir = build_model(os.path.join(self.dir, "model"))
        # Record the budget in the store: gc and the CLI read it from there.
        self.run_job(
            "init",
            self.prefill_argv(
                self.prompts_file([(self.systems[0], None, True)], "init"),
                "--disk-bytes",
                str(self.a.disk_bytes),
            ),
            timeout=120,
            must_pass=True,
        )
        self.ack(self.systems[0], None, True)
        if not self.a.no_remote:
            self.setup_remote()

    def setup_remote(self) -> None:
        import logging

        import boto3
        import moto.server as moto_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.moto = moto_server.ThreadedMotoServer(
            ip_address="127.0.0.1", port=0, verbose=False
        )
        self.moto.start()
        host, port = self.moto.get_host_and_port()
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
            self.env.pop(name, None)
        self.env.update(
            AWS_ENDPOINT_URL=f"http://{host}:{port}",
            AWS_ACCESS_KEY_ID="testing",
            AWS_SECRET_ACCESS_KEY="testing",
            AWS_DEFAULT_REGION="us-east-1",
            AWS_EC2_METADATA_DISABLED="true",
            AWS_CONFIG_FILE="/nonexistent/aws-config",
            AWS_SHARED_CREDENTIALS_FILE="/nonexistent/aws-credentials",
        )
        boto3.client(
            "s3",
            endpoint_url=self.env["AWS_ENDPOINT_URL"],
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        ).create_bucket(Bucket="soak")
        self.remote_url = "s3://soak/fleet"
        rng = random.Random(self.a.seed + 1)
        self.remote_prompts = [
            self.systems[i % len(self.systems)]
            + random_tokens(rng, rng.randrange(60, 400))
            for i in range(4)
        ] + [random_tokens(rng, rng.randrange(300, 600)) for _ in range(2)]
        other = os.path.join(self.dir, "machine-a")
        self.run_job(
            "push",
            self.prefill_argv(
                self.prompts_file(
                    [(p, None, False) for p in self.remote_prompts], "remote"
                ),
                "--remote",
                self.remote_url,
                store=other,
            ),
            timeout=180,
            must_pass=True,
        )

    def prompts_file(self, lines, name: str) -> str:
        path = os.path.join(self.dir, "prompts", f"{name}.jsonl")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            for tokens, salt, pin in lines:
                line = {"tokens": tokens, "pin": pin}
                if salt is not None:
                    line["salt"] = salt
                f.write(json.dumps(line) + "\n")
        return path

    def run_job(self, role, argv, *, timeout, must_pass=False) -> tuple:
        """Run a CLI process to its end: ``(Proc, exit status or None)``."""
        p = Proc(self, role, argv)
        rc = p.wait(timeout)
        if rc is None:
            p.kill()
        out = p.output()
        if must_pass and rc != 0:
            raise RuntimeError(f"{p.name} failed ({rc}):\n{out}")
        return p, rc

    # -- long-lived processes ----------------------------------------------------------

    def start_writer(self, k: int) -> None:
        salt = None if k % 2 == 0 else f"writer-{k}"
        self.procs[f"writer{k}"] = Proc(
            self,
            "writer",
            self.worker(
                "writer",
                "--store",
                self.store,
                "--model",
                self.model_dir,
                "--disk-bytes",
                str(self.a.disk_bytes),
                "--seed",
                str(self.rng.randrange(1 << 30)),
                "--prompt-seed",
                str(self.a.seed),
                "--pin-rate",
                "0.08",
                *(["--salt", salt] if salt else []),
            ),
            on_line=self.on_writer_line,
        )

    def on_writer_line(self, proc: Proc, msg: dict) -> None:
        self.note_counters(proc, msg)
        if "ack" in msg:
            self.events["writer saves"] += 1
            if msg["ack"]:
                self.ack(msg["tokens"], msg["salt"], msg["pin"])
            else:
                self.fail(f"{proc.name}: a save failed or was dropped ({msg})")

    def start_reader(self, k: int) -> None:
        self.procs[f"reader{k}"] = Proc(
            self,
            "reader",
            self.worker(
                "reader",
                "--store",
                self.store,
                "--model",
                self.model_dir,
                "--acks",
                self.acks_path,
                "--seed",
                str(self.rng.randrange(1 << 30)),
                *(["--fd-pressure"] if k == 1 else []),
            ),
            on_line=self.on_reader_line,
        )

    def on_reader_line(self, proc: Proc, msg: dict) -> None:
        self.note_counters(proc, msg)
        if msg.get("progress"):
            self.reader_progress[proc.name] = msg["progress"]

    def start_server(self) -> None:
        from kvstore.bench.ports import free_ports

        # stats and metrics are off the API port
        self.server_port, self.stats_port = free_ports(2)
        self.procs["serve"] = Proc(
            self,
            "serve",
            self.cli(
                "serve",
                "--model",
                self.model_dir,
                "--store",
                self.store,
                "--salt-header",
                "X-Tenant",
                "--salt-disk-bytes",
                str(self.a.salt_disk_bytes),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.server_port),
                "--metrics-port",
                str(self.stats_port),
            ),
        )
        self.server_ready.clear()
        threading.Thread(
            target=self._await_server, args=(self.procs["serve"],), daemon=True
        ).start()

    def _await_server(self, p: Proc) -> None:
        """Set ``server_ready`` once ``p`` answers /health (it loads the model first)."""
        while p.alive():
            if http(self.server_port, "/health", timeout=5)[0] == 200:
                if self.procs.get("serve") is p:
                    self.server_ready.set()
                return
            time.sleep(0.3)

    def long_lived(self) -> None:
        for k in range(self.a.writers):
            self.start_writer(k)
        for k in range(2):
            self.start_reader(k)
        if self.a.clients:
            self.start_server()

    def restart_dead(self) -> None:
        for role, p in list(self.procs.items()):
            if p.alive():
                continue
            if not p.killed:
                self.fail(
                    f"{p.name} exited by itself ({p.proc.returncode}): {p.output()[-2000:]}"
                )
            if role.startswith("writer"):
                self.start_writer(int(role[6:]))
            elif role.startswith("reader"):
                self.start_reader(int(role[6:]))
            else:
                self.start_server()

    # -- server clients ---------------------------------------------------------------

    def client(self, k: int) -> None:
        rng = random.Random(self.a.seed * 100 + k)
        while not self.stop.is_set():
            if not self.server_ready.wait(0.5):
                continue
            port = self.server_port
            p = self.procs.get("serve")
            headers, body_salt = {}, None
            r = rng.random()
            if r < 0.05:  # header + body salt: over 256 bytes together
                headers["X-Tenant"] = LONG_TENANT
                body_salt = LONG_NARROW
                kind = "long salt"
            elif r < 0.15:
                kind = "unsalted"
            else:
                headers["X-Tenant"] = rng.choice(TENANTS)
                kind = "tenant"
                if rng.random() < 0.3:
                    body_salt = rng.choice(NARROW)
                    kind = "narrowed"
            system = words(self.systems[rng.randrange(3)])
            body = {
                "messages": [
                    {"role": "system", "content": system},
                    {
                        "role": "user",
                        "content": words(random_tokens(rng, rng.randrange(5, 80))),
                    },
                ],
                "max_tokens": 3,
                "temperature": 0,
            }
            if body_salt is not None:
                body["cache_salt"] = body_salt
            status, out = http(port, "/v1/chat/completions", body, headers, timeout=120)
            with self.lock:
                self.events[f"requests {kind}: {status}"] += 1
            expected = status == 200 or (kind == "long salt" and status == 400)
            current = p is not None and p.alive() and self.procs.get("serve") is p
            if not expected and current and not p.killed:
                if status:  # an answer (no answer: is the server still serving?)
                    error = out.get("error") if isinstance(out, dict) else out
                    self.fail(f"a {kind} request answered {status}: {error}")
                time.sleep(1)
                hs, _ = http(port, "/health", timeout=30)
                if p.alive() and not p.killed and hs != 200:
                    died = _first_line(p.output(), "generation thread died")
                    self.fail(f"{p.name} is up but unhealthy (health {hs}): {died}")
                    print(_stacks(p), file=sys.stderr, flush=True)
                    p.kill()  # restarted by the main loop
            elif not expected:
                time.sleep(0.5)  # killed: the main loop restarts it
            if k == 0 and rng.random() < 0.2:
                status, stats = http(self.stats_port, "/kvstore/stats", timeout=30)
                if status == 200 and p is not None:
                    self.server_stats[p.name] = stats
                    self.events["server stats read"] += 1

    # -- periodic jobs ----------------------------------------------------------------

    def start_job(self, kind: str) -> None:
        a = self.a
        if kind == "prefill":
            self.cli_prefill_seq += 1
            rng = self.rng
            lines = []
            for _ in range(rng.randrange(2, 6)):
                system = rng.choice(self.systems)
                pin = rng.random() < 0.1
                tokens = (
                    system
                    if pin
                    else system + random_tokens(rng, rng.randrange(30, 400))
                )
                lines.append((tokens, rng.choice([None, None, "prefill"]), pin))
            path = self.prompts_file(lines, f"prefill-{self.cli_prefill_seq}")
            p = Proc(
                self,
                "prefill",
                self.prefill_argv(path),
            )
            p.prompts = lines
        elif kind == "gc":
            # Every third run deep: most of the store goes in one transaction.
            self.gc_seq += 1
            budget = a.gc_deep_bytes if self.gc_seq % 3 == 0 else a.gc_bytes
            p = Proc(
                self,
                "gc",
                self.cli(
                    "gc", "--store", self.store, "--max-bytes", str(budget), "--json"
                ),
            )
        elif kind == "verify":
            p = Proc(
                self, "verify", self.cli("verify", "--store", self.store, "--json")
            )
        else:
            p = Proc(
                self,
                "pull",
                self.cli(
                    "pull",
                    "--store",
                    self.store,
                    "--model",
                    self.model_dir,
                    "--remote",
                    self.remote_url,
                    "--json",
                ),
            )
        self.jobs[kind] = p

    def finish_job(self, kind: str, p: Proc) -> None:
        rc = p.proc.returncode
        if p.killed:
            return
        out = p.output()
        summary = None
        for line in reversed(out.splitlines()):
            if line.startswith("{"):
                try:
                    summary = json.loads(line)
                    break
                except ValueError:
                    pass
        self.events[f"{kind} runs"] += 1
        if kind == "prefill":
            ok = (
                rc == 0
                and summary is not None
                and summary["failed"] == 0
                and summary["writes_dropped"] == 0
            )
            if ok:
                for tokens, salt, pin in p.prompts:
                    self.ack(tokens, salt, pin)
            else:
                self.fail(f"{p.name} exited {rc}: {out[-1500:]}")
        elif kind == "gc":
            if rc != 0 or summary is None:
                self.fail(f"{p.name} exited {rc}: {out[-1500:]}")
                return
            self.evictions["gc"] += summary["evicted_nodes"]
            self.gc_evicted_pinned += summary["evicted_pinned"]
            if summary["broken_nodes"] or summary["quarantined"]:
                self.fail(f"{p.name} found broken nodes: {summary['problems']}")
        elif kind == "verify":
            if summary is None or rc not in (0, 1):
                self.fail(f"{p.name} exited {rc}: {out[-1500:]}")
            elif not summary["clean"]:
                errors = [
                    q
                    for q in summary["problems"]
                    if q["kind"] not in ("orphan", "temp")
                ]
                self.fail(f"{p.name} not clean: {errors[:5]}")
        else:
            if rc != 0 or summary is None:
                self.fail(f"{p.name} exited {rc}: {out[-1500:]}")
                return
            for tokens in self.remote_prompts:
                self.ack(tokens, None, False)
            self.events["nodes pulled"] += summary.get("pulled", 0)

    def periodic(self, now: float) -> None:
        a = self.a
        every = {"prefill": a.prefill_every, "gc": a.gc_every, "verify": a.verify_every}
        if self.remote_url:
            every["pull"] = a.pull_every
        for kind, period in every.items():
            p = self.jobs.get(kind)
            if p is not None and not p.alive():
                del self.jobs[kind]
                self.finish_job(kind, p)
            if kind not in self.jobs and now >= self.due.get(kind, 0):
                self.start_job(kind)
                self.due[kind] = now + period * (0.5 + self.rng.random())

    def kill_one(self) -> None:
        """SIGKILL a random process: a long-lived one, or (one time in three) a
        running gc, prefill or pull once one of its kind has finished."""
        victims = [p for p in self.procs.values() if p.alive()]
        jobs = [
            p
            for kind, p in self.jobs.items()
            if kind != "verify" and p.alive() and self.events[f"{kind} runs"]
        ]
        if jobs and (not victims or self.rng.random() < 1 / 3):
            victims = jobs
        if not victims:
            return
        p = self.rng.choice(victims)
        p.kill()
        self.kills[p.role] += 1

    def sample_map(self) -> None:
        size = map_size(os.path.join(self.store, "index", "data.mdb"))
        if size and (not self.map_sizes or size != self.map_sizes[-1]):
            self.map_sizes.append(size)

    # -- the run --------------------------------------------------------------------

    def run(self) -> dict:
        a = self.a
        t0 = time.monotonic()
        self.setup()
        phases = {"setup": time.monotonic() - t0}
        self.long_lived()
        clients = [
            threading.Thread(target=self.client, args=(k,), daemon=True)
            for k in range(a.clients)
        ]
        if a.clients:
            deadline = time.monotonic() + 120
            while http(self.server_port, "/health", timeout=2)[0] != 200:
                if time.monotonic() > deadline or not self.procs["serve"].alive():
                    raise RuntimeError(
                        "server did not start:\n" + self.procs["serve"].output()
                    )
                time.sleep(0.3)
        for c in clients:
            c.start()
        start = time.monotonic()
        next_kill = start + a.kill_every
        while time.monotonic() - start < a.seconds:
            now = time.monotonic()
            self.sample_map()
            self.periodic(now)
            if now >= next_kill:
                self.kill_one()
                next_kill = now + a.kill_every * (0.5 + self.rng.random())
            self.restart_dead()
            time.sleep(0.2)
        soaked = time.monotonic() - start
        self.stop.set()
        for c in clients:
            c.join(180)
        tic = time.monotonic()
        self.wind_down()
        phases["wind_down"] = time.monotonic() - tic
        tic = time.monotonic()
        result = self.final_checks()
        phases["checks"] = time.monotonic() - tic
        result["phases"] = {k: round(v, 1) for k, v in phases.items()}
        result["seconds"] = round(soaked, 1)
        result["seconds_total"] = round(time.monotonic() - t0, 1)
        return result

    def wind_down(self) -> None:
        for kind, p in list(self.jobs.items()):
            if p.wait(240) is None:
                p.kill()
                self.fail(f"{p.name} did not finish within 240 s")
            del self.jobs[kind]
            self.finish_job(kind, p)
        for p in self.procs.values():
            if p.role != "serve":
                # A worker restarted just now may not handle SIGTERM yet.
                deadline = time.monotonic() + 120
                while p.alive() and time.monotonic() < deadline:
                    if p.ready.wait(0.5):
                        break
                p.proc.send_signal(signal.SIGTERM)
        serve = self.procs.get("serve")
        if serve is not None and serve.alive():
            self.server_ready.wait(120)  # SIGTERM while loading the model is a kill
            status, stats = http(self.stats_port, "/kvstore/stats", timeout=30)
            if status == 200:
                self.server_stats[serve.name] = stats
        self.procs.pop("serve", None)
        if serve is not None:
            serve.proc.send_signal(signal.SIGTERM)
        for p in list(self.procs.values()) + ([serve] if serve else []):
            if p.wait(120) is None:
                p.kill()
                self.fail(f"{p.name} did not stop on SIGTERM")
            elif p.proc.returncode != 0 and not p.killed:
                self.fail(f"{p.name} exited {p.proc.returncode}: {p.output()[-1500:]}")
        for name, stats in self.server_stats.items():
            for s in stats.get("stores", []):
                self.corrupt[name] = s["corrupt"]
                self.evictions[name] = s["nodes_evicted"]
        self.sample_map()

    # -- the end ------------------------------------------------------------------

    def final_checks(self) -> dict:
        from mlx_lm import load

        from kvstore import KVStore, maintenance

        verify_before = maintenance.verify(self.store)
        gc_report = maintenance.gc(self.store)
        verify_after = maintenance.verify(self.store)
        for name, report in (("before", verify_before), ("after", verify_after)):
            if not report["clean"]:
                self.fail(
                    f"final verify ({name} gc) not clean: {report['problems'][:5]}"
                )
        if gc_report["broken_nodes"]:
            self.fail(f"final gc found broken nodes: {gc_report['problems'][:5]}")
        quarantined = (
            sorted(
                f
                for f in os.listdir(os.path.join(self.store, "quarantine"))
                if f.endswith(".reason")
            )
            if os.path.isdir(os.path.join(self.store, "quarantine"))
            else []
        )
        if quarantined:
            self.fail(f"{len(quarantined)} files quarantined (no file was damaged)")
        broken_lines, tracebacks = self.scan_logs()
        false_reports = len(quarantined) + broken_lines + sum(self.corrupt.values())

        model, tokenizer = load(self.model_dir)
        figures = Counter()
        evictions = sum(self.evictions.values()) + gc_report["evicted_nodes"]
        with KVStore(self.store, model, tokenizer, ram_bytes=0) as store:
            for (salt, tokens), entry in self.acked.items():
                tokens = list(tokens)
                cache, n = store.fetch(tokens + [FIRST_WORD], salt=salt)
                if n and not same_kv(model, cache, tokens, n):
                    figures["wrong"] += 1
                    self.fail(
                        f"an acknowledged prompt of {len(tokens)} tokens restores wrong KV"
                    )
                if n == len(tokens):
                    figures["restored"] += 1
                elif entry["pin"] and not self.gc_evicted_pinned:
                    figures["lost"] += 1
                    self.fail(
                        f"a pinned prompt ({len(tokens)} tokens) restores {n} tokens"
                    )
                elif evictions and not quarantined:
                    figures["evicted"] += 1
                elif evictions:  # eviction or a quarantine: cannot tell which
                    figures["missing"] += 1
                else:
                    figures["lost"] += 1
            audit = self.audit(store, model)
        if figures["lost"]:
            self.fail(f"{figures['lost']} acknowledged prompts lost (not evicted)")
        reads = Counter()
        for prog in self.reader_progress.values():
            reads.update(prog)
        if reads["wrong"]:
            self.fail(f"readers restored wrong KV {reads['wrong']} times")
        return {
            "processes": sum(self.started.values()),
            "started": dict(self.started),
            "kills": dict(self.kills),
            "map_sizes": self.map_sizes,
            "map_resizes": max(0, len(self.map_sizes) - 1),
            "acknowledged": len(self.acked),
            "pinned": sum(e["pin"] for e in self.acked.values()),
            "restored": figures["restored"],
            "evicted": figures["evicted"],
            "lost": figures["lost"],
            "missing": figures["missing"],
            "map_start": self.a.map_bytes,
            "wrong": figures["wrong"] + reads["wrong"],
            "reads": dict(reads),
            "nodes_evicted": evictions,
            "false_corruption_reports": false_reports,
            "quarantined_files": len(quarantined),
            "broken_log_lines": broken_lines,
            "tracebacks": tracebacks,
            "corrupt_by_process": {k: v for k, v in self.corrupt.items() if v},
            "audit": audit,
            "events": dict(sorted(self.events.items())),
            "verify": {
                k: verify_after[k] for k in ("clean", "errors", "nodes", "orphans")
            },
            "gc": {
                k: gc_report[k]
                for k in ("evicted_nodes", "orphans_removed", "temp_removed")
            },
            "failures": self.failures,
        }

    def audit(self, store, model) -> dict:
        """Every stored prompt (a leaf of the trie) restored and compared with recomputed
        KV, its tree's salt found by ``lookup`` among the salts the soak used; each
        tenant's trees (its own and those its requests narrowed) against its quota."""
        from kvstore.disk.index import NodeRecord

        index = store.index
        nodes = index.read(
            lambda txn: {
                h: NodeRecord.decode(raw)
                for ns, h, raw in index.iter_nodes(txn)
                if ns == store.namespace
            }
        )
        parents = {r.parent for r in nodes.values()}
        roots, tree_bytes = {}, Counter()
        for h, rec in nodes.items():
            r = h
            while r in nodes:
                r = nodes[r].parent
            roots[h] = r
            tree_bytes[r] += rec.total_bytes
        candidates = self.salts()
        root_salt: Dict[bytes, Any] = {}
        out = Counter()
        for h in nodes:
            if h in parents:
                continue
            tokens, x = [], h
            while x in nodes:
                tokens = [int(t) for t in nodes[x].tokens] + tokens
                x = nodes[x].parent
            probe = tokens + [FIRST_WORD]
            found = [
                owner_salt
                for owner_salt in candidates
                if store.lookup(probe, salt=owner_salt[1]) == len(tokens)
            ]
            out["leaves"] += 1
            if len(found) == 1:
                root_salt.setdefault(roots[h], found[0])
            elif not found:
                # The walk takes the longest match among siblings: a longer sibling
                # diverging near this leaf's end wins over this leaf's whole parent.
                found = [max(candidates, key=lambda c: store.lookup(probe, salt=c[1]))]
                out["leaves shadowed by a longer sibling"] += 1
            cache, n = store.fetch(probe, salt=found[0][1])
            if not n:
                out["leaves not restored"] += 1
            elif not same_kv(model, cache, tokens, n):
                out["leaves wrong"] += 1
        if out["leaves wrong"]:
            self.fail(f"{out['leaves wrong']} stored prompts restore wrong KV")
        if out["leaves not restored"]:
            self.fail(f"{out['leaves not restored']} stored prompts do not restore")
        for t in TENANTS:
            used = sum(
                b
                for root, b in tree_bytes.items()
                if root_salt.get(root, ("",))[0] == t
            )
            out[f"bytes {t}"] = used
            if used > self.a.salt_disk_bytes:
                self.fail(
                    f"{t}'s trees hold {used} bytes, over its quota of "
                    f"{self.a.salt_disk_bytes}"
                )
        out["trees"] = len(tree_bytes)
        return dict(out)

    def salts(self) -> List[tuple]:
        """``(tenant or "", library salt)`` of every salt the soak's processes used:
        plain salts, and the trees ``serve --salt-header`` keeps for a tenant header
        alone and narrowed by a body ``cache_salt`` (``kvstore.Tenant``)."""
        from kvstore import Tenant

        out = [("", None), ("", "prefill")]
        out += [("", f"writer-{k}") for k in range(self.a.writers)]
        for t in TENANTS + [LONG_TENANT]:
            narrow = [LONG_NARROW] if t == LONG_TENANT else NARROW
            out += [(t, Tenant(t))] + [(t, Tenant(t, b)) for b in narrow]
        return out

    def scan_logs(self):
        broken = tracebacks = 0
        for name in sorted(os.listdir(self.logs)):
            with open(os.path.join(self.logs, name), errors="replace") as f:
                text = f.read()
            n = text.count(" is broken (")
            t = text.count("Traceback (most recent call last)")
            if n:
                self.fail(
                    f"{name}: {n} 'is broken' lines, e.g. {_first_line(text, ' is broken (')}"
                )
            if t:
                self.fail(f"{name}: {t} tracebacks, e.g. {_first_line(text, 'Error')}")
            broken += n
            tracebacks += t
        return broken, tracebacks

    def close(self) -> None:
        for p in list(self.procs.values()) + list(self.jobs.values()):
            if p.alive():
                p.kill()
        if getattr(self, "moto", None) is not None:
            self.moto.stop()


def _stacks(p: "Proc") -> str:
    """Every thread's stack of a server that stopped answering (``kvstore serve``
    prints them on SIGUSR1)."""
    before = len(p.output())
    p.proc.send_signal(signal.SIGUSR1)
    time.sleep(2)
    dump = p.output()[before:]
    return f"soak: {p.name}'s threads ({p.log_path}):\n{dump[-12000:]}"


def _first_line(text: str, needle: str) -> str:
    for line in text.splitlines():
        if needle in line:
            return line.strip()[:300]
    return ""


def report(result: dict) -> str:
    r = result
    lines = [
        f"soak: {r['seconds']} s ({r['seconds_total']} s with "
        f"{_pairs(r['phases'])}), "
        f"{r['processes']} processes started ({_pairs(r['started'])})",
        f"kills: {sum(r['kills'].values())} SIGKILLs ({_pairs(r['kills'])})",
        f"LMDB map: every process opens it at {_size(r['map_start'])}; {r['map_resizes']} "
        f"resizes of the map size recorded in the index "
        f"({' -> '.join(_size(s) for s in r['map_sizes'])})",
        f"prompts acknowledged: {r['acknowledged']} ({r['pinned']} pinned): "
        f"{r['restored']} restored bit-identically, {r['evicted']} evicted by the budget, "
        f"{r['missing']} missing after quarantines (evicted or quarantined), "
        f"{r['lost']} lost, {r['wrong']} wrong restores; {r['nodes_evicted']} nodes evicted",
        f"false corruption reports: {r['false_corruption_reports']} "
        f"({r['quarantined_files']} files quarantined, {r['broken_log_lines']} 'is broken' "
        f"lines, corrupt counted by {r['corrupt_by_process'] or 'no process'}); "
        f"{r['tracebacks']} tracebacks",
        f"reader fetches: {_pairs(r['reads'])}",
        f"audit of every stored prompt: {_pairs(r['audit'])}",
        f"final verify: {_pairs(r['verify'])}; final gc: {_pairs(r['gc'])}",
        f"events: {_pairs(r['events'])}",
        f"failures: {len(r['failures'])}",
    ]
    lines += [f"  - {f[:400]}" for f in r["failures"][:30]]
    return "\n".join(lines)


def _pairs(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items())


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=300, help="soak time (default 300)")
    p.add_argument(
        "--dir", help="work directory (default: a temp dir, removed unless --keep)"
    )
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--writers", type=int, default=2)
    p.add_argument(
        "--clients", type=int, default=3, help="server clients (0: no server)"
    )
    p.add_argument(
        "--kill-every", type=float, default=6.0, help="mean seconds between SIGKILLs"
    )
    p.add_argument("--prefill-every", type=float, default=4.0)
    p.add_argument("--gc-every", type=float, default=10.0)
    p.add_argument("--verify-every", type=float, default=12.0)
    p.add_argument("--pull-every", type=float, default=15.0)
    p.add_argument("--map-bytes", type=int, default=64 << 10, help="initial LMDB map")
    p.add_argument("--disk-bytes", type=int, default=8 << 20, help="the store's budget")
    p.add_argument("--gc-bytes", type=int, default=6 << 20, help="gc --max-bytes")
    p.add_argument(
        "--gc-deep-bytes",
        type=int,
        default=3 << 20,
        help="gc --max-bytes of every third gc (above the pinned bytes)",
    )
    p.add_argument(
        "--salt-disk-bytes", type=int, default=1 << 20, help="serve's per-salt quota"
    )
    p.add_argument("--no-remote", action="store_true", help="no moto server, no pull")
    return p.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":
        return worker_main(argv[1:])
    a = parse_args(argv)
    temp = a.dir is None
    a.dir = os.path.abspath(a.dir or tempfile.mkdtemp(prefix="kvstore-soak-"))
    soak = Soak(a)
    try:
        result = soak.run()
    finally:
        soak.close()
    text = report(result)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**result, "report": text.splitlines()}, f, indent=1)
    if temp and not a.keep:
        shutil.rmtree(a.dir, ignore_errors=True)
    elif temp:
        print(f"soak: kept {a.dir}")
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
