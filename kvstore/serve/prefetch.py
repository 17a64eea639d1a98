"""Restores that start when a request arrives, not when its turn comes.

mlx-lm's server takes requests one at a time on its generation thread: tokenize,
look up the prompt cache, join the batch. A restore from the store done in that
lookup holds up every request behind it and every stream being decoded, so eight
returning users wait for eight restores in a row. ``kvstore serve`` starts each
request's restore from the HTTP handler instead (``ResponseGenerator.generate``),
on a small pool of threads, so restores overlap with each other and with the
GPU's work, and the lookup only takes the result. What RAM and the store hold of
the prompt is found first, on the HTTP thread, by the index alone:

- the store holds nothing past RAM (a new user): no prefetch, the request goes
  straight on and never queues behind others' restores;
- the store holds over twice what RAM does (a returning user whose chat left RAM):
  the request reaches the generation thread only once its restore is ready, so
  the generation loop never waits for it and serves the requests that are ready
  meanwhile. When the restores already queued would make it wait longer than the
  model would take to prefill it (:class:`Backlog`, by the measured rates: many
  returning users at once on a GPU), it goes straight on to be prefilled instead;
- RAM holds most of it (a chat's next turn): the request goes straight on while
  its tail is read or found cheaper to prefill, so that a burst of such requests
  reaches the generation thread together and is prefilled in one batch.

* :class:`Prefetcher`: the pool, a bound on restores waiting to be taken, which
  request the generation thread is looking up, and the requests still being
  looked at on their HTTP threads: the generation thread, its queue empty, waits
  for them (a few ms each), so that requests arriving together join one batch.
* :func:`prefetch_response_generator_class`: ``generate`` submits the request and
  waits for its restore; ``_tokenize`` keeps the request's tokens (computed once,
  by whichever thread comes first, under one lock: the tokenizer is not shared
  between threads). Whether a returning user is restored or prefilled, and how
  soon mlx-lm's loop takes it once restored: :mod:`kvstore.serve.pacing`.

What a prefetch found (:class:`Prefetched`) is used only for the very request,
model, salt and tokens it was made for; anything else (a failed prefetch, one not
started yet, RAM changed meanwhile) leaves the lookup to restore as before.
"""

import logging
import threading
import weakref
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Tuple

from .pacing import AdmittingBudget, Backlog
from .shared import Registration

log = logging.getLogger("kvstore.server")

# The mlx_lm.server internals the prefetching generator wraps (checked at start-up).
HOOKED = {"ResponseGenerator": ("generate", "_next_request", "_tokenize")}

# Threads restoring at once: each restore reads with the store's own reader threads.
# (A prefetch waiting for another's restore of its prefix runs on a thread of its own.)
WORKERS = 2
# Prefetched restores held for requests not looked up yet (each holds its KV).
MAX_WAITING = 16
# The longest a request waits for its restore before it goes to the generation
# thread anyway (whose lookup then waits for what is left: a remote tier's read).
MAX_HOLD_S = 30.0
# The longest the generation thread, its queue empty, waits for requests that
# arrived together and are still being tokenized (a few ms each, one at a time).
MAX_ARRIVAL_WAIT_S = 0.05
# The longest a returning user about to be prefilled waits for the requests arriving
# with it to be looked at (one at a time, a few ms each: 16 at once take tens of ms).
CLASSIFY_WAIT_S = 0.2


@dataclass
class Prefetched:
    """What a prefetch found for one request: ``tail`` (a
    :class:`kvstore.engine.tail.Tail`, or None: the store adds nothing worth reading past
    the ``held`` tokens that RAM held then); ``remote``: whether the remote tier
    supplied nodes meanwhile."""

    model_key: Any
    salt: Any
    tokens: List[int]
    held: int
    tail: Any
    seconds: float
    remote: bool = False
    shared: Any = None  # its entry in kvstore.serve.shared.SharedRestores
    joined: bool = False  # its first tokens copied from another request's restore


class Extent(NamedTuple):
    """What RAM and the store hold of an arriving request's prompt (the index
    alone), and what getting the stored part past RAM would cost: None where a
    rate is not measured yet."""

    held: int  # tokens the RAM LRU would give now
    stored: int  # tokens the store may give
    read_s: Optional[float] = None  # restoring the stored tokens past ``held``
    prefill_s: Optional[float] = None  # prefilling those tokens instead
    prefill_rate: Optional[float] = None  # the model's, tokens/s


