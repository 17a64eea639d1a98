"""``kvstore serve``: mlx-lm's own HTTP server with a persistent prompt cache.

The real ``mlx_lm.server`` runs unchanged; three of its module-level names are
replaced while it runs:

* ``LRUPromptCache`` by a factory returning a
  :class:`~kvstore.serve.prompt_cache.PersistentPromptCache` (mlx-lm's own
  ``LRUPromptCache`` for RAM, plus a :class:`kvstore.KVStore` per model on disk);
* ``ModelProvider`` by a subclass that lets the cache find the loaded model;
* ``_run_http_server`` by a call with :class:`kvstore.serve.listener.ApiServer` (a
  listen backlog for users who connect at once) and :class:`KVStoreAPIHandler`, which
  applies ``--strip-pattern`` to request bodies (refusing a prompt left empty), reads
  each request's cache salt, and with ``--api-metrics`` adds ``GET /kvstore/stats``
  and ``GET /metrics`` (else they are served on ``--metrics-port`` only,
  :mod:`kvstore.serve.listener`);
* ``ResponseGenerator`` and ``BatchGenerator`` by subclasses that carry each
  request's salt to the prompt cache (:mod:`kvstore.serve.request_salts`).

Cache salts (``cache_salt`` in the body, as vLLM's server takes it, or
``--salt-header NAME``; ``--require-salt``): a request reuses only KV saved under its
own salt, in RAM and in the store; unsalted requests share the unsalted pool.

Strip patterns are compiled with ``re.MULTILINE`` and removed (``re.sub(p, "", ...)``)
from every message's text content and from plain prompts before tokenization, so a
per-request line does not change the prompt's tokens and defeat the cache. The usual
example, a billing header that some clients put at the top of the system prompt::

    kvstore serve --model M --strip-pattern '^x-anthropic-billing-header: .*\\n?'

Counters: one log line per request (``kvstore: prompt N tokens: reused R
(ram|disk|remote|miss), computing C, restore T ms``), ``GET /kvstore/stats`` (JSON:
this process's totals, the RAM LRU, and each open store's ``KVStore.stats()``, without
the store's path) and ``GET /metrics`` (the same in the Prometheus text format,
:mod:`kvstore.serve.metrics`).
Also runnable as ``python -m kvstore.server``.
"""

import argparse
import faulthandler
import functools
import ipaddress
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .options import (
    add_remote_options,
    add_size_options,
    default_store,
    int_at_least,
    remote_options,
    store_disk_budget,
)
from .platform.compat import check_server, server_refusal
from .serve import listener as serve_metrics
from .serve.prefetch import HOOKED as PREFETCH_HOOKED
from .serve.prefetch import WORKERS, Prefetcher, prefetch_response_generator_class
from .serve.request_salts import (
    SaltPolicy,
    SaltRouter,
    batch_generator_class,
    missing_hooks,
    response_generator_class,
)
from .serve.saves import StepHeldSaves
from .serve.timing import (
    Activity,
    PrefillClock,
    timed_batch_generator_class,
    timed_response_generator_class,
)

log = logging.getLogger("kvstore.server")

from .serve.prompt_cache import PersistentPromptCache


def strip_text(text: str, patterns: Sequence["re.Pattern"]) -> str:
    for p in patterns:
        text = p.sub("", text)
    return text


def strip_body(body: Dict[str, Any], patterns: Sequence["re.Pattern"]) -> None:
    """Remove ``patterns`` from a chat or completion request body, in place."""
    if not patterns or not isinstance(body, dict):
        return
    if isinstance(body.get("prompt"), str):
        body["prompt"] = strip_text(body["prompt"], patterns)
    for m in body.get("messages") or ():
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, str):
            m["content"] = strip_text(content, patterns)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    part["text"] = strip_text(part["text"], patterns)


_PENALTY_WINDOWS = (
    "repetition_context_size",
    "presence_context_size",
    "frequency_context_size",
)
MAX_PENALTY_WINDOW = 1 << 20  # tokens a penalty looks back over: past any context


