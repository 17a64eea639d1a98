"""Helpers of the ``kvstore serve`` tests: a stand-in model provider for
``PersistentPromptCache`` and request, and real server processes driven over HTTP."""

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from types import SimpleNamespace
from typing import List

from kvstore.bench import ports as bench_ports

SUBPROCESS_TIMEOUT = 120

KEY = ("tiny", None, None)


def provider(model, tokenizer):
    return SimpleNamespace(
        model=model,
        tokenizer=tokenizer,
        model_key=KEY,
        draft_model=None,
        processor=None,
    )


class Request:
    """Stands in for mlx-lm's CompletionRequest: weak references allowed, and, as a
    dataclass, no hash."""

    __hash__ = None


# The ports a pytest-xdist worker's servers listen on: a range of its own below the
# kernel's ephemeral ports (what Ceph, moto and the tools' servers get), so no port is
# handed to two servers before either has bound it.
PORTS_BASE, PORTS_PER_WORKER, MAX_WORKERS = 20000, 500, 24
_next_port = itertools.count()


def free_ports(n: int) -> List[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 now: from this xdist worker's range,
    else the kernel's picks."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) if worker[2:].isdigit() else MAX_WORKERS
    if not worker.startswith("gw") or index >= MAX_WORKERS:
        return bench_ports.free_ports(n)  # not under xdist, or past its ranges
    ports: List[int] = []
    for _ in range(PORTS_PER_WORKER):
        port = PORTS_BASE + index * PORTS_PER_WORKER
        port += next(_next_port) % PORTS_PER_WORKER
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))  # not bound now, nor in TIME_WAIT
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise RuntimeError(f"no {n} free ports in {worker}'s range")


def request(port, path, body=None, timeout=60):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=data,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class Server:
    """A server process. A ``kvstore.server`` gets ``--metrics-port`` (its
    ``metrics_port``) unless ``args`` say where its metrics go."""

    def __init__(self, args, log_path):
        self.port, metrics_port = free_ports(2)
        self.metrics_port = None
        kv = args[:1] == ["kvstore.server"] or args[:2] == ["kvstore", "serve"]
        if kv and not {"--metrics-port", "--api-metrics"} & set(args):
            self.metrics_port = metrics_port
            args = [*args, "--metrics-port", str(self.metrics_port)]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [os.getcwd(), env.get("PYTHONPATH")])
        )
        self.log_path = log_path
        self.log = open(log_path, "wb")
        cmd = [
            sys.executable,
            "-m",
            *args,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env
        )
        try:
            self._wait_ready(timeout=60)
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            raise

    def _wait_ready(self, timeout):
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, self.output()
            try:
                if request(self.port, "/health", timeout=2)["status"] == "ok":
                    return
            except (OSError, urllib.error.URLError):
                pass
            assert time.monotonic() < deadline, (
                "server did not start:\n" + self.output()
            )
            time.sleep(0.2)

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def chat(self, body):
        return self._ask(self.port, "/v1/chat/completions", body)

    def stats(self):
        """``GET /kvstore/stats`` from the metrics port."""
        return self._ask(self.metrics_port, "/kvstore/stats")

    def _ask(self, port, path, body=None):
        """``request``; a server that cannot be reached fails with its exit status
        and log (an HTTP error status is raised as it is, for the tests of them)."""
        try:
            return request(port, path, body)
        except urllib.error.HTTPError:
            raise
        except (OSError, urllib.error.URLError) as e:
            raise AssertionError(
                f"{path} on port {port}: {e}; server exit status "
                f"{self.proc.poll()}:\n{self.output()}"
            ) from e

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError("server did not stop on SIGTERM:\n" + self.output())
        self.log.close()
        return rc


SYSTEM = " ".join(f"w{3 + (i * 7) % 509}" for i in range(300))


def chat_body(user, system=SYSTEM):
    return {
        "model": "default_model",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
        ],
        "temperature": 0,
        "max_tokens": 8,
    }


def answer(response):
    return response["choices"][0]["message"]["content"]


def run_kvstore(*args, timeout=SUBPROCESS_TIMEOUT):
    """``python -m kvstore ARGS``: the CompletedProcess (never raises on exit status)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [os.getcwd(), env.get("PYTHONPATH")])
    )
    return subprocess.run(
        [sys.executable, "-m", "kvstore", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def settled_stats(port, timeout=30):
    """``/kvstore/stats`` once no save is queued and the store's writer has nothing
    left to do. (The last save of a request is queued after its answer is sent, and
    waits for the generation loop to rest.)"""
    deadline, last = time.monotonic() + timeout, None
    while True:
        stats = request(port, "/kvstore/stats")
        idle = not stats["saves_queued"] and not any(
            s["pending_write_jobs"] for s in stats["stores"]
        )
        if idle and last is not None and last["saves"] == stats["saves"]:
            return stats
        last = stats if idle else None
        assert time.monotonic() < deadline, "writes never finished"
        time.sleep(0.1)


def stop_all(servers):
    """Stop every server; the exit codes (all are stopped even if one fails)."""
    codes = []
    for s in servers:
        try:
            codes.append(s.stop())
        except AssertionError as e:
            codes.append(str(e))
    return codes
