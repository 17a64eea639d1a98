"""kvstore.platform.memutil: prefaulting fresh pages, and the fallback where it is missing."""

import mmap
import sys

import numpy as np
import pytest

from kvstore.engine.assemble import AssemblyPlan
from kvstore.platform import memutil

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def address(buf) -> int:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


@linux
def test_prefault_makes_fresh_pages_present():
    if not memutil.prefault_supported():
        pytest.skip("no MADV_POPULATE_WRITE: kernel older than 5.14, or macOS mode")
    region = mmap.mmap(-1, 64 * memutil.PAGE)
    base = address(region)
    assert memutil.resident(base) is False  # fresh: not a page yet
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


def test_plan_prefaults_the_rows_of_every_head(monkeypatch):
    """A band's rows in every head of every array, and only when the memory is fresh."""
    plan = AssemblyPlan(ROWS, 40, capacity=48)
    seen = []
    monkeypatch.setattr(memutil, "prefault", lambda r: seen.append(list(r)) or True)
    plan.prefault(6, 10)
    (ranges,) = seen
    assert len(ranges) == len(ROWS) * 2  # 2 heads each
    addresses = {a for a, _ in ranges}
    assert all(length == 4 * 8 * 2 for _, length in ranges)  # 4 rows of 8 float16
    for name, view in plan.views.items():
        base = address(view)
        assert base + 6 * 16 in addresses and base + 48 * 16 + 6 * 16 in addresses
    monkeypatch.setattr(memutil, "resident", lambda a: True)  # memory reused
    assert not plan.fresh()
    monkeypatch.setattr(memutil, "resident", lambda a: False)
    assert plan.fresh() == memutil.prefault_supported()


def test_bands_cover_every_node_in_order():
    from kvstore.engine.restore import BAND_NODES, _band_size, _bands

    for nodes, readers in [(1, 2), (3, 2), (8, 2), (9, 2), (128, 2), (100, 3)]:
        size = _band_size(nodes, readers)
        bands = _bands(nodes, size)
        assert [i for a, b in bands for i in range(a, b)] == list(range(nodes))
        assert all(1 <= b - a <= BAND_NODES for a, b in bands)
        if nodes >= 2 * readers:
            assert len(bands) >= 2 * readers


def test_prefaulted_bands_are_long_enough_for_big_calls():
    from kvstore.engine.restore import PREFAULT_CALL_BYTES, _band_size

    node_row = 256 * 128  # 256 tokens of 64 float16 values: 32 KiB per head
    want = PREFAULT_CALL_BYTES // node_row
    assert _band_size(1024, 2, call_bytes=node_row) == want
    # No longer than one reader's share: no reader is left without a band.
    assert _band_size(8, 2, call_bytes=node_row) == 4
    assert _band_size(9, 2, call_bytes=node_row) == 5
    assert _band_size(1, 2, call_bytes=node_row) == 1
    # Rows longer than a call: one node per band.
    assert _band_size(128, 2, call_bytes=PREFAULT_CALL_BYTES * 2) == 1


def test_disable_prefault_makes_it_a_no_op(monkeypatch):
    monkeypatch.setattr(memutil._LIBC, "populate", memutil._LIBC.populate)
    memutil.disable_prefault()
    assert not memutil.prefault_supported()
    buf = bytearray(4 * memutil.PAGE)
    address = np.frombuffer(buf, np.uint8).ctypes.data
    assert memutil.prefault([(address, len(buf))]) is False
