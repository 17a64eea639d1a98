"""Restoring only what a caller's own copy lacks: the stored tokens past it.

A server holding a prompt's first tokens in RAM (mlx-lm's prompt cache) needs from
the store only the stored tokens beyond them. ``TailRead``, a part of
:class:`kvstore.store.KVStore`: :meth:`TailRead.fetch_beyond` restores the nodes
from the one holding the caller's first missing token, or nothing when prefilling
those tokens is cheaper by the measured rates (:mod:`kvstore.engine.payoff`), and
:meth:`TailRead.join` appends such a restore to the caller's cache.

A layout with state layers (sliding windows, recurrent state) cannot be cut, so
there the choice is the whole stored prefix or nothing, weighed against prefilling
the tokens past the caller's copy.
"""

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..disk.adapters import CODECS, Layout, cache_leaves
from .accesses import Accesses
from .counters import Counters
from .payoff import Decision, RestorePolicy
from .restore import MLX_LOCK, ReadPath
from .shapes import NodeShapes
from .walk import Step

log = logging.getLogger("kvstore")


@dataclass
class Tail:
    """A restore of tokens ``[start, end)`` of a prompt (``start`` 0: the whole
    prefix, a cache of its own)."""

    cache: List[Any]
    start: int
    end: int


def _first_missing(path: List[Step], held: int) -> int:
    """Index of the node of ``path`` holding token ``held`` (the first one the
    caller lacks)."""
    pos = 0
    for k, step in enumerate(path):
        if pos + step.take > held:
            return k
        pos += step.take
    return len(path)