def check_body(body: Dict[str, Any], vocab_size: Optional[int]) -> None:
    """Refuse what mlx-lm's server lets through to its generation thread and cannot
    survive there: ``stop`` that is not text and penalty windows too large to
    allocate (the thread dies), ``logit_bias`` token ids outside the vocabulary (the
    process crashes in MLX).

    Raises:
        ValueError: naming the field (sent back as a 400).
    """
    for name in _PENALTY_WINDOWS:
        size = body.get(name)
        if isinstance(size, int) and size > MAX_PENALTY_WINDOW:
            raise ValueError(f"{name} must be at most {MAX_PENALTY_WINDOW}")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str):
        if not isinstance(stop, list) or not all(isinstance(w, str) for w in stop):
            raise ValueError("stop must be a string or a list of strings")
    bias = body.get("logit_bias")
    if isinstance(bias, dict):
        for key in bias:
            try:
                token = int(key)
            except (TypeError, ValueError):
                continue  # mlx-lm's own check names it
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                ids = "not negative" if vocab_size is None else f"0 to {vocab_size - 1}"
                raise ValueError(
                    f"logit_bias token id {token} is not a token of this model "
                    f"(ids are {ids})"
                )


def _vocab_size(provider) -> Optional[int]:
    """The loaded model's output size (its vocabulary), None when not told."""
    model = getattr(provider, "model", None)
    args = getattr(model, "args", None)
    for source in (args, getattr(args, "text_config", None)):
        size = (
            source.get("vocab_size")
            if isinstance(source, dict)
            else getattr(source, "vocab_size", None)
        )
        if isinstance(size, int) and size > 0:
            return size
    tokenizer = getattr(provider, "tokenizer", None)
    try:
        return len(tokenizer) if tokenizer is not None else None
    except TypeError:
        return None


def make_handler_class(
    base,
    patterns: Sequence["re.Pattern"],
    salt_policy: Optional[SaltPolicy] = None,
    *,
    api_metrics: bool = True,
):
    """mlx-lm's ``APIHandler`` plus ``GET /kvstore/stats`` and ``GET /metrics``
    (``api_metrics``; else a 404 saying so), ``--strip-pattern`` and the request's
    cache salt (``salt_policy``; default: the ``cache_salt`` body field)."""
    policy = salt_policy or SaltPolicy()

    class KVStoreAPIHandler(base):
        def validate_model_parameters(self):
            super().validate_model_parameters()
            provider = getattr(self.response_generator, "model_provider", None)
            check_body(self.body, _vocab_size(provider))
            try:
                self.kvstore_salt = policy.salt_of(self.body, self.headers)
            except ValueError:  # mlx-lm answers 400 with the message
                cache = self._prompt_cache()
                if cache is not None:
                    cache.count(rejected_requests=1)
                raise

        def handle_chat_completions(self):
            strip_body(self.body, patterns)
            request = super().handle_chat_completions()
            request.kvstore_salt = getattr(self, "kvstore_salt", None)
            return request

        def handle_text_completions(self):
            # mlx-lm's generation thread dies on an empty prompt: refuse it (400).
            if self.body.get("prompt") == "":
                raise ValueError("prompt is empty: send the text to complete")
            strip_body(self.body, patterns)
            if self.body.get("prompt") == "":
                raise ValueError(
                    "prompt is empty once --strip-pattern is applied: send text "
                    "beyond the stripped lines"
                )
            request = super().handle_text_completions()
            request.kvstore_salt = getattr(self, "kvstore_salt", None)
            return request

        def _prompt_cache(self) -> Optional[PersistentPromptCache]:
            cache = getattr(self.response_generator, "prompt_cache", None)
            return cache if isinstance(cache, PersistentPromptCache) else None

        def do_GET(self):
            path = self.path.split("?")[0]
            if path not in serve_metrics.PATHS:
                return super().do_GET()
            if api_metrics:
                status, ctype, body = serve_metrics.respond(self._prompt_cache(), path)
            else:
                status, ctype = 404, "application/json"
                body = json.dumps({"error": serve_metrics.OFF_API_PORT}).encode()
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()

    return KVStoreAPIHandler