class Prefetcher:
    """Runs prefetch jobs of arriving requests and hands their results to the
    generation thread's lookup of the same request.

    Args:
        workers: Threads running jobs.
        max_waiting: Requests whose prefetch may be queued, running or done but
            not taken yet; beyond that a request is restored at its lookup.
    """

    def __init__(self, *, workers: int = WORKERS, max_waiting: int = MAX_WAITING):
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvstore-prefetch")
        # Jobs that wait for another's restore, then read what follows it: they
        # must not keep the restores they wait for from starting.
        self._joiners = ThreadPoolExecutor(
            max_waiting, thread_name_prefix="kvstore-prefetch-join"
        )
        self._max_waiting = max_waiting
        self._waiting = 0
        self._lock = threading.Lock()
        self._local = threading.local()
        # Requests held for their restore, released and not yet looked up, by id:
        # mlx-lm's requests are dataclasses, which do not hash.
        self._released: Dict[int, weakref.ref] = {}
        self._closed = False
        self.tokenize_lock = threading.Lock()
        self._arrivals = threading.Condition()
        self._probing = 0  # requests tokenized and looked up before they queue
        self._classifying = 0  # of those, waiting in await_classified
        self.backlog = Backlog()

    @contextmanager
    def probing(self) -> Iterator[None]:
        """An arriving request's look for its prefix (HTTP thread), counted so
        that the generation thread can wait for it (:meth:`await_arrivals`)."""
        with self._arrivals:
            self._probing += 1
        try:
            yield
        finally:
            with self._arrivals:
                self._probing -= 1
                self._arrivals.notify_all()

    def expecting(self) -> bool:
        """Whether requests have arrived that the generation thread has not looked
        up yet: being looked at on their HTTP threads, or with a prefetch not yet
        taken (restoring, held for its restore, or queued). Between two rounds of
        a chat the loop idles while they come; work let in then (a save's copy to
        the host) delays them."""
        return self._probing > 0 or self._waiting > 0

    def await_arrivals(
        self, queued: Callable[[], bool], *, timeout: float = MAX_ARRIVAL_WAIT_S
    ) -> None:
        """The generation thread, about to take a request with none queued: wait
        while arriving requests are being looked at, until one is ``queued()`` or
        none is left, at most ``timeout``. Requests that arrive together so join
        one batch, as they do in plain ``mlx_lm.server``, whose generation thread
        tokenizes them itself (on a CPU a request that missed the batch waited a
        whole prefill step). Never raises."""
        try:
            with self._arrivals:
                self._arrivals.wait_for(lambda: self._probing == 0 or queued(), timeout)
        except Exception:
            log.exception("kvstore: waiting for arriving requests")

    def await_classified(self, *, timeout: float = CLASSIFY_WAIT_S) -> None:
        """An arriving request (HTTP thread, inside :meth:`probing`): wait while
        other requests that arrived with it are still being looked at (and so not
        yet counted as sent on or held), at most ``timeout``. Never raises."""
        try:
            with self._arrivals:
                self._classifying += 1
                self._arrivals.notify_all()
                try:  # those waiting here too are looked at already
                    self._arrivals.wait_for(
                        lambda: self._probing <= self._classifying, timeout
                    )
                finally:
                    self._classifying -= 1
        except Exception:
            log.exception("kvstore: waiting for arriving requests")

    def submit(
        self,
        request,
        job: Callable[[], Optional[Prefetched]],
        *,
        joins: bool = False,
        on_dropped: Callable[[], None] = lambda: None,
    ) -> None:
        """Start ``job`` for ``request`` (HTTP thread); never raises. ``joins``: it
        waits for another request's restore first (a thread of its own).
        ``on_dropped``: called if the job will never run (refused past
        ``max_waiting``, cancelled before it started)."""
        pool = self._joiners if joins else self._pool

        def start() -> Future:
            future = pool.submit(job)
            future.add_done_callback(lambda f: f.cancelled() and on_dropped())
            return future

        if not self._attach(request, start, bounded=True):
            on_dropped()

    def settle(self, request, found: Prefetched) -> None:
        """Give ``request``'s lookup ``found`` without running a job (HTTP thread): a
        request sent on to be prefilled finds that the store adds nothing worth
        reading. Not refused past ``max_waiting``: the lookup would restore
        instead. Never raises."""

        def settled() -> Future:
            future = Future()
            future.set_result(found)
            return future

        self._attach(request, settled, bounded=False)

    def _attach(self, request, future: Callable[[], Future], *, bounded: bool) -> bool:
        """Give ``request`` a ticket holding ``future()``, counted as waiting until
        :meth:`_release`; ``bounded``: none past ``max_waiting`` or once closed.
        Whether it was given."""
        try:
            ticket = _Ticket()
            # Released when taken, or when a request that is never looked up goes.
            weakref.finalize(request, self._release, ticket)
            with self._lock:
                if bounded and (self._closed or self._waiting >= self._max_waiting):
                    return False
                self._waiting += 1
                ticket.future = future()
            request.kvstore_prefetch = ticket
            return True
        except Exception:
            log.exception("kvstore: prefetch not started")
            return False

    def _release(self, ticket: "_Ticket") -> None:
        with self._lock:
            future, ticket.future = ticket.future, None
            if future is None:
                return
            self._waiting -= 1
        future.cancel()

    def wait(self, request, *, timeout: float = MAX_HOLD_S) -> None:
        """Until ``request``'s prefetch has run, failed or been cancelled, at most
        ``timeout`` seconds (HTTP thread); never raises."""
        future = getattr(getattr(request, "kvstore_prefetch", None), "future", None)
        if future is None:
            return
        try:
            future.exception(timeout=timeout)
        except Exception:  # CancelledError (closing), TimeoutError
            pass

    def release(self, request) -> None:
        """``request``, held for its restore, goes on to the generation thread."""
        with self._lock:
            self._released[id(request)] = weakref.ref(request)

    def released_waiting(self) -> bool:
        """Whether a request released after its restore waits for the generation
        thread to look it up (one that went away unseen no longer counts)."""
        with self._lock:
            for key in [k for k, ref in self._released.items() if ref() is None]:
                del self._released[key]
            return bool(self._released)

    def looking_up(self, request) -> None:
        """The generation thread is about to look up ``request``."""
        self._local.request = weakref.ref(request)
        with self._lock:
            self._released.pop(id(request), None)

    def take(self) -> Optional[Prefetched]:
        """The prefetch of the request being looked up on this thread: waited for
        if running, None if there is none, it failed, or it had not started (it is
        then cancelled, and the lookup restores)."""
        ref = getattr(self._local, "request", None)
        self._local.request = None
        request = ref() if ref is not None else None
        ticket = getattr(request, "kvstore_prefetch", None)
        future = getattr(ticket, "future", None)
        if future is None:
            return None
        request.kvstore_prefetch = None
        try:
            if future.cancel():
                return None
            return future.result()
        except CancelledError:
            return None
        except Exception:
            log.exception("kvstore: prefetch failed; restoring at the lookup")
            return None
        finally:
            self._release(ticket)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        for pool in (self._pool, self._joiners):
            pool.shutdown(wait=True, cancel_futures=True)


