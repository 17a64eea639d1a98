"""Restore only when it pays: reading a prefix back against computing it again.

A restore costs a fixed time (files, caches, the copy's launch) plus its bytes over
the rate fetches read at; recomputing costs the prefix's tokens over the rate the
model prefills at. On a 2-core CPU the model
prefills a few hundred tokens a second and every restore wins by orders of
magnitude; on an H100 a small model prefills tens of thousands a second and a
restore from a cold disk can lose. Both rates are measured on the machine that
decides (:class:`Rates`): prefill by the generate loops, ``prefill()`` and the
server (through :meth:`kvstore.KVStore.note_prefill`), restores by the fetches
themselves. Both are also kept in the store per model and host, so a restarted
server decides its first fetch by what earlier processes measured.

A fetch may also restore only the first nodes of a prefix, when they are in memory
and the rest is faster to prefill than to read.

The rates are running means in which one sample moves the mean by at most a factor
(:data:`MAX_STEP`): a sample farther than that from the mean counts as if it were
that far (a winsorized mean). Samples weigh by the seconds they took (up to a
cap). A server's batch steps that prefill a few tokens of each prompt beside the
decoding of others are mostly fixed cost: with a vote each, they held an H100
server's rate at 1,800-4,900 tokens/s where it prefilled 8 whole prompts at 14,000
(8 x 6,514 tokens in 3.7 s), and a 256-token tail past a RAM copy was read back
where prefilling it was faster. A bogus sample (a wrong timing passed by a caller, a
stall) then cannot switch restores off for long: a prefill rate 3e14 tokens/s from
one bad call raises the mean 1.9-fold instead of to 1e14, and the next two real
prefills bring it within 1.5-fold of the truth, where a plain running mean needs ~70.
A real change (another machine's kept rate, a model that got faster) is followed
1.9-fold a sample. Kept rates that are not finite and positive are ignored.

The fixed time is the shortest restore seen; a restore that took less than twice
that says nothing about the byte rate, and the others count by the seconds they
spent on bytes (:meth:`Rates.note_restore`). A server restores many small tails
past its RAM copies and answers a short warm-up request first: rated by bytes over
seconds with a vote each, those fixed costs put a 0.85 GB restore at 1.6 s where it
takes 0.3 s, and ``auto`` recomputed every returning user's prompt.

Until a prefill rate is known, every stored prefix is restored (as before any
measurement, the store cannot know better). A prefix chosen to be recomputed is
still restored once in :data:`EXPLORE_EVERY` decisions, so the restore rate
follows a page cache that warms up.
"""

import json
import math
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional, Sequence, Set, Tuple

# How a store decides: "auto" by the measured rates, or always / never restore.
MODES = ("auto", "always", "never")
# Weight of the newest sample in the running rates (of an equally long restore).
SMOOTHING = 0.3
# The seconds of restoring that a rate known before any sample (kept) stands for,
# and the most one sample counts for (a stalled read must not outvote the rest).
PRIOR_RESTORE_S = 0.05
MAX_RESTORE_WEIGHT_S = 1.0
# Prefill samples of fewer tokens say more about per-call overhead than speed.
MIN_PREFILL_TOKENS = 32
# The most seconds one prefill sample counts for: a sample weighs by its seconds up
# to this, so a server's many short batch steps (a few tokens each, mostly fixed
# cost) move the rate as little as the time they took, not as much as a long prefill.
MAX_PREFILL_WEIGHT_S = 1.0
# A restore's fixed cost beyond its bytes until one is measured.
RESTORE_OVERHEAD_S = 0.002
# A restore shorter than this many fixed costs is mostly fixed cost: no byte rate.
RATED_RESTORE = 2.0
EXPLORE_EVERY = 16
# How far (a factor) a sample may be from the running rate and still count in full.
MAX_STEP = 4.0
# The meta key under which a namespace's rates on a host are kept, and how often.
RATES_KEY = b"rates/"
PERSIST_EVERY_S = 30.0


def check_mode(mode, *, name: str = "restore") -> None:
    """Refuse a ``restore`` value (from ``name``) that is not one of :data:`MODES`."""
    if mode not in MODES:
        raise ValueError(f"{name} must be one of {', '.join(MODES)}, got {mode!r}")


