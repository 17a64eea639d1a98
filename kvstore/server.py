"""``kvstore serve``: mlx-lm's own HTTP server with a persistent prompt cache.

The real ``mlx_lm.server`` runs unchanged; three of its module-level names are
replaced while it runs:

* ``LRUPromptCache`` by a factory returning :class:`PersistentPromptCache` (mlx-lm's
  own ``LRUPromptCache`` for RAM, plus a :class:`kvstore.KVStore` per model on disk);
* ``ModelProvider`` by a subclass that lets the cache find the loaded model;
* ``_run_http_server`` by a call with :class:`KVStoreAPIHandler`, which applies
  ``--strip-pattern`` to request bodies (refusing a prompt left empty), reads each
  request's cache salt, and with ``--api-metrics`` adds ``GET /kvstore/stats`` and
  ``GET /metrics`` (else they are served on ``--metrics-port`` only,
  :mod:`kvstore.serve_metrics`);
* ``ResponseGenerator`` and ``BatchGenerator`` by subclasses that carry each
  request's salt to the prompt cache (:mod:`kvstore.serve_salts`).

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
:mod:`kvstore.metrics`).
Also runnable as ``python -m kvstore.server``.
"""

import argparse
import functools
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .disk.salts import parse_salt
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
from .serve.metrics import ServeMetrics
from .serve.prefetch import (
    Prefetched,
    Prefetcher,
    prefetch_response_generator_class,
)
from .serve.request_salts import (
    UNKNOWN,
    SaltedCache,
    SaltPolicy,
    SaltRouter,
    batch_generator_class,
    missing_hooks,
    response_generator_class,
)
from .serve.saves import SaveJob, SaveQueue, evaluate
from .serve.timing import (
    PrefillClock,
    timed_batch_generator_class,
    timed_response_generator_class,
)

log = logging.getLogger("kvstore.server")

_COUNTER_NAMES = (
    "requests",
    "ram_hits",
    "disk_hits",
    "remote_hits",
    "misses",
    "tokens_requested",
    "tokens_reused",
    "tokens_reused_ram",
    "tokens_reused_disk",
    "tokens_reused_remote",
    "tokens_computed",
    "restore_seconds",
    "restores_prefetched",
    "saves",
    "saves_skipped",
    "saves_unattributed",
    "saves_deferred",
    "saves_merged",
    "saves_lost",
    "store_errors",
    "rejected_requests",
)

_FROM_REQUEST = object()  # the salt of the request being served (SaltRouter)


@dataclass(frozen=True)
class _SaltedKey:
    """The RAM LRU's model key for a salted request: salts never share an entry."""

    model: Any
    salt: Any


def _ram_key(model, salt):
    return model if salt is None else _SaltedKey(model, salt)


