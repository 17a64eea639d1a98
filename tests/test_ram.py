"""Unit tests for kvstore.engine.ram.RamTier: byte budget and eviction order."""

import threading

import pytest

from kvstore.disk.policy import RAM_ORDER
from kvstore.engine.ram import RamEntry, RamTier


def entry(
    nbytes: int, kind: str = "user", pinned: bool = False, fill: int = 0
) -> RamEntry:
    return RamEntry(bytes([fill]) * nbytes, {}, kind, pinned)


def keys(ram: RamTier, candidates) -> list:
    return [k for k in candidates if k in ram]


def test_ram_order_is_assistant_user_system_then_pinned():
    assert RAM_ORDER == (
        (False, "assistant"),
        (False, "user"),
        (False, "system"),
        (True, "assistant"),
        (True, "user"),
        (True, "system"),
    )


def test_put_get_and_accounting():
    ram = RamTier(1000)
    e = entry(300, fill=7)
    assert ram.put("a", e) is True
    assert ram.get("a") is e
    assert "a" in ram and "b" not in ram
    assert ram.get("b") is None
    assert (len(ram), ram.nbytes) == (1, 300)
    # replacing a key does not count it twice
    assert ram.put("a", entry(500)) is True
    assert (len(ram), ram.nbytes) == (1, 500)
    assert ram.get("a").nbytes == 500


def test_respects_byte_budget():
    ram = RamTier(1000)
    sizes = [300, 200, 450, 100, 999, 1, 250, 600, 50, 1000, 333]
    for i, n in enumerate(sizes):
        assert ram.put(i, entry(n)) is True
        assert ram.nbytes <= 1000
        assert ram.nbytes == sum(ram.get(k).nbytes for k in range(i + 1) if k in ram)
        assert i in ram  # the newest entry always stays
    assert ram.nbytes == 333  # 1000 evicted everything before it, 333 evicted the 1000
    assert keys(ram, range(len(sizes))) == [10]


def test_lru_within_a_bucket():
    ram = RamTier(300)
    for k in "abc":
        assert ram.put(k, entry(100))
    assert ram.put("d", entry(100))
    assert keys(ram, "abcd") == ["b", "c", "d"]  # "a" was least recently used


def test_get_moves_to_most_recent():
    ram = RamTier(300)
    for k in "abc":
        ram.put(k, entry(100))
    assert ram.get("a") is not None
    ram.put("d", entry(100))
    assert keys(ram, "abcd") == ["a", "c", "d"]  # "b" went instead of "a"
    ram.get("c")  # order now a, d, c
    ram.put("e", entry(100))
    assert keys(ram, "abcde") == ["c", "d", "e"]


def test_put_again_refreshes_recency():
    ram = RamTier(300)
    for k in "abc":
        ram.put(k, entry(100))
    ram.put("a", entry(100, fill=1))
    ram.put("d", entry(100))
    assert keys(ram, "abcd") == ["a", "c", "d"]
    assert ram.get("a").data == b"\x01" * 100


def test_eviction_order_assistant_user_system_pinned_last():
    ram = RamTier(600)
    layout = [
        ("ps", "system", True),
        ("pu", "user", True),
        ("pa", "assistant", True),
        ("s", "system", False),
        ("u1", "user", False),
        ("a", "assistant", False),
        ("u2", "user", False),
    ]
    # insertion order deliberately mixes buckets, so plain LRU would give another order
    for k, kind, pinned in layout[:6]:
        assert ram.put(k, entry(100, kind, pinned))
    ram.get("ps")  # recency never outranks the bucket order
    # room for one more is exhausted: a pinned system entry may evict anything
    names = [k for k, _, _ in layout[:6]]
    evicted = []
    for i in range(6):
        assert ram.put(("new", i), entry(100, "system", True))
        gone = [k for k in names if k not in ram and k not in evicted]
        assert len(gone) == 1
        evicted += gone
        assert ram.nbytes == 600
    assert evicted == ["a", "u1", "s", "pa", "pu", "ps"]


def test_eviction_lru_inside_each_kind():
    ram = RamTier(400)
    ram.put("u1", entry(100, "user"))
    ram.put("s1", entry(100, "system"))
    ram.put("u2", entry(100, "user"))
    ram.put("s2", entry(100, "system"))
    ram.get("u1")
    ram.put("x", entry(100, "system"))
    assert keys(ram, ["u1", "u2", "s1", "s2", "x"]) == ["u1", "s1", "s2", "x"]
    ram.put("y", entry(100, "system"))
    assert keys(ram, ["u1", "u2", "s1", "s2", "x", "y"]) == ["s1", "s2", "x", "y"]
    ram.put("z", entry(100, "system"))
    assert keys(ram, ["s1", "s2", "x", "y", "z"]) == ["s2", "x", "y", "z"]