@dataclass
class Decision:
    """One fetch's choice: restore the first ``nodes`` nodes of the stored path
    (``tokens`` tokens; 0 nodes: recompute them all), with the estimates it was made
    from for those tokens (None where a rate is not known yet)."""

    restore: bool
    tokens: int
    restore_s: Optional[float]
    recompute_s: Optional[float]
    explored: bool = False
    nodes: Optional[int] = None  # None: the whole path


class Rates:
    """Running prefill (tokens/s) and restore (bytes/s) rates; thread-safe."""

    def __init__(self, *, prefill: Optional[float] = None):
        self.prefill = prefill
        self._prefill_weight = 0.0  # decayed seconds of prefills behind ``prefill``
        self.restore: Optional[float] = None  # bytes/s past the fixed time
        self.restore_fixed: Optional[float] = None  # seconds: the shortest restore
        self._restore_weight = 0.0  # decayed seconds of restores behind ``restore``
        self._lock = threading.Lock()

    def note_prefill(self, tokens: float, seconds: float) -> bool:
        """Record a prefill of ``tokens`` in ``seconds``; False if too small to say.

        Raises:
            ValueError: ``tokens`` is not a finite number >= 0, ``seconds`` not a
                finite number > 0, or their rate is not finite.
        """
        _check_number("tokens", tokens, positive=False)
        _check_number("seconds", seconds, positive=True)
        if tokens < MIN_PREFILL_TOKENS:
            return False
        rate = tokens / seconds
        if not math.isfinite(rate):
            raise ValueError(
                f"seconds={seconds!r} for tokens={tokens!r} gives a rate that is not "
                "finite"
            )
        weight = min(seconds, MAX_PREFILL_WEIGHT_S)
        with self._lock:
            old = self.prefill
            if old is None:  # it stands for a run of samples like it
                self.prefill, self._prefill_weight = rate, weight / SMOOTHING
                return True
            # A rate set from outside (kept) stands for a run of full samples, where
            # each new one moves the rate by SMOOTHING. Outliers are clipped only once
            # the rate stands on a full sample: a server's first request (a short
            # warm-up, mostly fixed cost) must not hold the rate down for the many
            # samples clipping would take.
            self.prefill, self._prefill_weight = _weighted_mix(
                old,
                self._prefill_weight,
                rate,
                weight,
                unweighted=MAX_PREFILL_WEIGHT_S / SMOOTHING,
                clip_from=MAX_PREFILL_WEIGHT_S,
            )
        return True

    def note_restore(self, nbytes: int, seconds: float) -> None:
        """Record a restore of ``nbytes`` in ``seconds``: the shortest is the fixed
        time; one of at least :data:`RATED_RESTORE` fixed times moves the byte rate
        by the seconds it spent past the fixed time (bytes over those seconds of
        the recent restores, older ones fading by :data:`SMOOTHING` a sample); a
        rate far from the mean counts as :data:`MAX_STEP` away."""
        if not (nbytes > 0 and seconds > 0 and math.isfinite(nbytes / seconds)):
            return  # a timer that did not move: no rate
        with self._lock:
            fixed = seconds if self.restore_fixed is None else self.restore_fixed
            self.restore_fixed = fixed = min(fixed, seconds)
            if seconds < RATED_RESTORE * fixed:
                return
            seconds -= fixed
            old, sample = self.restore, nbytes / seconds
            weight = min(seconds, MAX_RESTORE_WEIGHT_S)
            if old is None:
                self.restore, self._restore_weight = sample, weight
                return
            # A rate set from outside (kept by an earlier process) has no weight yet.
            self.restore, self._restore_weight = _weighted_mix(
                old, self._restore_weight, sample, weight, unweighted=PRIOR_RESTORE_S
            )