class TailRead:
    """Restores of the stored tokens past a caller's own copy of a prompt's first
    tokens, and joining them to that copy.

    Args:
        reads: The read path (its walk, read costs and node reads, which report
            a failed read).
        layout: The namespace's cache layout.
        shapes: The node files' sizes (KV bytes per token).
        policy: Whether a restore pays; it records each restore's rate.
        accesses: Where restored nodes' accesses and the rates are noted.
        counters: Where fetches are counted.
    """

    def __init__(
        self,
        *,
        reads: ReadPath,
        layout: Layout,
        shapes: NodeShapes,
        policy: RestorePolicy,
        accesses: Accesses,
        counters: Counters,
    ):
        self.reads = reads
        self.layout = layout
        self.shapes = shapes
        self.policy = policy
        self.accesses = accesses
        self.counters = counters

    def fetch_beyond(
        self,
        arr: np.ndarray,
        held: int,
        *,
        root: Callable[[], bytes],
        started: float,
        weigh: bool = True,
    ) -> Optional[Tail]:
        """``KVStore.fetch_beyond`` once its arguments are checked: the tree's root
        is ``root()``, the fetch began at ``started`` (a ``perf_counter``). Never
        raises for a broken store (a miss, logged and counted)."""
        try:
            tail = self._fetch_beyond(arr, held, root=root(), weigh=weigh)
        except Exception:
            log.exception("kvstore: fetch failed; treating it as a miss")
            self.counters.add(errors=1)
            tail = None
        reused = 0 if tail is None else tail.end - max(held, tail.start)
        self.counters.fetched(len(arr), reused, time.perf_counter() - started)
        return tail

    def _fetch_beyond(
        self, arr: np.ndarray, held: int, *, root, weigh: bool
    ) -> Optional[Tail]:
        path = self.reads.find(arr, limit=len(arr) - 1, root=root)
        end = sum(step.take for step in path)
        if end <= held:
            return None
        k = 0 if self.layout.has_state else _first_missing(path, held)
        start = sum(step.take for step in path[:k])
        steps = path[k:]
        takes = [step.take for step in steps]
        # What is weighed is prefilling the tokens past ``held``, not past ``start``.
        if self.layout.has_state:
            takes = [0] * (len(takes) - 1) + [end - held]
        else:
            takes[0] -= held - start
        costs = self.reads.read_costs(steps)
        # A tail past the caller's copy is not restored just to measure the rate:
        # the whole prefixes that restores read teach it better, and on an H100
        # server one such tail held up the seven requests batched with it (0.3 s).
        decision = self.policy.decide(
            takes,
            costs,
            cuttable=not self.layout.has_state,
            explore=held == 0,
            weighed=not weigh,
        )
        if not decision.restore:
            self.policy.record(decision, nbytes=0, seconds=0.0)
            if self.policy.mode == "auto":
                log.info(
                    "kvstore: prefilling %d stored tokens past %d held: reading %d "
                    "bytes would take %.1f ms, prefilling them %.1f ms",
                    end - held,
                    held,
                    sum(costs),
                    decision.restore_s * 1e3,
                    decision.recompute_s * 1e3,
                )
            return None
        if start == 0:
            cache, n = self.reads.restore(arr, root=root, decision=decision)
            if n <= held:
                return None
            _evaluate(cache)
            return Tail(cache, 0, n)
        if decision.nodes is not None:
            steps, costs = steps[: decision.nodes], costs[: decision.nodes]
        return self._read_tail(steps, start, len(arr), sum(costs), decision)

    def _read_tail(
        self,
        steps: List[Step],
        start: int,
        query: int,
        nbytes: int,
        decision: Decision,
    ) -> Optional[Tail]:
        """Read ``steps`` (delta layers only), which begin at token ``start``: the
        tokens up to the first broken node, or None when that is the first."""
        tic = time.perf_counter()
        n = sum(step.take for step in steps)
        failures, _, delta, sharing = self.reads.read_reported(steps, n)
        failed = failures.first
        complete = failed >= len(steps)
        steps = steps[:failed]
        n = sum(step.take for step in steps)
        if n == 0:
            return None
        self.accesses.touch(step.h for step in steps)
        with MLX_LOCK:
            cache = self.layout.build(delta, {}, n)
        _evaluate(cache)
        seconds = time.perf_counter() - tic
        self.policy.record(
            decision,
            nbytes=nbytes if complete else 0,
            seconds=seconds,
            sharing=sharing,
        )
        if complete:
            self.accesses.keep_rates()
        return Tail(cache, start, start + n)

    def join(self, head: Sequence[Any], tail: Tail, *, query: int) -> List[Any]:
        """``head`` (a cache holding at least ``tail.start`` tokens) with ``tail``
        appended: fresh cache objects holding ``tail.end`` tokens, with room past
        them for the rest of a ``query``-token prompt (``restore_room``).

        Raises:
            LayoutMismatch, ValueError: ``head`` does not have this store's layout
                (another layer class, fewer tokens), or the layout has state layers.
        """
        if self.layout.has_state:
            raise ValueError("a layout with state layers cannot be joined")
        self.layout.check_cache(list(head), tail.start, exact=False)
        n = tail.end - tail.start
        total = self.reads.capacity(tail.end, query)
        joined = {}
        for (name, a), (_, b) in zip(
            self._named_arrays(head), self._named_arrays(tail.cache)
        ):
            parts = [a[:, :, : tail.start], b[:, :, :n]]
            if total > tail.end:
                shape = (*a.shape[:2], total - tail.end, a.shape[3])
                parts.append(mx.zeros(shape, a.dtype))
            joined[name] = mx.concatenate(parts, axis=2)
        cache = self.layout.build(joined, {}, tail.end)
        mx.eval(list(joined.values()))
        return cache

    def frozen(self, tail: Tail) -> Tail:
        """``tail`` (a whole prefix, ``start`` 0) in fresh cache objects holding
        evaluated views of its arrays' first ``tail.end`` tokens (no copy): writes
        into ``tail``'s cache objects (a generate loop's, in place) leave them as
        they were."""
        views = {
            name: a[:, :, : tail.end] for name, a in self._named_arrays(tail.cache)
        }
        cache = self.layout.build(views, {}, tail.end)
        mx.eval(list(views.values()))
        return Tail(cache, 0, tail.end)

    def _named_arrays(self, cache: Sequence[Any]):
        """``(name, array)`` of every array of ``cache``'s layers, as the layout
        names them."""
        for leaf, (_, layer) in zip(self.layout.leaves, cache_leaves(cache)):
            names = [f"{leaf.name}.{suffix}" for suffix, _, _ in leaf.tensors]
            yield from zip(names, CODECS[leaf.cls].arrays(layer))


def _evaluate(cache: List[Any]) -> None:
    """Evaluate a restore on this thread. MLX's streams belong to the thread that
    made them: another thread (the server's generation thread) may only use the
    arrays of finished work."""
    mx.eval([layer.state for _, layer in cache_leaves(cache)])