# -- command line ----------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvstore serve",
        add_help=False,
        allow_abbrev=False,
        description="mlx_lm.server with a persistent prompt cache. Every option not "
        "listed here is passed to mlx_lm.server (see `mlx_lm.server --help`).",
    )
    p.add_argument(
        "--store",
        help="store directory (default: $KVSTORE_DIR, else ~/.cache/kvstore/store)",
    )
    p.add_argument(
        "--strip-pattern",
        action="append",
        default=[],
        metavar="REGEX",
        help="remove matches (re.MULTILINE) from message contents and prompts before "
        "tokenization; repeatable. E.g. '^x-anthropic-billing-header: .*\\n?'",
    )
    add_size_options(p)
    add_remote_options(
        p,
        required=False,
        help="shared remote tier s3://bucket/prefix behind the store (endpoint and "
        "credentials from AWS_* variables)",
    )
    p.add_argument(
        "--prefetch-threads",
        type=int_at_least(1, 64),
        default=WORKERS,
        metavar="N",
        help="restores of arriving requests run on N threads at once "
        f"(default: {WORKERS})",
    )
    p.add_argument(
        "--salt-header",
        metavar="NAME",
        help="take each request's cache salt from this header (set by a gateway, "
        "e.g. X-Tenant); a cache_salt in the body then narrows it",
    )
    p.add_argument(
        "--require-salt",
        action="store_true",
        help="refuse (400) a request without a salt (without --salt-header's header)",
    )
    p.add_argument(
        "--metrics-port",
        type=int_at_least(0, 65535),
        metavar="PORT",
        help="serve GET /metrics and /kvstore/stats on this port of --metrics-host, "
        "apart from the API port (they show every tenant's traffic)",
    )
    p.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        metavar="HOST",
        help="the address --metrics-port listens on, IPv4 or IPv6 (default: 127.0.0.1)",
    )
    p.add_argument(
        "--kvstore-log-level",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="level of kvstore's own log lines (default: mlx_lm.server's "
        "--log-level); DEBUG adds when each save is captured and written",
    )
    p.add_argument(
        "--api-metrics",
        action="store_true",
        help="also serve GET /metrics and /kvstore/stats on the API port (for a "
        "server whose clients may see each other's traffic)",
    )
    return p


_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP token


def main(argv: Optional[List[str]] = None, *, hard_exit: bool = True) -> int:
    """``kvstore serve [--store DIR] [--strip-pattern REGEX ...] [mlx_lm.server options]``.

    Runs ``mlx_lm.server.main()`` with the persistent prompt cache until SIGTERM or
    SIGINT, then flushes and closes the stores. With ``hard_exit`` (the default) the
    process then ends with ``os._exit(0)``; otherwise returns the exit status.
    """
    # Before a model loads: a missing mlx-lm internal.
    if not check_server(cache_class=PersistentPromptCache):
        return 2
    import mlx_lm.server as mls

    # What carries a request's salt to the cache, and its prefetch to the lookup.
    missing = missing_hooks(mls) + missing_hooks(mls, PREFETCH_HOOKED)
    if missing:
        print(server_refusal(f"{name} is missing" for name in missing), file=sys.stderr)
        return 2

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if "-h" in argv or "--help" in argv:
        parser.print_help()
        print("\nmlx_lm.server options:\n")
    args, rest = parser.parse_known_args(argv)
    if args.kvstore_log_level:
        logging.getLogger("kvstore").setLevel(args.kvstore_log_level)
    try:
        patterns, store_dir = _check_options(args, rest)
    except _BadOption as e:
        print(f"kvstore serve: {e}", file=sys.stderr)
        return 2
    listener = None
    api = serve_metrics.ApiStatus()
    if args.metrics_port is not None:
        try:  # a taken port fails now, before the model loads
            listener = serve_metrics.MetricsListener(
                args.metrics_host,
                args.metrics_port,
                lambda: caches[-1] if caches else None,
                health=lambda: api.value,
            )
        except OSError as e:
            print(
                f"kvstore serve: bad --metrics-port/--metrics-host: cannot listen on "
                f"{args.metrics_host}:{args.metrics_port}: {e.strerror or e}",
                file=sys.stderr,
            )
            return 2
    caches, saved = _install(
        mls, args, store_dir, patterns, server_class=api.server_class()
    )
    if listener is not None:
        listener.start()
    try:
        status = _run(mls, rest, caches, saved)
    finally:
        if listener is not None:
            listener.close()
    if caches and hard_exit:
        # After mlx_lm.server's shutdown, the interpreter's teardown sometimes aborts in
        # MLX's C++ threads ("terminate called without an active exception", exit -6;
        # plain mlx_lm.server on SIGINT does the same). Everything is on disk by now.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def _api_address(rest: List[str]) -> Tuple[str, Optional[int]]:
    """The host and port mlx_lm.server will listen on, by its options and its
    defaults (port None: not a number, which its own parser reports)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", default="8080")
    known, _ = p.parse_known_args(rest)
    try:
        return known.host, int(known.port)
    except ValueError:
        return known.host, None


def _same_address(a: str, b: str) -> bool:
    """Whether listening on hosts ``a`` and ``b`` at one port would collide: the
    same first address (as both listeners resolve them) or a wildcard. Unresolved:
    False (the listener reports it)."""

    def first(host: str):
        try:
            info = socket.getaddrinfo(
                host or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
            return ipaddress.ip_address(info[0][4][0].split("%")[0])
        except (OSError, ValueError, IndexError):
            return None

    x, y = first(a), first(b)
    if x is None or y is None:
        return False
    return x == y or x.is_unspecified or y.is_unspecified


class _BadOption(Exception):
    """An option of ``kvstore serve`` that cannot work (exit status 2)."""


def _check_options(args, rest: List[str]) -> Tuple[List["re.Pattern"], str]:
    """The compiled ``--strip-pattern`` expressions and the store directory. What
    would fail only after the model loaded fails now (_BadOption with the message);
    ``rest``: mlx_lm.server's options."""
    if args.metrics_port:  # 0: a port the kernel picks
        host, port = _api_address(rest)
        if port == args.metrics_port and _same_address(host, args.metrics_host):
            # The API's bind would fail only after the model loaded.
            raise _BadOption(
                f"--metrics-port {port} is the API's port (--port): give it another"
            )
    try:
        patterns = [re.compile(p, re.MULTILINE) for p in args.strip_pattern]
    except re.error as e:
        raise _BadOption(f"bad --strip-pattern: {e}") from None
    if args.store is None:
        args.store = default_store()
    store_dir = os.path.expanduser(args.store)
    from .store import StoreError, check_store

    try:
        # A bad --store fails now, before the model loads; every page of the index
        # is checked once (unless the last close left the clean mark: checked then),
        # so a damaged one is refused here, not met while serving.
        check_store(store_dir, check="marked")
    except StoreError as e:
        raise _BadOption(f"bad --store: {e}") from None
    if args.salt_header is not None and not _HEADER_NAME.fullmatch(args.salt_header):
        raise _BadOption(
            f"bad --salt-header: {args.salt_header!r} is not an HTTP header name"
        )
    if args.remote is not None:
        from .remote import RemoteTier

        try:
            # A bad URL or no boto3 fails now (no request is made).
            RemoteTier(args.remote, **remote_options(args))
        except (TypeError, ValueError, ImportError) as e:
            raise _BadOption(f"bad --remote: {e}") from None
    return patterns, store_dir