class PersistentPromptCache:
    """mlx-lm's ``LRUPromptCache`` backed by a :class:`kvstore.KVStore` per model.

    Same interface as ``mlx_lm.models.cache.LRUPromptCache``. ``fetch_nearest_cache``
    returns the longer of the RAM LRU's nearest cache and the store's longest stored
    prefix; ``insert_cache`` inserts into the RAM LRU and queues the prompt's KV for the
    store (background writer). Storage problems are logged, never raised.

    Both take the request's cache salt: ``salt=`` when given, else the one ``salts``
    (a :class:`~kvstore.serve_salts.SaltRouter`) knows, else None (unsalted). A
    salted request reuses only what was saved under its salt, in RAM and on disk. A
    request whose salt the router cannot tell is neither served from nor stored in
    any cache.

    Args:
        store_dir: The store directory (created when missing).
        model_provider: Anything with ``model``, ``tokenizer`` and ``model_key``
            attributes (``mlx_lm.server.ModelProvider``); a store is opened lazily
            for the model currently loaded, keyed by ``model_key``.
        max_size, max_bytes: The RAM LRU's limits (as ``LRUPromptCache``).
        store_kwargs: Extra keyword arguments for ``KVStore``.
        salts: Where the salt of the request being served comes from (the server's
            generation thread); None: unsalted unless ``salt=`` is passed.
    """

    def __init__(
        self,
        store_dir: str,
        model_provider,
        max_size: int = 10,
        max_bytes: int = 1 << 63,
        *,
        store_kwargs: Optional[Dict[str, Any]] = None,
        salts: Optional[SaltRouter] = None,
    ):
        from mlx_lm.models.cache import LRUPromptCache

        self.store_dir = os.fspath(store_dir)
        self.model_provider = model_provider
        self.store_kwargs = dict(store_kwargs or {})
        self._lru = LRUPromptCache(max_size, max_bytes)
        # mlx-lm's LRU is the generation thread's; prefetch threads only search it.
        self._lru_lock = threading.RLock()
        self._stores: Dict[Any, Any] = {}  # model key -> KVStore, or None (unusable)
        self._lock = threading.Lock()
        self._counters = {name: 0 for name in _COUNTER_NAMES}
        self.salts = salts
        self.metrics = ServeMetrics(self.stats)
        # Started at each lookup: a sequential request's prefill is timed from here.
        self.prefill_clock = PrefillClock()
        # Restores started when requests arrive (kvstore serve sets one).
        self.prefetcher: Optional[Prefetcher] = None
        # Saves captured off the generation thread (kvstore serve sets one).
        self.saves: Optional[SaveQueue] = None

    # -- the LRUPromptCache interface --------------------------------------

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def nbytes(self) -> int:
        return self._lru.nbytes

    @property
    def max_size(self) -> int:
        return self._lru.max_size

    @property
    def max_bytes(self) -> int:
        return self._lru.max_bytes

    def trim_to(
        self, *, n_sequences: Optional[int] = None, n_bytes: Optional[int] = None
    ):
        with self._lru_lock:
            self._lru.trim_to(n_sequences=n_sequences, n_bytes=n_bytes)

    def stats_by_type(self):
        return self._lru.stats_by_type()

    def fetch_nearest_cache(self, model: Any, tokens: List[int], *, salt=_FROM_REQUEST):
        """``(cache or None, rest_tokens)``: the longest reusable prefix, RAM or disk.

        As ``LRUPromptCache``, except that a prompt found only on disk keeps at least
        its last token to compute (the store restores at most ``len(tokens) - 1``).
        On a tie the RAM cache is used; the store restores only when its index says
        it holds more than RAM (with a remote tier it is always asked).

        Runs on mlx-lm's generation thread, which an exception would end for good:
        any failure is logged and counted (``store_errors``) and is a miss.
        """
        try:
            return self._fetch_nearest(model, tokens, salt)
        except Exception:
            log.exception("kvstore: prompt cache lookup failed; computing the prompt")
            n = len(tokens) if isinstance(tokens, list) else 0
            self._count(
                requests=1,
                misses=1,
                store_errors=1,
                tokens_requested=n,
                tokens_computed=n,
            )
            return None, tokens

    def _fetch_nearest(self, model: Any, tokens: List[int], salt):
        salt = self._salt(salt, self.salts.request if self.salts else None)
        if salt is UNKNOWN:
            self._count(
                requests=1,
                misses=1,
                tokens_requested=len(tokens),
                tokens_computed=len(tokens),
            )
            return None, tokens
        pre = self.prefetcher.take() if self.prefetcher is not None else None
        with self._lru_lock:
            cache, rest = self._lru.fetch_nearest_cache(_ram_key(model, salt), tokens)
        ram_n = len(tokens) - len(rest) if cache is not None else 0
        source, n, seconds, from_ram = ("ram" if ram_n else None), ram_n, 0.0, ram_n
        prefetched = False
        # The store gives at most len(tokens) - 1 tokens: ask only when it may do better.
        store = self._store_for(model) if ram_n < len(tokens) - 1 else None
        if store is not None:
            remote_hits = _remote_hits(store)
            tic = time.perf_counter()
            try:
                tail, prefetched = _prefetched_tail(pre, model, tokens, ram_n, salt)
                if not prefetched:
                    tail = _stored_tail(store, tokens, ram_n, salt)
                got = None
                if tail is not None:
                    got = _extended(store, tokens, cache, ram_n, tail, salt)
            except Exception:
                log.exception("kvstore: store fetch failed; continuing without it")
                self._count(store_errors=1)
                got = None
            seconds = time.perf_counter() - tic
            if got is not None:
                # The remote tier may have supplied the nodes on the prefetch thread.
                remote = _remote_hits(store) > remote_hits
                source = "remote" if remote or (prefetched and pre.remote) else "disk"
                cache, n, from_ram = got
                rest = tokens[n:]
                self.metrics.restore_seconds.observe(seconds)
        self._count(
            requests=1,
            ram_hits=source == "ram",
            disk_hits=source == "disk",
            remote_hits=source == "remote",
            misses=source is None,
            tokens_requested=len(tokens),
            tokens_reused=n,
            tokens_reused_ram=from_ram,
            tokens_reused_disk=n - from_ram if source == "disk" else 0,
            tokens_reused_remote=n - from_ram if source == "remote" else 0,
            tokens_computed=len(rest),
            restore_seconds=seconds,
            restores_prefetched=prefetched and source in ("disk", "remote"),
        )
        log.info(
            "kvstore: prompt %d tokens: reused %d (%s%s), computing %d, restore %.1f ms%s",
            len(tokens),
            n,
            source or "miss",
            f", {from_ram} of them from ram" if 0 < from_ram < n else "",
            len(rest),
            seconds * 1e3,
            f" (prefetched in {pre.seconds * 1e3:.1f} ms)" if prefetched else "",
        )
        self.prefill_clock.looked_up(len(rest))
        return cache, rest

    def insert_cache(
        self,
        model: Any,
        tokens: List[int],
        prompt_cache: List[Any],
        *,
        cache_type: str = "assistant",
        salt=_FROM_REQUEST,
    ):
        """Insert into the RAM LRU and queue the KV of ``tokens`` for the store,
        both under the salt of the request the cache came from.

        Runs on mlx-lm's generation thread, which an exception would end for good:
        any failure is logged and counted (``saves_skipped``, ``store_errors``).
        """
        try:
            self._insert(model, tokens, prompt_cache, cache_type, salt)
        except Exception:
            log.exception("kvstore: a prompt cache was not kept")
            self._count(saves_skipped=1, store_errors=1)

    def _insert(self, model, tokens, prompt_cache, cache_type: str, salt) -> None:
        tag = getattr(prompt_cache, "kvstore_salt", _FROM_REQUEST)
        if isinstance(prompt_cache, SaltedCache):
            prompt_cache = list(prompt_cache)
        if salt is _FROM_REQUEST:
            salt = tag  # mlx-lm's batch loop: tagged by SaltedBatchGenerator
        salt = self._salt(salt, self.salts.sequential_salt if self.salts else None)
        if salt is UNKNOWN:
            self._count(saves_skipped=1, saves_unattributed=1)
            log.warning("kvstore: a cache of an unknown request was not kept")
            return
        with self._lru_lock:
            self._lru.insert_cache(
                _ram_key(model, salt), tokens, prompt_cache, cache_type=cache_type
            )
        store = self._store_for(model)
        if store is None:
            return
        held = _held_tokens(store, prompt_cache)
        if not tokens or not held:
            self._count(saves_skipped=1)
            return
        # A cache that holds fewer tokens than its key (mlx-lm's sequential path keys
        # the cache with the last generated token, which was never fed) is saved for
        # the tokens it does hold.
        if self.saves is not None:
            evaluate(prompt_cache)  # here: the save thread reads finished arrays only
            job = SaveJob(
                store, model, list(tokens), held, prompt_cache, cache_type, salt
            )
            self.saves.put(job)
            self._count(saves=1)
            return
        try:
            store.save_prefix(
                list(tokens[:held]), prompt_cache, kind=cache_type, salt=salt
            )
            self._count(saves=1)
        except Exception as e:
            log.warning("kvstore: not saved (%s: %s)", type(e).__name__, e)
            self._count(saves_skipped=1, store_errors=1)

    def prefetch(self, model_key, tokens: List[int], salt) -> Optional[Prefetched]:
        """On a prefetch thread: restore what the store holds of ``tokens`` past
        the RAM LRU's copy, for the request's lookup to take (see
        :mod:`kvstore.serve.prefetch`). Only a store already open is read."""
        tic = time.perf_counter()
        salt = self._salt(salt, None)
        with self._lock:
            store = self._stores.get(model_key)
        if store is None:
            return None
        held = self._ram_held(model_key, tokens, salt)
        tail, remote_hits = None, _remote_hits(store)
        if held < len(tokens) - 1:
            tail = _stored_tail(store, tokens, held, salt)
        seconds = time.perf_counter() - tic
        remote = _remote_hits(store) > remote_hits  # counted where it is used
        return Prefetched(model_key, salt, list(tokens), held, tail, seconds, remote)

    def can_prefetch(self) -> bool:
        """Whether this mlx-lm's LRU can be searched without copying a cache."""
        trie = getattr(self._lru, "_trie", None)
        return callable(getattr(trie, "search", None)) and callable(
            getattr(trie, "get", None)
        )

    def _ram_held(self, model_key, tokens: List[int], salt) -> int:
        """Tokens of ``tokens`` that the RAM LRU's ``fetch_nearest_cache`` would
        give now, found without copying its cache (mlx-lm's trie, read under the
        LRU's lock)."""
        from mlx_lm.models.cache import can_trim_prompt_cache

        with self._lru_lock:
            trie = self._lru._trie
            found = trie.search(_ram_key(model_key, salt), tokens)
            if found.exact is not None:
                return len(tokens)
            short = len(found.shorter) if found.shorter is not None else 0
            if found.longer is not None and found.common_prefix > short:
                entry = trie.get(found.model, found.longer)
                if can_trim_prompt_cache(entry.prompt_cache):
                    return min(len(tokens) - 1, found.common_prefix)
            return short

    def use_threads(self, prefetcher: Prefetcher) -> bool:
        """Restore on ``prefetcher``'s threads and save on a thread of this cache's
        own (``kvstore serve``); False when this mlx-lm's LRU cannot be searched
        (then both stay on the generation thread)."""
        if not self.can_prefetch():
            return False
        self.prefetcher = prefetcher
        self.saves = SaveQueue(in_ram=self._save_in_ram, count=self._count)
        return True

    def _save_in_ram(self, job: SaveJob) -> bool:
        """Whether RAM still holds the tokens ``job`` saves (a deferred save)."""
        return self._ram_held(job.model_key, job.tokens, job.salt) >= job.held

    def note_prefill(self, tokens: int, seconds: float) -> None:
        """The server prefilled ``tokens`` prompt tokens in ``seconds``: the open
        store learns the rate (and keeps it for the next process), so that
        ``restore="auto"`` weighs restores against this server's own prefill."""
        with self._lock:
            stores = [s for s in self._stores.values() if s is not None]
        for store in stores:
            try:
                store.note_prefill(tokens, seconds)
            except Exception:
                log.exception("kvstore: recording the prefill rate failed")

    @staticmethod
    def _salt(salt, from_request: Optional[Callable[[], Any]]):
        """``salt`` when given (checked), else the router's, else None."""
        if salt is _FROM_REQUEST:
            return from_request() if from_request is not None else None
        if salt is not UNKNOWN:
            parse_salt(salt)
        return salt

    # -- stores ---------------------------------------------------------------

    def _store_for(self, model_key):
        """The open store of ``model_key``, or None (another model, or no store)."""
        with self._lock:
            if model_key in self._stores:
                return self._stores[model_key]
        provider = self.model_provider
        if (
            provider is None
            or getattr(provider, "model_key", None) != model_key
            or provider.model is None
        ):
            return None
        store = None
        if getattr(provider, "draft_model", None) is not None:
            log.warning("kvstore: a draft model is loaded; the store is not used")
        elif getattr(provider, "processor", None) is not None:
            log.warning("kvstore: a vision model is loaded; the store is not used")
        else:
            try:
                from .store import KVStore

                store = KVStore(
                    self.store_dir,
                    provider.model,
                    provider.tokenizer,
                    **self.store_kwargs,
                )
                log.info(
                    "kvstore: store %s opened for %s",
                    self.store_dir,
                    model_key[0] if isinstance(model_key, tuple) else model_key,
                )
            except Exception as e:
                log.warning(
                    "kvstore: store %s not usable (%s: %s); serving from RAM only",
                    self.store_dir,
                    type(e).__name__,
                    e,
                )
                self._count(store_errors=1)
        with self._lock:
            old = {k: s for k, s in self._stores.items() if s is not None}
            self._stores = {model_key: store}  # one model at a time, like ModelProvider
        for s in old.values():
            _close_quietly(s)
        return store

    def open_store(self, model_key):
        """Open the store of ``model_key`` now (else done at its first request)."""
        return self._store_for(model_key)

    def flush(self) -> None:
        """Wait until every queued write of every open store is on disk."""
        if self.saves is not None:
            self.saves.flush()
        with self._lock:
            stores = [s for s in self._stores.values() if s is not None]
        for s in stores:
            try:
                s.flush()
            except Exception:
                log.exception("kvstore: flush failed")

    def close(self) -> None:
        """Flush and close the stores. Idempotent."""
        if self.prefetcher is not None:
            self.prefetcher.close()
        if self.saves is not None:
            self.saves.close()  # hands every queued save to its store's writer
        with self._lock:
            stores, self._stores = [
                s for s in self._stores.values() if s is not None
            ], {}
        for s in stores:
            _close_quietly(s)

    def stats(self) -> Dict[str, Any]:
        """This process's counters, the RAM LRU, and each open store's ``stats()``."""
        with self._lock:
            out: Dict[str, Any] = dict(self._counters)
            stores = [s for s in self._stores.values() if s is not None]
        out["ram_sequences"] = len(self._lru)
        out["ram_bytes"] = self._lru.nbytes
        out["stores"] = []
        for s in stores:
            try:
                stats = s.stats()
                stats.pop("path", None)
                out["stores"].append(stats)
            except Exception as e:
                out["stores"].append({"error": f"{type(e).__name__}: {e}"})
        # Served to HTTP clients: no file system path.
        return serve_metrics.without_path(out, self.store_dir)

    def _count(self, **deltas) -> None:
        with self._lock:
            for name, d in deltas.items():
                self._counters[name] += d


