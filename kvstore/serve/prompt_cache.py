"""``kvstore serve``'s prompt cache: mlx-lm's RAM LRU in front of a store per model.

:class:`PersistentPromptCache` takes the place of ``mlx_lm.server``'s
``LRUPromptCache`` (:mod:`kvstore.server` installs it): a lookup returns the longer of
the RAM LRU's nearest cache and what the store holds past it (restored on the
request's prefetch thread, :mod:`kvstore.serve.prefetch`, sharing a prefix with
other arriving requests, :mod:`kvstore.serve.shared`); an insert keeps the cache in
RAM and queues its KV for the store (:mod:`kvstore.serve.saves`). Storage problems
are logged and counted, never raised into mlx-lm's generation thread.
"""

import copy
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..disk.salts import parse_salt
from . import listener as serve_metrics
from . import ramtrie
from .metrics import ServeMetrics
from .prefetch import Extent, Prefetched, Prefetcher
from .request_salts import (
    UNKNOWN,
    SaltedCache,
    SaltRouter,
)
from .saves import SaveJob, SaveQueue, Settled, StepHeldSaves, evaluate_all
from .shared import Registration, SharedRestores
from .tails import extended, joined_tail, prefetched_tail, stored_tail
from .timing import REST_S, Activity, PrefillClock

log = logging.getLogger("kvstore.server")
# Each prefetch at DEBUG (tools/bench_serve_gpu.py reads it back).
PREFETCH_LOG = (
    "kvstore: prefetch of %d tokens (%d in RAM): waited %.1f ms (%s), "
    "restored %s in %.1f ms"
)

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
    "restores_shared",
    "prefilled_instead",
    "saves",
    "saves_skipped",
    "saves_unattributed",
    "saves_deferred",
    "saves_held",
    "saves_merged",
    "saves_kept_evicted",
    "saves_lost",
    "store_errors",
    "rejected_requests",
)

