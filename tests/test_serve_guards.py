"""``kvstore serve`` against requests meant to break it, as real processes over HTTP:
nothing a request sends ends mlx-lm's generation thread; tenant headers are their
UTF-8 bytes with only HTTP whitespace cut; tenant and plain salts never share a tree
(and ``kvstore prefill --tenant`` warms what a tenant's requests read); a tenant's
quota holds across its ``cache_salt`` values; ``/metrics`` and ``/kvstore/stats``
stay off the API port unless asked for, and show no path."""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from serving import (
    SYSTEM,
    Server,
    chat_body,
    free_ports,
    request,
    run_kvstore,
    settled_stats,
)

from kvstore import maintenance, server

pytestmark = pytest.mark.slow

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"


def post(port, path, body, headers=()):
    """``(status, json)`` of a POST whose header values may be raw bytes (http.client
    sends a str as ISO-8859-1, bytes as they are)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        raw = json.dumps(body).encode()
        conn.putrequest("POST", path)
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(raw)))
        for name, value in headers:
            conn.putheader(name, value)
        conn.endheaders(raw)
        resp = conn.getresponse()
        data = resp.read()
        try:
            return resp.status, json.loads(data or b"{}")
        except ValueError:
            return resp.status, {"error": data.decode(errors="replace")}
    finally:
        conn.close()


def get(address, path="/health"):
    """``(status, json)`` of a GET from ``address`` (host, port)."""
    conn = http.client.HTTPConnection(*address, timeout=30)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def tenant(value):
    """An ``X-Tenant`` header sent as the UTF-8 bytes of ``value``."""
    return [("X-Tenant", value.encode("utf-8"))]


def chat(user, salt=None, system=SYSTEM):
    b = chat_body(user, system)
    b["max_tokens"] = 2
    if salt is not None:
        b["cache_salt"] = salt
    return b


def cached(out):
    return out["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)


def healthy(port):
    return request(port, "/health", timeout=10)["status"] == "ok"


def test_no_request_ends_the_generation_thread(tmp_path, tiny_model_dir):
    store = str(tmp_path / "store")
    s = Server(
        [
            "kvstore.server",
            "--model",
            tiny_model_dir,
            "--store",
            store,
            "--salt-header",
            "X-Tenant",
            "--strip-pattern",
            r"^x-billing: .*\n?",
        ],
        tmp_path / "run.log",
    )
    try:
        # Salts at their limits, with and without the header: the header and the
        # body salt are hashed apart, never joined into one longer salt.
        for b, h in (
            (chat("w40 w41", "s" * 256), []),
            (chat("w40 w41", "s" * 60), tenant("t" * 200)),
            (chat("w40 w41", "é" * 128), tenant("é" * 128)),
        ):
            status, out = post(s.port, CHAT, b, h)
            assert status == 200, out
            assert healthy(s.port)
        # Empty prompts, sent as such or left by --strip-pattern: a 400, not a
        # dead thread (plain mlx_lm.server dies on the first).
        for prompt, match in (
            ("", "prompt is empty: send the text"),
            ("x-billing: 123\n", "prompt is empty once --strip-pattern"),
        ):
            status, out = post(s.port, TEXT, {"prompt": prompt, "max_tokens": 2})
            assert status == 400 and match in out["error"], out
            assert healthy(s.port)
        # Bad salts: a 400 naming the field, the thread untouched.
        for b, h, match in (
            (chat("w1", "x" * 257), tenant("acme"), "cache_salt is 257 bytes"),
            (chat("w1"), tenant("t" * 257), "header X-Tenant is 257 bytes"),
            (chat("w1"), [("X-Tenant", b"\xe9")], "X-Tenant is not valid UTF-8"),
            (chat("w1"), [("X-Tenant", b"A\x1f")], "control character (U+001F)"),
            (chat("w1"), tenant("A\x85"), "control character (U+0085)"),
        ):
            status, out = post(s.port, CHAT, b, h)
            assert status == 400 and match in out["error"], (match, out)
        # Fields mlx-lm checks too little, which end its generation thread (stop
        # that is not text, a penalty window too large to allocate) or the whole
        # process (a logit_bias id outside the vocabulary: MLX crashes).
        for extra, match in (
            ({"stop": [5]}, "stop must be a string or a list of strings"),
            ({"logit_bias": {"999999": 1}}, "logit_bias token id 999999"),
            ({"logit_bias": {"-1": 1}}, "logit_bias token id -1"),
            (
                {"frequency_penalty": 1.0, "frequency_context_size": 10**12},
                "frequency_context_size must be at most",
            ),
        ):
            status, out = post(s.port, CHAT, dict(chat("w1"), **extra), tenant("a"))
            assert status == 400 and match in out["error"], (match, out)
            assert healthy(s.port)
        status, out = post(s.port, CHAT, chat("w50 w51"), tenant("acme"))
        assert status == 200 and healthy(s.port), out
        # Only HTTP's optional whitespace is cut: " acme\t" is acme, "acme" + a
        # no-break space is another tenant.
        status, out = post(s.port, CHAT, chat("w50 w51"), [("X-Tenant", b" acme\t")])
        assert status == 200 and cached(out) > 250, out
        status, out = post(s.port, CHAT, chat("w50 w51"), tenant("acme\xa0"))
        assert status == 200 and cached(out) == 0, out
    finally:
        assert s.stop() == 0, s.output()
    assert "generation thread died" not in s.output()
    assert maintenance.verify(store)["clean"]


@pytest.mark.stress  # the slow tier: keeps the README's test command short
def test_prefill_tenant_and_plain_salts_meet_serve(tmp_path, tiny_model_dir):
    store = str(tmp_path / "store")
    first, second = chat("w60 w61"), chat("w70 w71")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": first["messages"]}) + "\n")
    common = ["--store", store, "--model", tiny_model_dir, "--quiet"]
    # prefill --tenant é warms the tree the UTF-8 header "é" reads; prefill --salt é
    # warms the plain salt "é", which no tenant reaches.
    for extra in (["--tenant", "é"], ["--salt", "é"]):
        out = run_kvstore("prefill", prompts, *common, *extra)
        assert out.returncode == 0, out.stderr
    kv = ["kvstore.server", "--model", tiny_model_dir, "--store", store]
    s = Server(kv + ["--salt-header", "X-Tenant"], tmp_path / "run1.log")
    try:
        status, out = post(s.port, CHAT, first, tenant("é"))
        assert status == 200 and cached(out) > 250, out
        status, out = post(s.port, CHAT, first, tenant("è"))
        assert status == 200 and cached(out) == 0, out
        status, out = post(s.port, CHAT, second, tenant("A"))  # tenant A's pool
        assert status == 200 and cached(out) == 0, out
        status, out = post(s.port, CHAT, second, tenant("A"))
        assert status == 200 and cached(out) > 250, out
    finally:
        assert s.stop() == 0, s.output()
    # A server without --salt-header on the same store: the body salt "A" does not
    # reach tenant A's pool; the body salt "é" is prefill --salt é's.
    s = Server(kv, tmp_path / "run2.log")
    try:
        status, out = post(s.port, CHAT, dict(second, cache_salt="A"))
        assert status == 200 and cached(out) == 0, out
        status, out = post(s.port, CHAT, dict(first, cache_salt="é"))
        assert status == 200 and cached(out) > 250, out
    finally:
        assert s.stop() == 0, s.output()


def _salted_bytes(store):
    (ns,) = maintenance.store_stats(store, full=True)["namespaces"]
    return sum(t["bytes"] for t in ns["salted_trees"])


@pytest.mark.stress  # the slow tier: keeps the README's test command short
def test_a_tenants_cache_salts_share_its_quota(tmp_path, tiny_model_dir):
    # How many bytes one conversation stores, on a probe server.
    probe = str(tmp_path / "probe")
    kv = ["kvstore.server", "--model", tiny_model_dir, "--api-metrics"]
    s = Server(kv + ["--store", probe], tmp_path / "probe.log")
    try:
        assert post(s.port, CHAT, chat("w90 w91", "x"), [])[0] == 200
        one = settled_stats(s.port)["stores"][0]["bytes_on_disk"]
    finally:
        assert s.stop() == 0, s.output()

    store = str(tmp_path / "store")
    quota = 2 * one + one // 2
    s = Server(
        kv
        + ["--store", store, "--salt-header", "X-Tenant"]
        + ["--salt-disk-bytes", str(quota), "--disk-bytes", str(6 * one + one // 2)]
        # One sequence in mlx-lm's RAM LRU: a reuse below comes from the store.
        + ["--prompt-cache-size", "1"],
        tmp_path / "run.log",
    )
    b = chat("w90 w91")
    try:
        assert post(s.port, CHAT, b, tenant("B"))[0] == 200
        settled_stats(s.port)
        # Tenant A sends a new cache_salt with each of 8 requests: its trees share
        # its quota, so B's prefix stays.
        for i in range(8):
            status, out = post(s.port, CHAT, chat("w90 w91", f"a{i}"), tenant("A"))
            assert status == 200, out
            settled_stats(s.port)
            assert _salted_bytes(store) <= one + quota
        status, out = post(s.port, CHAT, b, tenant("B"))
        assert status == 200 and cached(out) > 250, out
        # Control: the same traffic without the header is 8 plain salts, a quota
        # each: it fills the disk budget and evicts B's prefix.
        for i in range(8):
            status, out = post(s.port, CHAT, chat("w90 w91", f"c{i}"), [])
            assert status == 200, out
            settled_stats(s.port)
        status, out = post(s.port, CHAT, b, tenant("B"))
        assert status == 200 and cached(out) == 0, out
    finally:
        assert s.stop() == 0, s.output()
    assert maintenance.verify(store)["clean"]


def test_metrics_stay_off_the_api_port(tmp_path, tiny_model_dir):
    store = str(tmp_path / "store")
    kv = ["kvstore.server", "--model", tiny_model_dir, "--store", store]
    s = Server(kv, tmp_path / "run.log")  # with --metrics-port (tests/serving.py)
    try:
        assert post(s.port, CHAT, chat("w30 w31", "t"), [])[0] == 200
        for path in ("/kvstore/stats", "/metrics"):
            conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
            conn.request("GET", path)
            resp = conn.getresponse()
            body = resp.read().decode()
            conn.close()
            assert resp.status == 404 and "--api-metrics" in body, body
        stats = s.stats()
        assert stats["requests"] == 1
        text = json.dumps(stats)
        for where in {store, os.path.realpath(store), str(tmp_path)}:
            assert where not in text
        conn = http.client.HTTPConnection("127.0.0.1", s.metrics_port, timeout=30)
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        metrics = resp.read().decode()
        conn.close()
        assert resp.status == 200 and "kvstore_requests_total 1.0" in metrics
        assert str(tmp_path) not in metrics
    finally:
        assert s.stop() == 0, s.output()
    # --api-metrics: on the API port, for a server with one user.
    s = Server(kv + ["--api-metrics"], tmp_path / "run2.log")
    try:
        assert request(s.port, "/kvstore/stats")["requests"] == 0
        assert str(tmp_path) not in json.dumps(request(s.port, "/kvstore/stats"))
    finally:
        assert s.stop() == 0, s.output()
    # A port that cannot be had fails at start, before the model loads.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        taken = sock.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", *kv, "--metrics-port", str(taken)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 2 and "--metrics-port" in out.stderr, out.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["--port", "9001", "--metrics-port", "9001"],
        ["--metrics-port", "8080"],  # mlx_lm.server's default --port
        ["--host", "0.0.0.0", "--port", "9001", "--metrics-port", "9001"],
        ["--metrics-host", "::", "--port", "9001", "--metrics-port", "9001"],
        ["--metrics-host", "localhost", "--port", "9001", "--metrics-port", "9001"],
    ],
)
def test_metrics_on_the_api_port_fail_before_the_model_loads(tmp_path, capsys, argv):
    # Else the metrics listener answers /health until the API's bind fails.
    store = str(tmp_path / "s")
    argv = ["--model", str(tmp_path / "no-model"), "--store", store, *argv]
    assert server.main(argv, hard_exit=False) == 2
    err = capsys.readouterr().err
    assert "is the API's port (--port)" in err, err


def test_metrics_on_the_api_port_of_another_host_are_allowed(tmp_path):
    args, rest = server.build_parser().parse_known_args(
        ["--store", str(tmp_path / "s"), "--metrics-port", "9001"]
        + ["--metrics-host", "127.0.0.2", "--host", "127.0.0.1", "--port", "9001"]
    )
    patterns, store_dir = server._check_options(args, rest)
    assert store_dir == str(tmp_path / "s")
    assert server._api_address(["--port", "x"]) == ("127.0.0.1", None)
    assert not server._same_address("127.0.0.1", "no-such-host.invalid")


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
def test_metrics_listener_takes_ipv4_and_ipv6_hosts(host):
    from kvstore.serve.listener import MetricsListener

    if host == "::1":
        try:
            with socket.socket(socket.AF_INET6) as probe:
                probe.bind(("::1", 0))
        except OSError as e:
            pytest.skip(f"no IPv6 loopback here: {e}")
    listener = MetricsListener(host, 0, lambda: None)
    listener.start()
    try:
        assert get(listener.address)[0] == 200
    finally:
        listener.close()
    with pytest.raises(OSError):  # a host that does not resolve: the caller's error
        MetricsListener("no-such-host.invalid", 0, lambda: None)


def test_metrics_health_tells_the_api_status():
    import threading
    from http.server import BaseHTTPRequestHandler

    from kvstore.serve.listener import ApiStatus, MetricsListener

    api = ApiStatus()
    listener = MetricsListener("127.0.0.1", 0, lambda: None, health=lambda: api.value)
    listener.start()
    try:
        assert get(listener.address) == (503, {"status": "starting"})
        server = api.server_class()(("127.0.0.1", 0), BaseHTTPRequestHandler)
        assert get(listener.address) == (200, {"status": "ok"})
        thread = threading.Thread(target=server.serve_forever)
        thread.start()
        server.shutdown()
        thread.join()
        server.server_close()
        assert get(listener.address) == (503, {"status": "stopping"})
    finally:
        listener.close()


@pytest.mark.parametrize("api_port_taken", [False, True])
def test_metrics_health_is_ok_only_while_the_api_serves(
    tmp_path, tiny_model_dir, api_port_taken
):
    # A readiness probe on the metrics port: its listener starts before the model
    # loads, the API's only after (and fails then where its port is taken).
    api_port, metrics_port = free_ports(2)
    kv = ["kvstore.server", "--model", tiny_model_dir, "--store", str(tmp_path / "s")]
    kv += ["--metrics-port", str(metrics_port), "--port", str(api_port)]
    taken = socket.socket()
    if api_port_taken:
        taken.bind(("127.0.0.1", api_port))
        taken.listen()
    log_path = tmp_path / "run.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", *kv], stdout=log, stderr=subprocess.STDOUT
        )
    seen = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                status, body = get(("127.0.0.1", metrics_port))
            except OSError:  # not listening yet, or gone
                time.sleep(0.02)
                continue
            seen.append(body["status"])
            if status == 200:
                assert not api_port_taken, (seen, log_path.read_text())
                assert request(api_port, "/health")["status"] == "ok"
                break
            assert (status, body) == (503, {"status": "starting"})
            time.sleep(0.02)
    finally:
        taken.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    if api_port_taken:
        assert code == 1 and "ok" not in seen, (seen, log_path.read_text())
    else:
        assert code == 0 and seen[-1:] == ["ok"], (seen, log_path.read_text())


def _handshakes(server_class, n: int, timeout: float) -> int:
    """Connections of up to ``n`` clients at once that a server of ``server_class``,
    not accepting yet (its thread waits for the GIL), completes within ``timeout``
    each, until the first it does not."""
    from http.server import BaseHTTPRequestHandler

    server = server_class(("127.0.0.1", 0), BaseHTTPRequestHandler)
    clients = []
    try:
        done = 0
        for _ in range(n):
            s = socket.socket()
            clients.append(s)
            s.settimeout(timeout)
            try:
                s.connect(server.server_address[:2])
            except OSError:  # the handshake was dropped: retried seconds later
                break
            done += 1
        return done
    finally:
        for s in clients:
            s.close()
        server.server_close()


def test_the_api_server_takes_a_burst_of_users():
    """Users who connect at once all get through the handshake while the accepting
    thread is held up; with socketserver's backlog of 5, some would wait a second
    for their TCP stack to retry."""
    from http.server import ThreadingHTTPServer

    from kvstore.serve.listener import LISTEN_BACKLOG, ApiServer

    assert ApiServer.request_queue_size == LISTEN_BACKLOG >= 64
    assert _handshakes(ApiServer, 32, 0.5) == 32
    if sys.platform.startswith("linux"):  # the failure the backlog prevents
        assert _handshakes(ThreadingHTTPServer, 32, 0.5) < 32
