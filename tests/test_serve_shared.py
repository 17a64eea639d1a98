"""Restores of arriving requests that share a prefix (``kvstore.serve.shared``):
which restore a prefetch waits for, and when an entry stops being shared."""

import gc
import threading
import time

from kvstore.engine.tail import Tail
from kvstore.serve.shared import SharedRestores

SYSTEM = list(range(1000))


def test_a_later_restore_waits_for_the_one_sharing_its_prefix():
    shared = SharedRestores(min_shared=256)
    first, none, _ = shared.begin("k", SYSTEM + [1, 2], held=0)
    assert none is None
    second, other, common = shared.begin("k", SYSTEM + [3, 4], held=0)
    assert other is first and common == 1000
    tail = Tail(["kv"], 0, 1001)
    threading.Timer(0.1, shared.end, (first, tail)).start()
    assert shared.head(other, common) is tail  # waited for it
    shared.taken(first)  # its lookup took it: no longer shared
    third, other, _ = shared.begin("k", SYSTEM + [5], held=0)
    assert other is second  # still restoring


def test_nothing_is_shared_across_keys_or_below_the_minimum():
    shared = SharedRestores(min_shared=256)
    shared.begin("tenant-a", SYSTEM, held=0)
    assert shared.begin("tenant-b", SYSTEM, held=0)[1] is None
    # 1000 shared tokens, but RAM already holds 900 of them: 100 is too few.
    assert shared.begin("tenant-a", SYSTEM + [7], held=900)[1] is None


def test_a_restore_never_taken_stops_being_shared_with_its_kv():
    shared = SharedRestores(min_shared=256)
    entry, _, _ = shared.begin("k", SYSTEM, held=0)
    tail = Tail(["kv"], 0, 999)
    shared.end(entry, tail)
    assert len(shared) == 1
    del tail
    gc.collect()
    assert len(shared) == 0 and shared.begin("k", SYSTEM, held=0)[1] is None


def test_a_tail_past_a_ram_copy_is_not_a_head():
    shared = SharedRestores(min_shared=256)
    entry, _, _ = shared.begin("k", SYSTEM, held=0)
    partial = Tail(["kv"], 512, 999)  # joined to a RAM copy at its lookup
    shared.end(entry, partial)
    _, other, common = shared.begin("k", SYSTEM + [1], held=0)
    assert other is None or shared.head(other, common) is None


def test_a_restore_hands_its_kv_to_those_already_waiting_even_once_taken():
    """A request registered on arrival waits for the earlier restore of its
    prefix: that restore hands over its KV as it ends, so the waiter gets it even if
    the first request's lookup took it before the waiter looked; one registering
    after that lookup shares nothing."""
    shared = SharedRestores(min_shared=256)
    first, _, _ = shared.begin("k", SYSTEM + [1], held=0)
    waiter, other, common = shared.begin("k", SYSTEM + [2], held=0)
    assert other is first and common == 1000
    tail = Tail(["kv"], 0, 1001)
    shared.end(first, tail)
    shared.taken(first)  # its lookup came first
    assert shared.head(other, common, waiter=waiter) is tail
    assert waiter.handed is None  # handed once, not kept
    shared.end(waiter, None)
    late, none, _ = shared.begin("k", SYSTEM + [3], held=0)
    assert none is None
    shared.end(late, None)


def test_an_abandoned_restore_releases_its_waiters_at_once():
    shared = SharedRestores(min_shared=256, wait_s=30.0)
    first, _, _ = shared.begin("k", SYSTEM + [1], held=0)
    waiter, other, common = shared.begin("k", SYSTEM + [2], held=0)
    threading.Timer(0.05, first.abandon).start()
    assert shared.head(other, common, waiter=waiter) is None  # not after 30 s
    shared.end(waiter, None)
    assert len(shared) == 0


def test_a_whole_restore_lets_the_joins_handed_a_prefix_finish_first():
    """Restores take turns on the device: one of a whole prefix waits until the
    prefetches already handed a prefix have ended (their users need only their own
    turn read), bounded; with none handed it goes at once."""
    shared = SharedRestores(min_shared=256)
    t = time.monotonic()
    shared.let_joins_finish(timeout=5)
    assert time.monotonic() - t < 0.5
    first, _, _ = shared.begin("k", SYSTEM + [1], held=0)
    waiter, other, common = shared.begin("k", SYSTEM + [2], held=0)
    shared.end(first, Tail(["kv"], 0, 1001))
    threading.Timer(0.2, shared.end, (waiter, None)).start()
    t = time.monotonic()
    shared.let_joins_finish(timeout=5)
    assert 0.15 < time.monotonic() - t < 4
    # A join that never ends holds a restore up no longer than the bound.
    again, _, _ = shared.begin("k", SYSTEM + [3], held=0)
    stuck, _, _ = shared.begin("k", SYSTEM + [4], held=0)
    shared.end(again, Tail(["kv"], 0, 1001))
    t = time.monotonic()
    shared.let_joins_finish(timeout=0.3)
    assert 0.25 < time.monotonic() - t < 2
    stuck.abandon()
    shared.let_joins_finish(timeout=5)  # an abandoned one does not hold it up


def test_joins_that_ended_are_not_kept():
    """Waiters handed a prefix are remembered only until they end, also where no
    whole restore comes to ask for them (next turns do not)."""
    shared = SharedRestores(min_shared=256)
    for i in range(10):
        owner, _, _ = shared.begin("k", SYSTEM + [2 * i], held=0)
        waiter, other, common = shared.begin("k", SYSTEM + [2 * i + 1], held=0)
        shared.end(owner, Tail(["kv"], 0, 1001))
        assert shared.head(other, common, waiter=waiter) is not None
        shared.end(waiter, None)
    assert len(shared._handed) <= 1