# How long a flush waits for the generation loop to queue the saves it holds (it
# does once it has rested REST_S, at its next turn: 0.1 s apart while it idles).
FLUSH_WAIT_S = 5.0
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
    (a :class:`~kvstore.serve.request_salts.SaltRouter`) knows, else None (unsalted). A
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
        # When the generation loop last did work (kvstore serve sets one shared with
        # its batch and sequential paths): saves wait for it to rest.
        self.activity = Activity()
        # Restores started when requests arrive (kvstore serve sets one), and
        # those whose prefix one in progress shares.
        self.prefetcher: Optional[Prefetcher] = None
        self.shared = SharedRestores(freeze=self._frozen_tail)
        # Saves captured off the generation thread (kvstore serve sets one), and
        # those its batch loop holds for a step (set with the loop's hook).
        self.saves: Optional[SaveQueue] = None
        self.step_held: Optional[StepHeldSaves] = None
        self._settled = Settled()  # caches of queued saves, evaluated

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
            self.count(
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
            self.count(
                requests=1,
                misses=1,
                tokens_requested=len(tokens),
                tokens_computed=len(tokens),
            )
            return None, tokens
        pre = self.prefetcher.take() if self.prefetcher is not None else None
        self.shared.taken(pre.shared if pre is not None else None)
        cache, rest = self._ram_fetch(_ram_key(model, salt), tokens)
        ram_n = len(tokens) - len(rest) if cache is not None else 0
        kept = self._kept_by_a_save(model, salt, tokens, ram_n)
        if kept is not None:
            cache, ram_n = kept
            rest = tokens[ram_n:]
        source, n, seconds, from_ram = ("ram" if ram_n else None), ram_n, 0.0, ram_n
        prefetched = False
        # The store gives at most len(tokens) - 1 tokens: ask only when it may do better.
        store = self._store_for(model) if ram_n < len(tokens) - 1 else None
        if store is not None:
            remote_hits = _remote_hits(store)
            tic = time.perf_counter()
            try:
                tail, prefetched = prefetched_tail(pre, model, tokens, ram_n, salt)
                if not prefetched:
                    tail = stored_tail(store, tokens, ram_n, salt)
                got = None
                if tail is not None:
                    got = extended(store, tokens, cache, ram_n, tail, salt)
            except Exception:
                log.exception("kvstore: store fetch failed; continuing without it")
                self.count(store_errors=1)
                got = None
            seconds = time.perf_counter() - tic
            if got is not None:
                # The remote tier may have supplied the nodes on the prefetch thread.
                remote = _remote_hits(store) > remote_hits
                source = "remote" if remote or (prefetched and pre.remote) else "disk"
                cache, n, from_ram = got
                rest = tokens[n:]
                self.metrics.restore_seconds.observe(seconds)
        self.count(
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
            restores_shared=prefetched and source is not None and pre.joined,
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
        if kept is not None:
            log.info("kvstore: %d of them from a waiting save's KV", kept[1])
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
            self.count(saves_skipped=1, store_errors=1)

    def _insert(self, model, tokens, prompt_cache, cache_type: str, salt) -> None:
        tag = getattr(prompt_cache, "kvstore_salt", _FROM_REQUEST)
        if isinstance(prompt_cache, SaltedCache):
            prompt_cache = list(prompt_cache)
        if salt is _FROM_REQUEST:
            salt = tag  # mlx-lm's batch loop: tagged by SaltedBatchGenerator
        salt = self._salt(salt, self.salts.sequential_salt if self.salts else None)
        if salt is UNKNOWN:
            self.count(saves_skipped=1, saves_unattributed=1)
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
            self.count(saves_skipped=1)
            return
        # A cache that holds fewer tokens than its key (mlx-lm's sequential path keys
        # the cache with the last generated token, which was never fed) is saved for
        # the tokens it does hold.
        if self.saves is not None:
            job = SaveJob(
                store, model, list(tokens), held, prompt_cache, cache_type, salt
            )
            self.count(saves=1)
            if self.step_held is not None:
                self.step_held.hold(job, steps=self.activity.steps)
            else:
                self._queue_saves([job])
            return
        try:
            store.save_prefix(
                list(tokens[:held]), prompt_cache, kind=cache_type, salt=salt
            )
            self.count(saves=1)
        except Exception as e:
            log.warning("kvstore: not saved (%s: %s)", type(e).__name__, e)
            self.count(saves_skipped=1, store_errors=1)

    def loop_top(self, *, idle: bool) -> None:
        """At the top of each turn of the generation loop (on its thread): queue the
        saves :attr:`step_held` holds that are due (``idle``: the loop has no batch
        to step). Never raises."""
        if self.step_held is None or not len(self.step_held):
            return
        act = self.activity
        jobs = self.step_held.due(
            steps=act.steps,
            decoding=not act.prefilling,
            rested=idle and act.idle_for() >= REST_S,
        )
        self._queue_taken(jobs)

    def _queue_taken(self, jobs: List[SaveJob]) -> None:
        """Queue saves taken from :attr:`step_held`; a failure is logged and counted
        (the generation loop and ``close`` go on), and the jobs are handed either way
        (a flush waits for that)."""
        try:
            self._queue_saves(jobs)
        except Exception:
            log.exception("kvstore: held saves were not queued")
            self.count(saves_skipped=len(jobs), store_errors=1)
        finally:
            self.step_held.handed(len(jobs))

    def _queue_saves(self, jobs: List[SaveJob]) -> None:
        """Evaluate the jobs' caches here (the save thread reads finished arrays
        only), together, and queue them."""
        if not jobs:
            return
        tic = time.perf_counter()
        evaluate_all([job.cache for job in jobs], self._settled)
        for job in jobs:
            self.saves.put(job)
        log.debug(
            "kvstore: %d save(s) of %s tokens queued in %.1f ms",
            len(jobs),
            "/".join(str(job.held) for job in jobs),
            1e3 * (time.perf_counter() - tic),
        )

    def register(
        self, model_key, tokens: List[int], salt, held: int
    ) -> Optional[Registration]:
        """On the HTTP thread, as a request arrives: its restore entered among those
        that requests arriving later may share (:mod:`kvstore.serve.shared`), and
        the earlier one sharing its prefix, if any. None while no store is open.
        The registration goes to :meth:`prefetch`, or is abandoned."""
        salt = self._salt(salt, None)
        if salt is UNKNOWN or self._opened(model_key) is None:
            return None
        return self.shared.begin((model_key, salt), tokens, held)

    def prefetch(
        self,
        model_key,
        tokens: List[int],
        salt,
        *,
        weigh: bool = True,
        registration: Optional[Registration] = None,
    ) -> Optional[Prefetched]:
        """On a prefetch thread: restore what the store holds of ``tokens`` past
        the RAM LRU's copy, for the request's lookup to take (see
        :mod:`kvstore.serve.prefetch`). Only a store already open is read.
        ``weigh=False``: restored whatever the rates say of this request alone (it
        was weighed against the queue on its arrival, :class:`Backlog`).
        ``registration``: :meth:`register`'s on its arrival (else entered now)."""
        tic = time.perf_counter()
        salt = self._salt(salt, None)
        tail = head = None
        try:
            store = self._opened(model_key)
            if store is None:
                return None
            held = self._ram_held(model_key, tokens, salt)
            remote_hits = _remote_hits(store)
            if registration is None:
                registration = self.shared.begin((model_key, salt), tokens, held)
            entry, other, common = registration
            if held < len(tokens) - 1:
                if other is not None:
                    head = self.shared.head(other, common, waiter=entry)
                waited = time.perf_counter()
                if head is not None:
                    tail = joined_tail(store, tokens, head, common, salt, weigh)
                else:
                    if 2 * held < len(tokens):  # a whole prefix: joins go first
                        self.shared.let_joins_finish()  # their users come sooner
                    waited = time.perf_counter()
                    tail = stored_tail(store, tokens, held, salt, weigh)
                log.debug(
                    PREFETCH_LOG,
                    len(tokens),
                    held,
                    1e3 * (waited - tic),
                    "for a shared prefix" if head is not None else "for joins",
                    f"{tail.start}-{tail.end}" if tail is not None else "nothing",
                    1e3 * (time.perf_counter() - waited),
                )
        finally:
            if registration is not None:  # those waiting for it go on
                self.shared.end(registration.entry, tail)
        seconds = time.perf_counter() - tic
        remote = _remote_hits(store) > remote_hits  # counted where it is used
        return Prefetched(
            model_key,
            salt,
            list(tokens),
            held,
            tail,
            seconds,
            remote,
            shared=entry,
            joined=head is not None,
        )

    def extent(self, model_key, tokens: List[int], salt) -> Extent:
        """The tokens of ``tokens`` that the RAM LRU would give now, those the store
        may give, and the estimated seconds to restore the stored ones past RAM or
        to prefill them, by the index alone (about a millisecond, so that an
        arriving request need not queue for a restore to learn it; with a remote
        tier, all but the last are counted as stored, at no estimate). ``(0, 0)``
        when the store is not open or the salt is unknown; ``(held, 0)`` when RAM
        holds all the store could give (all but the last token). With
        ``restore="always"`` no read is estimated: every stored prefix is restored,
        never weighed against the queue (:class:`~kvstore.serve.pacing.Backlog`)."""
        salt = self._salt(salt, None)
        if salt is UNKNOWN:
            return Extent(0, 0)
        store = self._opened(model_key)
        if store is None:
            return Extent(0, 0)
        held = self._ram_held(model_key, tokens, salt)
        rate = store.policy.rates.prefill
        if held >= len(tokens) - 1:
            return Extent(held, 0, prefill_rate=rate)
        if store.remote is not None:
            return Extent(held, len(tokens) - 1, prefill_rate=rate)
        stored, read_s, prefill_s = store.estimate_past(tokens, held, salt=salt)
        if store.policy.mode == "always":
            read_s = None  # restored whatever the queue: not weighed against it
        return Extent(held, stored, read_s, prefill_s, rate)

    def _frozen_tail(self, key, tail):
        """A shared restore's ``tail`` as handed to the prefetches waiting for it:
        views its own request's generate loop does not write to."""
        store = self._opened(key[0])
        if store is None:
            raise RuntimeError("the store closed")
        return store.frozen_tail(tail)

    def _opened(self, model_key):
        """The store open for ``model_key``, or None: the prefetch paths never
        open one (the model's load does)."""
        with self._lock:
            return self._stores.get(model_key)

    def can_prefetch(self) -> bool:
        """Whether this mlx-lm's LRU can be searched without copying a cache."""
        trie = getattr(self._lru, "_trie", None)
        return callable(getattr(trie, "search", None)) and callable(
            getattr(trie, "get", None)
        )

    def _ram_held(self, model_key, tokens: List[int], salt) -> int:
        """Tokens of ``tokens`` that the RAM LRU's ``fetch_nearest_cache`` would
        give now, found without copying its cache (mlx-lm's trie, read under the
        LRU's lock, :func:`kvstore.serve.ramtrie.nearest`)."""
        from mlx_lm.models.cache import can_trim_prompt_cache

        key = _ram_key(model_key, salt)
        with self._lru_lock:
            return ramtrie.nearest(
                self._lru._trie, key, tokens, can_trim_prompt_cache
            ).held

    def _ram_fetch(self, key, tokens: List[int]):
        """The RAM LRU's ``fetch_nearest_cache`` (under its lock), by the linear
        walk where the trie has the expected shape."""
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        with self._lru_lock:
            trie = getattr(self._lru, "_trie", None)
            if ramtrie.walkable(trie):
                return ramtrie.fetch_nearest(
                    trie, key, tokens, can_trim_prompt_cache, trim_prompt_cache
                )
            return self._lru.fetch_nearest_cache(key, tokens)

    def use_threads(self, prefetcher: Prefetcher) -> bool:
        """Restore on ``prefetcher``'s threads and save on a thread of this cache's
        own (``kvstore serve``); False when this mlx-lm's LRU cannot be searched
        (then both stay on the generation thread)."""
        if not self.can_prefetch():
            return False
        self.prefetcher = prefetcher
        self.saves = SaveQueue(
            in_ram=self._save_in_ram,
            count=self.count,
            busy=self._saves_wait,
        )
        return True

    def _loop_busy(self) -> bool:
        """Whether the generation loop works now (:meth:`Activity.busy`): the store's
        writer waits meanwhile. (``kvstore serve`` replaces ``activity`` after
        construction: looked up at each call.)"""
        return self.activity.busy()

    def _saves_wait(self) -> bool:
        """Whether queued saves wait: the loop works, or requests are on their way
        to it (:meth:`Prefetcher.expecting`), whose restores a save's copies to the
        host would slow. (The writer does not wait for those: an arriving request's
        restore may need it, to keep what a remote tier sent.)"""
        prefetcher = self.prefetcher
        return self._loop_busy() or (prefetcher is not None and prefetcher.expecting())

    def _kept_by_a_save(
        self, model: Any, salt, tokens: List[int], ram_n: int
    ) -> Optional[Tuple[List[Any], int]]:
        """``(cache, n)``: a copy of a waiting save's KV cut to the ``n`` first tokens
        of ``tokens`` when that is more than the RAM LRU's ``ram_n`` (its entry was
        evicted while the save waits), else None. At most ``len(tokens) - 1``
        tokens, like a restore. Never raises."""
        if self.saves is None or ram_n >= len(tokens) - 1:
            return None
        try:
            from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

            job, n = self.saves.kept_prefix(
                model, salt, tokens[: len(tokens) - 1], longer_than=ram_n
            )
            if job is None:
                return None
            held = _held_tokens(job.store, job.cache)
            if held < n or (held > n and not can_trim_prompt_cache(job.cache)):
                return None
            cache = copy.deepcopy(job.cache)
            if held > n:
                trim_prompt_cache(cache, held - n)
            return cache, n
        except Exception:
            log.exception("kvstore: a waiting save's KV was not reused")
            return None

    def _save_in_ram(self, job: SaveJob) -> Optional[List[Any]]:
        """The RAM LRU cache holding the tokens ``job`` saves (a deferred save): its
        own entry, or a longer entry of the same tokens (mlx-lm drops a trimmable
        cache's prefixes when it stores a longer one); None when none holds them.

        A longer entry the generation thread has not evaluated yet
        (:class:`Settled`) gives no KV: the job keeps its own meanwhile and goes on
        waiting. Taken for gone instead, the save went ahead at once, copying its
        KV beside the prompt step that had just stored the longer entry (8 users
        after a restart on an H200: the step 60 ms longer)."""
        from mlx_lm.models.cache import can_trim_prompt_cache

        with self._lru_lock:
            found = ramtrie.match(
                self._lru._trie, _ram_key(job.model_key, job.salt), job.tokens
            )
            if found.exact:
                cache = found.value.prompt_cache
            elif found.longer is None or found.common < job.held:
                return None
            else:
                cache = found.longer.prompt_cache
                if not can_trim_prompt_cache(cache):
                    return None  # state layers: the longer cache cannot give a prefix
        return cache if cache in self._settled else job.cache

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
                from ..store import KVStore

                store = KVStore(
                    self.store_dir,
                    provider.model,
                    provider.tokenizer,
                    **self.store_kwargs,
                )
                # Its writer steps aside while the generation loop works.
                store.writer.yield_to = self._loop_busy
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
                self.count(store_errors=1)
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
        if self.step_held is not None and not self.step_held.wait_empty(FLUSH_WAIT_S):
            log.warning("kvstore: the generation loop did not queue its held saves")
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
            if self.step_held is not None:  # the generation loop has ended
                self._queue_taken(self.step_held.take())
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
        out["saves_queued"] = self.saves.queued if self.saves is not None else 0
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

    def count(self, **deltas) -> None:
        """Add ``deltas`` to the counters of :meth:`stats` (names as there)."""
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
