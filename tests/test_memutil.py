"""kvstore.memutil: prefaulting fresh pages, and the fallback where it is missing."""

import mmap
import sys

import numpy as np
import pytest

from kvstore import memutil
from kvstore.assemble import AssemblyPlan, Prefaulter

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def address(buf) -> int:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


@linux
def test_prefault_makes_fresh_pages_present():
    region = mmap.mmap(-1, 64 * memutil.PAGE)
    base = address(region)
    assert memutil.resident(base) is False  # fresh: not a page yet
    if not memutil.prefault_supported():
        pytest.skip("kernel older than 5.14")
    # An unaligned start is rounded down to its page.
    assert memutil.prefault([(base + 10, 3 * memutil.PAGE)])
    assert memutil.resident(base) and memutil.resident(base + 3 * memutil.PAGE)
    assert memutil.resident(base + 8 * memutil.PAGE) is False
    assert bytes(region[:16]) == bytes(16)  # still zeros: nothing was written


def test_fallback_does_nothing(monkeypatch):
    monkeypatch.setattr(memutil._LIBC, "populate", False)
    region = mmap.mmap(-1, 4 * memutil.PAGE)
    assert not memutil.prefault_supported()
    assert memutil.prefault([(address(region), memutil.PAGE)]) is False


ROWS = {f"{i}.{kv}": ("float16", 2, 8) for i in range(3) for kv in ("keys", "values")}


def test_prefaulter_bands_grow_and_release_every_reader(monkeypatch):
    """Bands of 1, 2, 4, 8, 8... nodes in reading order; each waits for its band."""
    plan = AssemblyPlan(ROWS, 40, capacity=48)
    offsets = list(range(0, 41, 2))  # 20 nodes of 2 rows
    seen = []
    monkeypatch.setattr(memutil, "resident", lambda a: False)
    monkeypatch.setattr(memutil, "prefault", lambda r: seen.append(list(r)) or True)
    pf = Prefaulter(plan, offsets, needed=lambda node: True)
    assert pf._bands == [(0, 1), (1, 3), (3, 7), (7, 15), (15, 20)]
    pf.run()
    for node in range(20):
        pf.wait(node)  # returns: every band is ready
    # Every band covers its nodes' rows in every head of every array.
    assert len(seen) == 5 and all(len(r) == len(ROWS) * 2 for r in seen)
    (address0, length0), *_ = seen[1]
    assert length0 == (offsets[3] - offsets[1]) * 8 * 2


def test_prefaulter_stops_when_cut_or_refused(monkeypatch):
    plan = AssemblyPlan(ROWS, 40, capacity=40)
    offsets = list(range(0, 41, 2))
    monkeypatch.setattr(memutil, "resident", lambda a: False)
    calls = []
    monkeypatch.setattr(memutil, "prefault", lambda r: calls.append(1) or True)
    Prefaulter(plan, offsets, needed=lambda node: node < 3).run()
    assert len(calls) == 2  # bands (0, 1) and (1, 3); the rest is cut off
    # The kernel refuses: prefaulting stops, and no reader is left waiting.
    monkeypatch.setattr(memutil, "prefault", lambda r: False)
    pf = Prefaulter(plan, offsets, needed=lambda node: True)
    pf.run()
    pf.wait(19)