def _install(
    mls,
    args,
    store_dir: str,
    patterns: List["re.Pattern"],
    *,
    server_class: type,
):
    """Replace ``mlx_lm.server``'s prompt cache, model provider, HTTP handler and
    server class (``server_class``) with kvstore's. Returns the caches made (filled
    once the server builds them) and the replaced names' originals, for
    :func:`_run` to put back."""
    caches: List[PersistentPromptCache] = []
    providers: List[Any] = []

    class KVStoreModelProvider(mls.ModelProvider):
        def __init__(self, *a, **kw):
            # Set while no model loads: requests arriving meanwhile wait for the
            # model and its store before they look for a prefix to prefetch.
            self.kvstore_idle = threading.Event()
            self.kvstore_idle.set()
            super().__init__(*a, **kw)
            providers.append(self)

        def _load(self, *a, **kw):
            self.kvstore_idle.clear()
            try:
                super()._load(*a, **kw)
                for cache in caches:  # open the store now: pinned prefixes preloaded
                    cache.open_store(self.model_key)
            finally:
                self.kvstore_idle.set()

    def prompt_cache_factory(max_size: int = 10, max_bytes: int = 1 << 63):
        provider = providers[-1] if providers else None
        cli_args = getattr(provider, "cli_args", None)
        store_kwargs = {}
        if args.remote is not None:  # a tier of its own for each store opened
            from .remote import RemoteTier

            store_kwargs["remote"] = RemoteTier(args.remote, **remote_options(args))
        store_kwargs["disk_bytes"] = store_disk_budget(store_dir, args.disk_bytes)
        if args.ram_bytes is not None:
            store_kwargs["ram_bytes"] = args.ram_bytes
        if args.restore_room is not None:
            store_kwargs["restore_room"] = args.restore_room
        if args.salt_disk_bytes is not None:
            store_kwargs["salt_disk_bytes"] = args.salt_disk_bytes
        if args.restore is not None:
            store_kwargs["restore"] = args.restore
        if getattr(cli_args, "kv_bits", None) is not None:
            # mlx-lm quantizes long prompts' KV (--kv-bits): store those caches.
            store_kwargs.update(
                kv_bits=cli_args.kv_bits, kv_group_size=cli_args.kv_group_size
            )
        cache = PersistentPromptCache(
            store_dir,
            provider,
            max_size,
            max_bytes,
            store_kwargs=store_kwargs,
            salts=router,
        )
        cache.prefill_clock = clock
        cache.activity = activity
        if cache.use_threads(prefetcher):
            cache.step_held = StepHeldSaves()  # queued at the loop's top
        else:
            log.warning(
                "kvstore: this mlx-lm's LRU cannot be searched: restores and saves "
                "run on the generation thread"
            )
        caches.append(cache)
        return cache

    def on_prefill(tokens: int, seconds: float) -> None:
        if caches:
            caches[-1].note_prefill(tokens, seconds)

    router, clock, activity = SaltRouter(), PrefillClock(), Activity()
    policy = SaltPolicy(header=args.salt_header, required=args.require_salt)
    handler = make_handler_class(
        mls.APIHandler, patterns, policy, api_metrics=args.api_metrics
    )
    saved = {
        name: getattr(mls, name)
        for name in (
            "LRUPromptCache",
            "ModelProvider",
            "_run_http_server",
            "ResponseGenerator",
            "BatchGenerator",
        )
    }
    mls.LRUPromptCache = prompt_cache_factory
    mls.ModelProvider = KVStoreModelProvider
    prefetcher = Prefetcher(workers=args.prefetch_threads)

    def threaded_cache():
        cache = caches[-1] if caches else None
        return cache if cache is not None and cache.prefetcher is prefetcher else None

    # (A PersistentPromptCache holding no sequence is falsy: it has a length.)
    def prepare(model_key, tokens, salt, weigh=True, registration=None):
        cache = threaded_cache()
        if cache is None:
            if registration is not None:
                registration.entry.abandon()
            return None
        return cache.prefetch(
            model_key, tokens, salt, weigh=weigh, registration=registration
        )

    def extent(model_key, tokens, salt):
        cache = threaded_cache()
        if cache is None:
            return 0, 0
        return cache.extent(model_key, tokens, salt)

    def register(model_key, tokens, salt, held):
        cache = threaded_cache()
        return None if cache is None else cache.register(model_key, tokens, salt, held)

    def loop_top(idle: bool) -> None:
        cache = threaded_cache()
        if cache is not None:
            cache.loop_top(idle=idle)

    def prefilled_instead():
        cache = threaded_cache()
        if cache is not None:
            cache.count(prefilled_instead=1)

    generator = response_generator_class(
        prefetch_response_generator_class(
            saved["ResponseGenerator"],
            prefetcher,
            prepare,
            extent,
            prefilled_instead,
            loop_top,
            register,
        ),
        router,
    )
    if getattr(mls, "Response", None) is not None:  # the sequential path's tokens
        generator = timed_response_generator_class(
            generator, mls.Response, clock, on_prefill, activity
        )
    mls.ResponseGenerator = generator
    mls.BatchGenerator = timed_batch_generator_class(
        batch_generator_class(saved["BatchGenerator"], router), on_prefill, activity
    )
    mls._run_http_server = functools.partial(
        saved["_run_http_server"],
        server_class=server_class,
        handler_class=handler,
    )
    return caches, saved