def test_less_important_entry_does_not_evict_more_important():
    ram = RamTier(300)
    ram.put("s", entry(100, "system"))
    ram.put("pu", entry(200, "user", True))
    # an assistant entry may only evict assistant entries: there are none
    assert ram.put("a", entry(100, "assistant")) is False
    assert "a" not in ram
    assert keys(ram, ["s", "pu"]) == ["s", "pu"]
    assert ram.nbytes == 300
    # a system entry may evict the unpinned system one, never the pinned user one
    assert ram.put("s2", entry(100, "system")) is True
    assert keys(ram, ["s", "pu", "s2"]) == ["pu", "s2"]
    assert ram.put("s3", entry(150, "system")) is False
    assert "pu" in ram


def test_entry_larger_than_budget_is_refused():
    ram = RamTier(1000)
    ram.put("a", entry(400))
    ram.put("b", entry(400, "system", True))
    assert ram.put("big", entry(1001, "system", True)) is False
    assert "big" not in ram
    # nothing was evicted for it
    assert keys(ram, ["a", "b"]) == ["a", "b"]
    assert ram.nbytes == 800
    # exactly the budget fits (after evicting everything else)
    assert ram.put("exact", entry(1000, "system", True)) is True
    assert keys(ram, ["a", "b", "exact"]) == ["exact"]
    assert ram.nbytes == 1000


def test_discard():
    ram = RamTier(1000)
    ram.put("a", entry(100))
    ram.put("b", entry(200, "system", True))
    ram.discard("a")
    assert "a" not in ram and ram.get("a") is None
    assert (len(ram), ram.nbytes) == (1, 200)
    ram.discard("a")  # absent: no error, nothing changes
    ram.discard("zzz")
    assert (len(ram), ram.nbytes) == (1, 200)
    ram.discard("b")
    assert (len(ram), ram.nbytes) == (0, 0)
    # the tier is usable again at full budget
    assert ram.put("c", entry(1000))


def test_clear():
    ram = RamTier(1000)
    for i, kind in enumerate(["user", "system", "assistant"]):
        ram.put(i, entry(100, kind, pinned=i == 1))
    ram.clear()
    assert (len(ram), ram.nbytes) == (0, 0)
    assert all(ram.get(i) is None for i in range(3))
    assert ram.put("x", entry(1000, "assistant"))
    assert (len(ram), ram.nbytes) == (1, 1000)


@pytest.mark.parametrize("kind", ["assistant", "user", "system"])
@pytest.mark.parametrize("pinned", [False, True])
def test_zero_budget_refuses_everything(kind, pinned):
    ram = RamTier(0)
    for n in (1, 8, 4096):
        assert ram.put(("k", n), entry(n, kind, pinned)) is False
    assert (len(ram), ram.nbytes) == (0, 0)
    assert ram.get(("k", 1)) is None


def test_zero_budget_refuses_empty_entry():
    ram = RamTier(0)
    assert ram.put("empty", entry(0)) is False
    assert len(ram) == 0


def test_concurrent_puts_keep_accounting_consistent():
    ram = RamTier(10_000)
    kinds = ["assistant", "user", "system"]

    def worker(t):
        for i in range(300):
            ram.put(
                (t, i % 50), entry(100 + (i % 7) * 10, kinds[(t + i) % 3], i % 11 == 0)
            )
            ram.get((t, (i * 7) % 50))
            if i % 13 == 0:
                ram.discard((t, (i * 3) % 50))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    present = [(t, i) for t in range(4) for i in range(50) if (t, i) in ram]
    assert len(ram) == len(present)
    assert ram.nbytes == sum(ram.get(k).nbytes for k in present)
    assert ram.nbytes <= 10_000


def test_put_that_cannot_fit_evicts_nothing():
    tier = RamTier(300)
    tier.put("sys", RamEntry(b"s" * 200, {}, "system", True))
    tier.put("asst", RamEntry(b"a" * 100, {}, "assistant", False))
    assert not tier.put("user", RamEntry(b"u" * 200, {}, "user", False))
    assert "asst" in tier and "sys" in tier and tier.nbytes == 300