def _remote_hits(store) -> int:
    """Fetches the store's remote tier extended so far (0 without one)."""
    if store.remote is None:
        return 0
    try:
        return store.remote.stats().get("remote_hits", 0)
    except Exception:
        return 0


def _prefetched_tail(pre: Optional[Prefetched], model, tokens, ram_n: int, salt):
    """``(tail or None, True)`` when the prefetch ``pre`` of this very request
    (model, salt, tokens) tells what the store adds to ``ram_n`` RAM tokens;
    ``(None, False)`` when it cannot (none, or RAM lost tokens since)."""
    if pre is None or pre.model_key != model or pre.salt != salt:
        return None, False
    if pre.tokens != list(tokens):
        return None, False
    tail = pre.tail
    if tail is None:
        return None, ram_n >= pre.held  # nothing past what RAM held, or not worth it
    if tail.start > ram_n:
        return None, False  # RAM lost the tokens the tail goes after
    return (tail if tail.end > ram_n else None), True


def _stored_tail(store, tokens: List[int], ram_n: int, salt):
    """What the store holds of ``tokens`` past a RAM copy of ``ram_n`` of them (a
    :class:`kvstore.engine.tail.Tail`: only the nodes past the copy are read), or None
    when it holds no more or prefilling the difference is cheaper (by the
    measured rates)."""
    # The index alone tells whether the store holds more (a remote tier may).
    if store.remote is None and store.lookup(tokens, salt=salt) <= ram_n:
        return None
    tail = store.fetch_beyond(tokens, ram_n, salt=salt)
    return tail if tail is not None and tail.end > ram_n else None


