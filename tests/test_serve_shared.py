"""Restores of arriving requests that share a prefix (``kvstore.serve.shared``):
which restore a prefetch waits for, and when an entry stops being shared."""

import gc
import threading

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