class _Ticket:
    """A request's prefetch until it is taken (then emptied: the KV goes with
    the lookup, not with the request)."""

    def __init__(self):
        self.future: Optional[Future] = None


def _abandoned(reg: Optional[Registration]) -> None:
    """Abandon ``reg``'s restore (if any): it will not run."""
    if reg is not None:
        reg.entry.abandon()


def _next_turn(backlog: Backlog, ext: Extent, read_s: Optional[float], n: int) -> bool:
    """Count a next turn (RAM holds most of its ``n`` tokens) in ``backlog``:
    restored where its stored rest, prefilled, would pad the prompts beside it
    for longer than its read takes, else as the store weighs it alone (by the
    same estimates). Returns whether its prefetch weighs it so."""
    restored = backlog.restore_tail(read_s, ext.prefill_s)  # counted as read
    # Weighed alone, by the estimates: prefilled where reading is slower.
    prefilled = not restored and None not in (read_s, ext.prefill_s)
    prefilled = prefilled and ext.prefill_s < read_s
    if not restored and not prefilled:
        backlog.read(read_s)
    past = ext.held if prefilled else ext.stored
    backlog.prefill((n - past) / ext.prefill_rate if ext.prefill_rate else None)
    return not restored


def _read_past_shared(ext: Extent, reg: Optional[Registration]) -> Optional[float]:
    """The estimated read of a request's stored prefix, less the part it takes
    from an earlier request's restore (``reg``), in proportion to the tokens."""
    if reg is None or reg.other is None or not ext.read_s:
        return ext.read_s
    past = ext.stored - ext.held
    own = ext.stored - max(reg.common, ext.held)
    return ext.read_s * max(0, own) / past if past > 0 else ext.read_s