def _extended(
    store, tokens: List[int], cache, ram_n: int, tail, salt
) -> Optional[Tuple[List[Any], int, int]]:
    """The RAM copy ``cache`` (``ram_n`` tokens) with ``tail`` appended:
    ``(cache, tokens held, tokens of them taken from the RAM copy)``."""
    if tail.start == 0:
        return tail.cache, tail.end, 0
    try:
        return store.join_tail(cache, tail, query=len(tokens)), tail.end, tail.start
    except (TypeError, ValueError) as e:  # LayoutMismatch: a RAM copy of other layers
        log.info("kvstore: RAM copy not extended (%s); restoring the prefix", e)
    whole, n = store.fetch(tokens, salt=salt)
    return (whole, n, 0) if n > ram_n else None


def _held_tokens(store, cache: Sequence[Any]) -> int:
    """Tokens ``cache`` holds when it has the store's layout; 0 when that cannot be
    told (batch caches, a draft model's, recurrent layers only: they do not count)."""
    try:
        return store.held_tokens(cache) or 0
    except Exception:
        return 0


def _close_quietly(store) -> None:
    try:
        store.close()
    except Exception:
        log.exception("kvstore: closing the store failed")


# -- request bodies -------------------------------------------------------------


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
                    cache._count(rejected_requests=1)
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

    missing = missing_hooks(mls)  # what carries a request's salt to the cache
    if missing:
        print(server_refusal(f"{name} is missing" for name in missing), file=sys.stderr)
        return 2

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if "-h" in argv or "--help" in argv:
        parser.print_help()
        print("\nmlx_lm.server options:\n")
    args, rest = parser.parse_known_args(argv)
    try:
        patterns, store_dir = _check_options(args)
    except _BadOption as e:
        print(f"kvstore serve: {e}", file=sys.stderr)
        return 2
    listener = None
    if args.metrics_port is not None:
        try:  # a taken port fails now, before the model loads
            listener = serve_metrics.MetricsListener(
                args.metrics_host,
                args.metrics_port,
                lambda: caches[-1] if caches else None,
            )
        except OSError as e:
            print(
                f"kvstore serve: bad --metrics-port/--metrics-host: cannot listen on "
                f"{args.metrics_host}:{args.metrics_port}: {e.strerror or e}",
                file=sys.stderr,
            )
            return 2
    caches, saved = _install(mls, args, store_dir, patterns)
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