class Overlaps:
    """The restores of a process whose reads are running, and how many ran at once.

    Restores at once share the disk, the memory bus and the device's copy engine:
    two take about twice as long each (an H100 server's two prefetch threads rated
    0.6-0.9 GB/s against 3.3 alone), and rated by their own seconds they would
    price every later restore, the ones that run alone too, at that speed. So a
    restore is rated by its seconds over the mean number of reads running beside it
    (itself included): the time it would have taken alone.
    """

    class Run:
        def __init__(self, now: float):
            self.started = self.last = now
            self.shared_seconds = 0.0  # the integral of the reads running, over time
            self.sharing = 1.0  # its mean, once the block ended

    def __init__(self):
        self._lock = threading.Lock()
        self._running: Set["Overlaps.Run"] = set()

    def _advance(self, now: float) -> None:
        n = len(self._running)
        for run in self._running:
            run.shared_seconds += (now - run.last) * n
            run.last = now

    @contextmanager
    def track(self) -> Iterator["Overlaps.Run"]:
        """A block of reading; ``.sharing`` afterwards: the mean number of reads that
        ran meanwhile (1.0: alone)."""
        with self._lock:
            now = time.perf_counter()
            self._advance(now)
            run = Overlaps.Run(now)
            self._running.add(run)
        try:
            yield run
        finally:
            with self._lock:
                now = time.perf_counter()
                self._advance(now)
                self._running.discard(run)
            spent = now - run.started
            run.sharing = max(1.0, run.shared_seconds / spent) if spent > 0 else 1.0


# Every restore of the process: they share its disk, memory and device.
READS = Overlaps()


def _within_step(old: float, new: float) -> float:
    """``new`` moved to within :data:`MAX_STEP` of ``old``: one outlier moves little."""
    return min(max(new, old / MAX_STEP), old * MAX_STEP)


def _weighted_mix(
    old: float,
    old_weight: float,
    sample: float,
    weight: float,
    *,
    unweighted: float,
    clip_from: float = 0.0,
) -> Tuple[float, float]:
    """``(mean, its weight)`` of a running rate ``old`` (standing on ``old_weight``
    decayed seconds, or ``unweighted`` where it has none: a rate set from outside)
    and a ``sample`` that weighs ``weight`` seconds. Older weight fades by
    :data:`SMOOTHING` a sample; the sample is clipped to :data:`MAX_STEP` of the mean
    once the faded weight is at least ``clip_from``."""
    kept = (old_weight if old_weight > 0 else unweighted) * (1 - SMOOTHING)
    if kept >= clip_from:
        sample = _within_step(old, sample)
    return (old * kept + sample * weight) / (kept + weight), kept + weight


def _check_number(name: str, value, *, positive: bool) -> None:
    """ValueError naming ``name`` unless ``value`` is a finite real number, > 0 with
    ``positive`` (else >= 0)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and math.isfinite(value) and (value > 0 if positive else value >= 0)
    if not ok:
        want = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be a finite number {want}, got {value!r}")


def usable_rate(value) -> Optional[float]:
    """``value`` as a rate: a finite number > 0, else None (a kept rate edited by
    hand, or ``Infinity`` from one bogus measurement)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if ok and math.isfinite(value) and value > 0 else None