def _seconds(s: Optional[float]) -> str:
    return "unknown" if s is None else f"{s:.3f}"


def _copied(out):
    """A copy of ``_tokenize``'s result that its caller may change: ``(prompt,
    segments, types, state)``, and the vision inputs from mlx-lm 0.32.2 on."""
    prompt, segments, types, *rest = out
    return (list(prompt), [list(s) for s in segments], list(types), *rest)


def _vision(out) -> Any:
    """The vision inputs of ``_tokenize``'s result (None: none, or an mlx-lm before
    0.32.2, whose result has no such field)."""
    return out[4] if len(out) > 4 else None


def _kept_tokens(request, tokenizer, args):
    """A copy of ``request``'s tokens kept by an earlier ``_tokenize`` with the
    same tokenizer and arguments, or None."""
    kept = getattr(request, "kvstore_tokens", None)
    if kept is not None and kept[0] is tokenizer and kept[1] is args:
        return _copied(kept[2])
    return None


def prefetch_response_generator_class(
    base,
    prefetcher: Prefetcher,
    prepare: Callable[[Any, List[int], Any], Any],
    extent: Callable[[Any, List[int], Any], Tuple],
    on_prefill_instead: Callable[[], None] = lambda: None,
    on_loop_top: Callable[[bool], None] = lambda idle: None,
    register: Callable[..., Optional[Registration]] = lambda *args: None,
):
    """mlx-lm's ``ResponseGenerator`` that restores each arriving request's prefix
    before handing the request to the generation thread.

    Args:
        base: The class to extend.
        prefetcher: Runs the jobs.
        prepare: ``prepare(model_key, tokens, salt[, weigh=False])`` on a pool
            thread: the request's restore
            (:meth:`kvstore.server.PersistentPromptCache.prefetch`); ``weigh=False``
            for a returning user, whose restore :class:`Backlog` chose.
        extent: ``extent(model_key, tokens, salt)`` on the HTTP thread: an
            :class:`Extent` (or its first fields) by the index alone; see
            :meth:`kvstore.server.PersistentPromptCache.extent`.
        on_prefill_instead: Called for a returning user sent on to be prefilled
            (:class:`Backlog`).
        on_loop_top: Called on the generation thread at the top of each turn of its
            loop (``_next_request``), with whether the loop has no batch to step
            (it then waits for requests with a timeout).
        register: ``register(model_key, tokens, salt, held)`` on the HTTP thread:
            the request's restore entered for later arrivals to share
            (:meth:`kvstore.server.PersistentPromptCache.register`), or None;
            given to ``prepare`` as ``registration``.
    """

    class PrefetchingResponseGenerator(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if getattr(self, "_is_distributed", False):
                return  # every rank must step alike
            budget = getattr(self, "_time_budget", None)
            if callable(getattr(budget, "__next__", None)):
                self._time_budget = AdmittingBudget(budget, prefetcher.released_waiting)
            elif hasattr(self, "requests"):  # mlx-lm's, not a stand-in
                log.warning(
                    "kvstore: this mlx-lm's generation loop has no time budget to "
                    "end early: restored requests join at its own pace"
                )

        def generate(self, request, generation_args, *args, **kwargs):
            # Distributed servers pickle requests to other ranks: left alone.
            if not getattr(self, "_is_distributed", False):
                with prefetcher.probing():
                    hold = self._kvstore_prefetch(request, generation_args)
                if hold:
                    prefetcher.wait(request)
                    prefetcher.release(request)
            return super().generate(request, generation_args, *args, **kwargs)

        def _next_request(self, timeout=None):
            on_loop_top(timeout is not None)
            queue = getattr(self, "requests", None)
            if not getattr(self, "_is_distributed", False) and queue is not None:
                if queue.empty():
                    prefetcher.await_arrivals(lambda: not queue.empty())
            return super()._next_request(timeout)

        def _kvstore_prefetch(self, request, args) -> bool:
            """Start the request's restore; whether to hold the request back until
            it is ready (RAM holds little of the prompt, or the restore was chosen
            over padding the prompts beside it). Never raises."""
            reg = None
            try:
                found = self._kvstore_prompt(request, args)
                if found is None:
                    return False
                ext = Extent(*extent(*found))
                rate, n = ext.prefill_rate, len(found[1])
                backlog = prefetcher.backlog
                if ext.stored <= ext.held:  # a new user: prefilled past RAM
                    backlog.prefill((n - ext.held) / rate if rate else None)
                    return False
                returning = ext.stored - ext.held > ext.held
                reg = register(*found, ext.held)
                read_s = _read_past_shared(ext, reg)
                if not returning:
                    # Restored as decided (not weighed), it is held like a returning
                    # user: the lookup would otherwise wait for the read.
                    weigh = _next_turn(backlog, ext, read_s, n)
                else:
                    # Its rest waits for its restore, unless prefilled.
                    backlog.prefill(
                        (n - ext.stored) / rate if rate else None, straight_on=False
                    )
                    if not backlog.restore_sooner(read_s, ext.prefill_s, dry=True):
                        # Prefilled, it would be padded beside the prompts sent on
                        # with it: count those arriving with it first.
                        prefetcher.await_classified()
                    restore = backlog.restore_sooner(read_s, ext.prefill_s)
                    log.debug(
                        "kvstore: returning user of %d tokens (%d in RAM, %d stored):"
                        " read %s s, prefill %s s: %s",
                        n,
                        ext.held,
                        ext.stored,
                        _seconds(read_s),
                        _seconds(ext.prefill_s),
                        "restored" if restore else "prefilled",
                    )
                    if not restore:
                        key, tokens, salt = found
                        prefetcher.settle(
                            request,
                            Prefetched(key, salt, list(tokens), ext.held, None, 0.0),
                        )
                        on_prefill_instead()
                        _abandoned(reg)
                        return False
                    weigh = False  # weighed against the queue: restored as decided
            except Exception:
                log.exception("kvstore: no prefetch")
                _abandoned(reg)
                return False
            extra = {} if reg is None else {"registration": reg}
            prefetcher.submit(
                request,
                lambda: prepare(*found, weigh=weigh, **extra),
                joins=reg is not None and reg.other is not None,
                on_dropped=lambda: _abandoned(reg),
            )
            return not weigh

        def _kvstore_prompt(self, request, args):
            """``(model_key, tokens, salt)`` of a request to prefetch, or None."""
            provider = self.model_provider
            idle = getattr(provider, "kvstore_idle", None)
            if idle is not None:  # a model loading: its store opens with it
                idle.wait(MAX_HOLD_S)
            tokenizer, key = provider.tokenizer, provider.model_key
            if provider.model is None or tokenizer is None:
                return None  # this request will load the model: nothing to read yet
            try:
                out = PrefetchingResponseGenerator._tokenize(
                    self, tokenizer, request, args
                )
            except Exception as e:  # the generation thread answers it with the error
                log.debug("kvstore: no prefetch: %s", e)
                return None
            prompt = out[0]
            if _vision(out) is not None or not prompt:
                return None  # images are keyed otherwise
            return key, prompt, getattr(request, "kvstore_salt", None)

        def _tokenize(self, tokenizer, request, args):
            if threading.current_thread() is getattr(self, "_generation_thread", None):
                prefetcher.looking_up(request)
            # Tokens kept once are set whole: taken without the lock, which the
            # HTTP threads of a burst of arrivals hold in turn for a tokenization each.
            kept = _kept_tokens(request, tokenizer, args)
            if kept is not None:
                return kept
            with prefetcher.tokenize_lock:
                kept = _kept_tokens(request, tokenizer, args)
                if kept is not None:
                    return kept
                out = super()._tokenize(tokenizer, request, args)
                if not getattr(self, "_is_distributed", False):
                    request.kvstore_tokens = (tokenizer, args, _copied(out))
                return out

    return PrefetchingResponseGenerator