def _dump_stacks_on(signum: Optional[int]) -> Optional[int]:
    """Have ``signum`` print every thread's stack to stderr (``kill -USR1 PID`` on
    a server that stopped answering); returns it, or None where it cannot be."""
    if signum is None or not hasattr(faulthandler, "register"):  # Windows
        return None
    faulthandler.register(signum, all_threads=True, chain=False)
    return signum


def _run(mls, rest: List[str], caches: List[PersistentPromptCache], saved) -> int:
    """Run ``mlx_lm.server.main()`` with ``rest`` as its arguments until SIGTERM or
    SIGINT, then restore what :func:`_install` replaced and close the stores.
    Returns the exit status."""

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt  # mlx-lm's serve_forever shutdown path

    old_term = signal.signal(signal.SIGTERM, on_sigterm)
    dumps = _dump_stacks_on(getattr(signal, "SIGUSR1", None))
    old_argv = sys.argv
    sys.argv = ["kvstore serve"] + rest
    status = 0
    try:
        mls.main()
    except KeyboardInterrupt:
        pass
    except Exception:
        if not caches:
            raise
        # E.g. the port is taken: mlx-lm's generation thread is already running and
        # would keep the process alive.
        log.exception("kvstore serve: the server failed")
        status = 1
    finally:
        sys.argv = old_argv
        signal.signal(signal.SIGTERM, old_term)
        if dumps is not None:
            faulthandler.unregister(dumps)
        for name, value in saved.items():
            setattr(mls, name, value)
        for cache in caches:
            cache.close()  # waits for pending writes
        if caches:
            log.info("kvstore: stores flushed and closed")
    return status


if __name__ == "__main__":
    sys.exit(main())