class RestorePolicy:
    """Decides each fetch's restore from :class:`Rates` and counts the choices.

    Args:
        mode: ``"auto"``, ``"always"`` or ``"never"``.
        rates: The machine's measured rates.
    """

    def __init__(self, mode: str = "auto", *, rates: Optional[Rates] = None):
        check_mode(mode)
        self.mode = mode
        self.rates = rates or Rates()
        self.restored = 0  # fetches that restored a stored prefix
        self.recomputed = 0  # stored prefixes left to the model: not worth reading
        self.seconds_saved = 0.0  # estimated prefill time the restores saved
        self._decisions = 0
        self._lock = threading.Lock()

    def read_seconds(self, nbytes: int) -> float:
        """The estimated time of a restore reading ``nbytes`` (its fixed time alone
        while no byte rate is known)."""
        rates = self.rates
        fixed = rates.restore_fixed or RESTORE_OVERHEAD_S
        return fixed + (nbytes / rates.restore if rates.restore else 0.0)

    def decide(
        self,
        takes: Sequence[int],
        nbytes: Sequence[int],
        *,
        cuttable: bool = True,
        explore: bool = True,
        weighed: bool = False,
    ) -> Decision:
        """What to restore of a stored path whose node ``i`` holds ``takes[i]`` of the
        prompt's tokens and costs ``nbytes[i]`` bytes to read (0 when it is in memory).
        ``weighed``: the caller weighed the rates itself (a server against its
        queue): the whole path is restored as in ``"always"`` mode, unless ``"never"``.
        ``explore=False``: a path chosen to be recomputed is never restored to measure
        the restore rate (a short tail past a caller's own copy rates mostly fixed
        costs, and in a server it holds up every request batched with it).

        The cheapest of: every node, none, or (``cuttable``) the first few, each
        costed as reading its nodes plus prefilling the rest. Nodes in the RAM tier
        before nodes on a cold disk make the first few the cheapest.
        """
        total = sum(takes)
        prefill = self.rates.prefill
        if self.mode != "auto" or not prefill or weighed:
            restore_s = self.read_seconds(sum(nbytes)) if self.rates.restore else None
            recompute_s = total / prefill if prefill else None
            return Decision(self.mode != "never", total, restore_s, recompute_s)
        best, best_cost = 0, total / prefill  # recompute everything
        tokens = read = 0
        for k, (take, cost) in enumerate(zip(takes, nbytes), 1):
            tokens, read = tokens + take, read + cost
            if not cuttable and k < len(takes):
                continue
            spent = self.read_seconds(read) + (total - tokens) / prefill
            if spent <= best_cost:
                best, best_cost = k, spent
        if best:
            restored = sum(takes[:best])
            return Decision(
                True,
                restored,
                self.read_seconds(sum(nbytes[:best])),
                restored / prefill,
                nodes=best if best < len(takes) else None,
            )
        if explore:
            with self._lock:
                self._decisions += 1
                explore = self._decisions % EXPLORE_EVERY == 0
        restore_s = self.read_seconds(sum(nbytes))
        return Decision(explore, total, restore_s, total / prefill, explored=explore)

    def record(
        self, decision: Decision, *, nbytes: int, seconds: float, sharing: float = 1.0
    ) -> None:
        """Count a decision carried out; a restore's bytes and time feed the rate, its
        time over ``sharing`` (the mean number of restores that read meanwhile:
        :class:`Overlaps`). The seconds saved count it so too: restores side by side
        take their wall time once, not once each."""
        if not decision.restore:
            with self._lock:
                self.recomputed += 1
            return
        alone = seconds / max(1.0, sharing)
        self.rates.note_restore(nbytes, alone)
        with self._lock:
            self.restored += 1
            if decision.recompute_s is not None:
                self.seconds_saved += decision.recompute_s - alone

    def stats(self) -> Dict[str, Any]:
        with self._lock:
            return {
                "restore_mode": self.mode,
                "restores_chosen": self.restored,
                "recomputes_chosen": self.recomputed,
                "restore_seconds_saved": self.seconds_saved,
                "prefill_tokens_per_s": self.rates.prefill,
                "restore_bytes_per_s": self.rates.restore,
                "restore_fixed_s": self.rates.restore_fixed,
            }


def rates_key(namespace: bytes) -> bytes:
    """The meta key of ``namespace``'s rates measured on this host."""
    return RATES_KEY + namespace.hex().encode() + b"/" + socket.gethostname().encode()


def read_rates(txn, db, namespace: bytes) -> Rates:
    """The rates kept for ``namespace`` on this host (unknown ones None)."""
    raw = txn.get(rates_key(namespace), db=db)
    rates = Rates()
    try:
        kept = json.loads(raw) if raw else {}
        prefill, restore = kept.get("prefill"), kept.get("restore")
        fixed = kept.get("restore_fixed")
    except (ValueError, AttributeError):
        return rates
    rates.prefill, rates.restore = usable_rate(prefill), usable_rate(restore)
    rates.restore_fixed = usable_rate(fixed)
    return rates


def write_rates(txn, db, namespace: bytes, rates: Rates) -> None:
    value = {
        "prefill": usable_rate(rates.prefill),
        "restore": usable_rate(rates.restore),
        "restore_fixed": usable_rate(rates.restore_fixed),
        "at": time.time(),
    }
    txn.put(rates_key(namespace), json.dumps(value).encode(), db=db)
