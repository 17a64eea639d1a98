"""Where ``kvstore serve`` listens: the API port's server class, and the listener
that answers ``GET /metrics`` and ``GET /kvstore/stats``.

Both tell what every tenant's requests do (prompt lengths, reuse, saves, in real
time), so by default they are not served on the API port: ``--metrics-port`` serves
them on a listener of their own (``--metrics-host``, 127.0.0.1 by default), and
``--api-metrics`` puts them back on the API port for a server with one user. Neither
shows the store's path.
"""

import json
import logging
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional, Tuple

log = logging.getLogger("kvstore.server")

PATHS = ("/kvstore/stats", "/metrics")
# socketserver listens with a backlog of 5 connections. Users who connect at once
# overflow it while the accepting thread waits for the GIL (the generation, prefetch
# and save threads hold it in turn), and the client's TCP stack retries a dropped
# handshake only a second later: one user in eight started 1.04 s late on an H100.
LISTEN_BACKLOG = 128
OFF_API_PORT = (
    "not served on this port: the server was started without --api-metrics "
    "(see --metrics-port)"
)


def without_path(value: Any, path: str) -> Any:
    """``value`` (JSON-like) with the store directory ``path`` cut out of every
    string: a file ``<store>/quarantine/x`` reads ``quarantine/x``."""
    prefixes = sorted({os.path.abspath(path), os.path.realpath(path)}, key=len)[::-1]

    def cut(x):
        if isinstance(x, str):
            for p in prefixes:
                x = x.replace(p + os.sep, "").replace(p, "<store>")
            return x
        if isinstance(x, dict):
            return {k: cut(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [cut(v) for v in x]
        return x

    return cut(value)


def respond(cache, path: str) -> Tuple[int, str, bytes]:
    """``(status, content type, body)`` of ``GET path`` (one of :data:`PATHS`) for
    the prompt cache ``cache`` (None: no persistent prompt cache yet)."""
    if cache is None:
        body = {"error": "no persistent prompt cache"}
        return 503, "application/json", json.dumps(body).encode()
    if path == "/metrics":
        return 200, cache.metrics.content_type, cache.metrics.exposition()
    return 200, "application/json", json.dumps(cache.stats()).encode()


class ApiServer(ThreadingHTTPServer):
    """mlx-lm's HTTP server class (a thread per request) with room in the listen
    backlog for a burst of users connecting at once (:data:`LISTEN_BACKLOG`)."""

    request_queue_size = LISTEN_BACKLOG


class ApiStatus:
    """What the API port is doing, for the metrics listener's ``GET /health``
    (a readiness probe on the metrics port): ``starting`` until it listens (the
    model loads first), ``ok`` while it serves, ``stopping`` from its shutdown on
    (pending writes are flushed then)."""

    def __init__(self):
        self.value = "starting"

    def server_class(self, base: type = ApiServer) -> type:
        """``base`` telling this status when it listens and when it shuts down."""
        status = self

        class Server(base):
            def server_activate(self):
                super().server_activate()
                status.value = "ok"

            def shutdown(self):
                status.value = "stopping"
                super().shutdown()

        return Server


class MetricsListener:
    """``GET /metrics``, ``GET /kvstore/stats`` and ``GET /health`` on an address of
    their own, in a daemon thread.

    Args:
        host, port: Where to listen (bound at construction: a taken port fails now).
        cache: Returns the server's prompt cache, or None before it exists.
        health: Returns the API's status (:class:`ApiStatus`): ``/health`` answers
            200 when it is ``ok``, else 503 with it. None: always ``ok``.

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(
        self,
        host: str,
        port: int,
        cache: Callable[[], Optional[Any]],
        *,
        health: Optional[Callable[[], str]] = None,
    ):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                path = self.path.split("?")[0]
                if path == "/health":
                    state = health() if health is not None else "ok"
                    status = 200 if state == "ok" else 503
                    ctype = "application/json"
                    body = json.dumps({"status": state}).encode()
                elif path in PATHS:
                    status, ctype, body = respond(cache(), path)
                else:
                    status, ctype, body = 404, "text/plain", b"Not Found"
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt, *args):
                log.debug("kvstore metrics: " + fmt, *args)

        # IPv4 or IPv6, as the host resolves (ThreadingHTTPServer assumes IPv4).
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]

        class Server(ApiServer):
            address_family = family
            daemon_threads = True

        self._server = Server((host, port), Handler)
        self.address = self._server.server_address[:2]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="kvstore-metrics", daemon=True
        )

    def start(self) -> None:
        self._thread.start()
        host, port = self.address
        host = f"[{host}]" if ":" in host else host
        log.info("kvstore: metrics on http://%s:%d", host, port)

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()
