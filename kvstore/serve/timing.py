"""The prefill rate of ``kvstore serve``, measured on its own requests.

``restore="auto"`` weighs reading a stored prefix against prefilling it, by rates
measured on the machine (:mod:`kvstore.engine.payoff`). A server learns the prefill rate
from the prompts it processes, so that its first fetch after a restart is decided
by what it measured before (the store keeps the rate):

* the batch path: :func:`timed_batch_generator_class` reads mlx-lm's own counters
  of each ``BatchGenerator.next()`` step (``stats()``: prompt tokens and the
  seconds spent processing them);
* the sequential path: :func:`timed_response_generator_class` times a request
  from its prompt cache lookup to its first token (:class:`PrefillClock`).

Each measurement goes to a callback (the prompt cache's ``note_prefill``); a
failure there is logged, never raised into mlx-lm's generation thread. Both paths
also tell an :class:`Activity` while a step runs and when the loop did work, so that
saves can wait for it to rest (:mod:`kvstore.serve.saves`).
"""

import logging
import math
import threading
import time
from contextlib import contextmanager, nullcontext
from typing import Callable, Iterator, Optional

log = logging.getLogger("kvstore.server")

# The generation loop rests once it did no work for this long (between two decode
# steps of a busy batch there are milliseconds).
REST_S = 0.25

OnPrefill = Callable[[int, float], None]


def _report(on_prefill: OnPrefill, tokens: int, seconds: float) -> None:
    try:
        on_prefill(tokens, seconds)
    except Exception:
        log.exception("kvstore: recording the prefill rate failed")


class Activity:
    """When mlx-lm's generation loop last did work (a batch step that processed
    prompt tokens or generated any, or a token of a sequential request), and
    whether a step runs now: one prefill step of a batch of long prompts takes
    longer than :data:`REST_S` (0.3-0.6 s for 8 users' next turns on an H200), and
    a save let in meanwhile slowed that step by half."""

    def __init__(self):
        self._last: Optional[float] = None
        self._running = 0
        self.steps = 0  # steps run to their end
        self.prefilling = False  # the last batch step processed prompt tokens
        self._lock = threading.Lock()

    def touch(self) -> None:
        self._last = time.monotonic()

    @contextmanager
    def step(self) -> Iterator[None]:
        """The loop works for as long as this lasts (a batch step, a sequential
        request), whatever it returns."""
        with self._lock:
            self._running += 1
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                self.steps += 1

    def idle_for(self) -> float:
        """Seconds since the loop last did work (infinite: it never did)."""
        last = self._last
        return math.inf if last is None else time.monotonic() - last

    def busy(self) -> bool:
        """Whether a step runs, or the loop did work within the last :data:`REST_S`."""
        return self._running > 0 or self.idle_for() < REST_S


def _did_work(out) -> bool:
    """Whether a ``BatchGenerator.next()`` result holds any response: mlx-lm returns
    ``(prompt_responses, generation_responses)``, older ones one list."""
    if isinstance(out, tuple):
        return any(bool(part) for part in out)
    return bool(out)


def _prompt_work(out) -> bool:
    """Whether a ``BatchGenerator.next()`` step processed prompt tokens (mlx-lm's
    prompt responses; an older one that returns one list: taken as not)."""
    return isinstance(out, tuple) and bool(out[0])


def timed_batch_generator_class(
    base, on_prefill: OnPrefill, activity: Optional[Activity] = None
):
    """mlx-lm's ``BatchGenerator`` reporting the prompt tokens each step processed
    and the seconds it took (its own ``stats()`` counters), and each step that did
    work to ``activity``."""

    class TimedBatchGenerator(base):
        def next(self, *args, **kwargs):
            with activity.step() if activity is not None else nullcontext():
                out = self._timed_next(*args, **kwargs)
            if activity is not None:
                activity.prefilling = _prompt_work(out)
                if _did_work(out):
                    activity.touch()
            return out

        def _timed_next(self, *args, **kwargs):
            stats = getattr(self, "stats", None)
            if stats is None:  # an mlx-lm without the counters: nothing measured
                out = super().next(*args, **kwargs)
            else:
                with stats() as window:
                    out = super().next(*args, **kwargs)
                tokens = getattr(window, "prompt_tokens", 0)
                if tokens:
                    _report(on_prefill, tokens, getattr(window, "prompt_time", 0.0))
            return out

    return TimedBatchGenerator


class PrefillClock:
    """When the sequential request on this thread was looked up, and how many of
    its prompt tokens were left to prefill then."""

    def __init__(self):
        self._local = threading.local()

    def looked_up(self, rest: int) -> None:
        self._local.mark = (time.perf_counter(), rest)

    def take(self) -> Optional[tuple]:
        """``(tokens, seconds since the lookup)`` once per lookup, else None."""
        mark = getattr(self._local, "mark", None)
        self._local.mark = None
        if mark is None:
            return None
        return mark[1], time.perf_counter() - mark[0]


class _FirstTokenQueue:
    """A request's response queue that stops the clock at its first token."""

    def __init__(
        self, queue, response_class, clock: PrefillClock, on_prefill, activity
    ):
        self._queue = queue
        self._response_class = response_class
        self._clock = clock
        self._on_prefill = on_prefill
        self._activity = activity
        self._done = False

    def put(self, item, *args, **kwargs):
        if self._activity is not None:
            self._activity.touch()
        if not self._done and isinstance(item, self._response_class):
            self._done = True
            lap = self._clock.take()
            if lap is not None:
                _report(self._on_prefill, *lap)
        return self._queue.put(item, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._queue, name)


def timed_response_generator_class(
    base,
    response_class,
    clock: PrefillClock,
    on_prefill: OnPrefill,
    activity: Optional[Activity] = None,
):
    """mlx-lm's ``ResponseGenerator`` whose sequential requests report the time from
    their prompt cache lookup (``clock``) to their first token, and each item they
    stream to ``activity``."""

    class TimedResponseGenerator(base):
        def _serve_single(self, request, *args, **kwargs):
            try:
                rqueue, req, gen_args = request
                request = (
                    _FirstTokenQueue(
                        rqueue, response_class, clock, on_prefill, activity
                    ),
                    req,
                    gen_args,
                )
            except (TypeError, ValueError):
                pass  # another shape of request: served untimed
            with activity.step() if activity is not None else nullcontext():
                return super()._serve_single(request, *args, **kwargs)

    return TimedResponseGenerator
