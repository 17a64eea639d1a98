"""When a request held for its restore goes on, and how mlx-lm takes it.

* :class:`Backlog`: whether a returning user's stored prefix is read sooner than
  the model would prefill it, given the reads and prefills already sent on;
* :class:`AdmittingBudget`: mlx-lm's generation loop, once the request goes on,
  takes it at its next step rather than at the end of its time budget.

Both are used by :mod:`kvstore.serve.prefetch`.
"""

import threading
import time
from typing import Callable, List, Optional, Tuple

# Prompts mlx-lm's server prefills together (its --prompt-concurrency default).
PROMPT_BATCH = 8
# Prompts sent on within this long of each other are prefilled in one batch: a burst
# of requests is looked at in tens of ms, and the generation loop, idle, waits for it.
SAME_BATCH_S = 0.25


class Backlog:
    """When the store's reads and the model's prefill would next be free, given
    the work sent to each: restores one after another at the measured byte rate
    (their reads share the disk and the host-to-device copy), prompts sent straight
    on at the measured prefill rate. A returning user takes whichever finishes its
    stored prefix sooner: behind seven restores, the eighth is prefilled while they
    read. A clock that was not needed for a while starts again from now.

    mlx-lm prefills the prompts that reach it together in one batch
    (``--prompt-concurrency``, ``prompt_batch`` here), each step padded to the
    longest: a whole prompt prefilled beside short ones holds up all of them (16
    users on an H200: 4 returning users prefilled whole beside 12 next turns of 211
    tokens kept all 16 waiting 3.7-4.8 s). So a prompt prefilled beside others
    (those sent on within :data:`SAME_BATCH_S` or still being prefilled by the
    estimates) ends no sooner than the longest of them counted once for each, and
    what it is longer than the longest of theirs counts again for each of them:
    the wait its padding adds to theirs."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        *,
        prompt_batch: int = PROMPT_BATCH,
    ):
        self._clock = clock
        self._prompt_batch = prompt_batch
        self._lock = threading.Lock()
        self._reads_free = self._prefill_free = 0.0
        # Per prompt sent on: until when it counts, and its own prefill's seconds.
        self._straight_on: List[Tuple[float, float]] = []

    def prefill(self, seconds: Optional[float], *, straight_on: bool = True) -> None:
        """Prefill work sent on (None or 0: none, or not estimated);
        ``straight_on=False``: the rest of a prompt held back for its restore
        (prefilled later, not beside the prompts sent on now)."""
        if seconds:
            with self._lock:
                now = self._clock()
                self._prefill_free = max(now, self._prefill_free) + seconds
                if straight_on:
                    self._sent_on(now, self._prefill_free, seconds)

    def read(self, seconds: Optional[float]) -> None:
        """A restore started that is not weighed (a next turn's tail)."""
        if seconds:
            with self._lock:
                self._reads_free = max(self._clock(), self._reads_free) + seconds

    def restore_sooner(
        self, read_s: Optional[float], prefill_s: Optional[float], *, dry: bool = False
    ) -> bool:
        """Whether restoring (True) or prefilling (False) a returning user's stored
        prefix finishes it sooner, its padding of the prompts beside it counted,
        on that clock; True while either rate is unknown. ``dry``: only tell, the
        work is not counted."""
        if read_s is None or prefill_s is None:
            if not dry:
                self.read(read_s)
            return True
        with self._lock:
            now = self._clock()
            batch, longest, padding = self._padded(now, prefill_s)
            read_done = max(now, self._reads_free) + read_s
            # Behind the prefills sent on, or padded beside them: the later end.
            prefill_done = max(
                max(now, self._prefill_free) + prefill_s,
                now + batch * max(prefill_s, longest),
            )
            sooner = read_done <= prefill_done + padding
            if dry:
                return sooner
            if sooner:
                self._reads_free = read_done
                return True
            self._prefill_free = prefill_done
            self._sent_on(now, prefill_done, prefill_s)
            return False

    def restore_tail(self, read_s: Optional[float], prefill_s: Optional[float]) -> bool:
        """Whether the stored rest of a prompt that RAM mostly holds (a next turn)
        is restored because, prefilled, it would pad the prompts beside it for
        longer than its read takes behind the reads sent on; counted as a read if
        so. False: the store weighs it as if alone."""
        if not read_s or not prefill_s:
            return False
        with self._lock:
            now = self._clock()
            _, _, padding = self._padded(now, prefill_s)
            read_done = max(now, self._reads_free) + read_s
            if read_done - now > padding:
                return False
            self._reads_free = read_done
            return True

    def _padded(self, now: float, prefill_s: float) -> Tuple[int, float, float]:
        """For a prompt of ``prefill_s`` sent on ``now`` (under the lock): the
        prompts of its batch, the longest prefill of the others, and the wait its
        padding adds to theirs, all together."""
        beside = self._beside(now)
        batch = min(self._prompt_batch, 1 + len(beside))
        longest = max((seconds for _, seconds in beside), default=0.0)
        return batch, longest, (batch - 1) * batch * max(0.0, prefill_s - longest)

    def _beside(self, now: float) -> List[Tuple[float, float]]:
        """The prompts sent on that a prompt sent on ``now`` would be prefilled
        beside (under the lock)."""
        self._straight_on = [p for p in self._straight_on if p[0] > now]
        return self._straight_on

    def _sent_on(self, now: float, prefill_done: float, seconds: float) -> None:
        """A prompt of ``seconds`` of prefill sent on ``now``, estimated to end
        ``prefill_done``: counted as beside later ones until then, and for
        SAME_BATCH_S at least."""
        until = max(prefill_done, now + SAME_BATCH_S)
        self._beside(now).append((until, seconds))


class AdmittingBudget:
    """mlx-lm's ``TimeBudget`` that also ends once a request held for its restore
    has been released (after at least one step of this slice).

    While a batch decodes, mlx-lm's generation loop steps it for up to the budget
    (0.5 s) before it takes the requests that arrived meanwhile. A returning user
    held back until its restore is ready arrives so, mid-slice, where plain mlx-lm
    would have had it from the start: on an H200 such requests reached the loop
    0.00-0.51 s after their restores ended. Other requests keep mlx-lm's timing.
    """

    def __init__(self, budget, released: Callable[[], bool]):
        self._budget = budget
        self._released = released
        self._steps = 0

    def __iter__(self):
        iter(self._budget)  # starts the slice's clock
        self._steps = 0
        return self

    def __next__(self):
        if self._steps and self._released():
            raise StopIteration
        value = next(self._budget)
        self._steps += 1
        return value