class _BadOption(Exception):
    """An option of ``kvstore serve`` that cannot work (exit status 2)."""


def _check_options(args) -> Tuple[List["re.Pattern"], str]:
    """The compiled ``--strip-pattern`` expressions and the store directory. What
    would fail only after the model loaded fails now (_BadOption with the message)."""
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
        # is checked once, so a damaged one is refused here, not met while serving.
        check_store(store_dir, check="full")
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


def _install(mls, args, store_dir: str, patterns: List["re.Pattern"]):
    """Replace ``mlx_lm.server``'s prompt cache, model provider and HTTP handler with
    kvstore's. Returns the caches made (filled once the server builds them) and the
    replaced names' originals, for :func:`_run` to put back."""
    caches: List[PersistentPromptCache] = []
    providers: List[Any] = []

    class KVStoreModelProvider(mls.ModelProvider):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            providers.append(self)

        def _load(self, *a, **kw):
            super()._load(*a, **kw)
            for cache in caches:  # open the store now: pinned prefixes are preloaded
                cache.open_store(self.model_key)

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
        if not cache.use_threads(prefetcher):
            log.warning(
                "kvstore: this mlx-lm's LRU cannot be searched: restores and saves "
                "run on the generation thread"
            )
        caches.append(cache)
        return cache

    def on_prefill(tokens: int, seconds: float) -> None:
        if caches:
            caches[-1].note_prefill(tokens, seconds)

    router, clock = SaltRouter(), PrefillClock()
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
    prefetcher = Prefetcher()

    def prepare(model_key, tokens, salt):
        cache = caches[-1] if caches else None
        if cache is None or cache.prefetcher is not prefetcher:
            return None
        return cache.prefetch(model_key, tokens, salt)

    generator = response_generator_class(
        prefetch_response_generator_class(
            saved["ResponseGenerator"], prefetcher, prepare
        ),
        router,
    )
    if getattr(mls, "Response", None) is not None:  # the sequential path's tokens
        generator = timed_response_generator_class(
            generator, mls.Response, clock, on_prefill
        )
    mls.ResponseGenerator = generator
    mls.BatchGenerator = timed_batch_generator_class(
        batch_generator_class(saved["BatchGenerator"], router), on_prefill
    )
    mls._run_http_server = functools.partial(
        saved["_run_http_server"], handler_class=handler
    )
    return caches, saved


def _run(mls, rest: List[str], caches: List[PersistentPromptCache], saved) -> int:
    """Run ``mlx_lm.server.main()`` with ``rest`` as its arguments until SIGTERM or
    SIGINT, then restore what :func:`_install` replaced and close the stores.
    Returns the exit status."""

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt  # mlx-lm's serve_forever shutdown path

    old_term = signal.signal(signal.SIGTERM, on_sigterm)
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
        for name, value in saved.items():
            setattr(mls, name, value)
        for cache in caches:
            cache.close()  # waits for pending writes
        if caches:
            log.info("kvstore: stores flushed and closed")
    return status


if __name__ == "__main__":
    sys.exit(main())
