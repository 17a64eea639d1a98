"""Reading an LMDB ``data.mdb`` without mapping it: its meta pages and its free list.

LMDB maps the file and reads pages through the map, so a page past the file's end
kills the process with SIGBUS. A file LMDB wrote may legitimately end before the last
page its meta page names: pages allocated and freed again inside one write
transaction are never written (their numbers go to the free list), and a later
transaction may write pages past them, leaving holes. LMDB reads only the pages
reachable from the meta page's roots, never a free one, and a writer reusing a free
page writes it before reading it. So a file is safe to map when every page number
from its end up to the last page is free: :func:`unwritten_pages_are_free` checks
that by walking the free-list B-tree with ``pread`` (every page it reads must itself
lie inside the file). It guards against files cut short (an interrupted copy, a
truncation), not crafted ones: a free list listing live pages would pass, and LMDB
trusts every page of its file anyway.

The layout (LMDB 0.9, 64-bit ``pgno_t``/``size_t``, little-endian) is LMDB's
on-disk format version 1 (``MDB_DATA_VERSION``): page header ``pgno u64, pad u16,
flags u16, lower u16, upper u16``; node ``lo u16, hi u16, flags u16, ksize u16`` then
the key and the data; free-list records are ``txnid -> [count, pgno...]`` (u64s).
"""

import os
import struct
from typing import NamedTuple, Optional, Set

MAGIC = 0xBEEFC0DE  # MDB_MAGIC
P_INVALID = (1 << 64) - 1  # the root of an empty database
_PAGE_HEAD = struct.Struct("<QHHHH")  # pgno, pad, flags, lower, upper
_PAGE_HEAD_BYTES = 16  # PAGEHDRSZ
_NODE = struct.Struct("<HHHH")  # lo, hi, flags, key size
_NODE_BYTES = 8
_P_BRANCH, _P_LEAF, _P_OVERFLOW, _P_LEAF2 = 0x01, 0x02, 0x04, 0x20
_F_BIGDATA = 0x01  # a leaf node whose data is on overflow pages
_U64 = struct.Struct("<Q")
_MAX_DEPTH = 64  # B-tree levels; LMDB's cursors stop at 32 (CURSOR_STACK)

# A meta page (MDB_meta after the page header): magic, version, address, map size,
# then two MDB_db (48 bytes each: pad, flags, depth, branch, leaf and overflow page
# counts, entries, root), the last page number and the transaction id.
_META = struct.Struct("<II")  # magic, data version: at offset 16
_META_PSIZE = 40  # the free DB's md_pad: the page size
_META_FREE_ROOT = 80  # the free DB's md_root
_META_LAST = struct.Struct("<QQ")  # last page number, txn id: at offset 136
META_BYTES = 152


class Meta(NamedTuple):
    """What kvstore reads of one LMDB meta page."""

    page_size: int
    last_page: int
    txnid: int
    free_root: int


def read_meta(page: bytes) -> Optional[Meta]:
    """The meta page at the start of ``page`` (its first :data:`META_BYTES`), None if
    it is not one (no magic, or an impossible page size)."""
    if len(page) < META_BYTES or _META.unpack_from(page, 16)[0] != MAGIC:
        return None
    psize = struct.unpack_from("<I", page, _META_PSIZE)[0]
    if psize < 512 or psize > 1 << 16 or psize & (psize - 1):
        return None
    last, txnid = _META_LAST.unpack_from(page, 136)
    (free_root,) = _U64.unpack_from(page, _META_FREE_ROOT)
    return Meta(psize, last, txnid, free_root)


def newest_meta(fd: int) -> Optional[Meta]:
    """The meta page LMDB opens with (the higher transaction id of pages 0 and 1), None
    when page 0 is not an LMDB meta page. Page 1 sits at page 0's page size."""
    first = read_meta(os.pread(fd, META_BYTES, 0))
    if first is None:
        return None
    second = read_meta(os.pread(fd, META_BYTES, first.page_size))
    metas = [m for m in (first, second) if m and m.page_size == first.page_size]
    return max(metas, key=lambda m: m.txnid)


class _Malformed(Exception):
    """The free list cannot be read: pages past the file's end, or not LMDB's."""


def unwritten_pages_are_free(fd: int, meta: Meta, size: int) -> bool:
    """Whether every page from the end of the ``size``-byte file up to
    ``meta.last_page`` is on the free list of ``meta`` (so LMDB never reads it), every
    free-list page lying inside the file. False for a file cut short, or a free list
    that is not LMDB's."""
    psize = meta.page_size
    whole = size // psize  # pages wholly inside the file
    if whole > meta.last_page:
        return True
    try:
        free = _free_pages(fd, meta.free_root, psize, whole)
    except (_Malformed, OSError, struct.error):
        return False
    return all(p in free for p in range(whole, meta.last_page + 1))


def _free_pages(fd: int, root: int, psize: int, pages: int) -> Set[int]:
    """Page numbers at or past ``pages`` on the free list rooted at ``root``."""
    out: Set[int] = set()
    if root == P_INVALID:
        return out
    seen: Set[int] = set()
    todo = [(root, 0)]
    while todo:
        pgno, depth = todo.pop()
        if depth > _MAX_DEPTH:
            raise _Malformed("too deep")
        page = _read_page(fd, pgno, psize, pages, seen)
        _, _, flags, lower, upper = _PAGE_HEAD.unpack_from(page)
        if flags & _P_LEAF2 or not flags & (_P_BRANCH | _P_LEAF):
            raise _Malformed(f"page {pgno} is no free-list page")
        if not _PAGE_HEAD_BYTES <= lower <= upper <= psize:
            raise _Malformed(f"page {pgno} has bounds {lower}..{upper}")
        count = (lower - _PAGE_HEAD_BYTES) >> 1
        for ptr in struct.unpack_from(f"<{count}H", page, _PAGE_HEAD_BYTES):
            if not upper <= ptr <= psize - _NODE_BYTES:
                raise _Malformed(f"page {pgno}: node at {ptr}")
            lo, hi, nflags, ksize = _NODE.unpack_from(page, ptr)
            data_at = ptr + _NODE_BYTES + ksize
            if flags & _P_BRANCH:
                todo.append((lo | hi << 16 | nflags << 32, depth + 1))
                continue
            dsize = lo | hi << 16
            if nflags & _F_BIGDATA:
                data = _overflow(fd, page, data_at, dsize, psize, pages, seen)
            else:
                data = page[data_at : data_at + dsize]
            if len(data) != dsize or dsize < 8:
                raise _Malformed(f"page {pgno}: a record of {len(data)} bytes")
            (n,) = _U64.unpack_from(data)
            if 8 * (n + 1) > dsize:
                raise _Malformed(f"page {pgno}: a list of {n} pages in {dsize} bytes")
            out.update(p for p in struct.unpack_from(f"<{n}Q", data, 8) if p >= pages)
    return out


def _read_page(fd: int, pgno: int, psize: int, pages: int, seen: Set[int]) -> bytes:
    """Page ``pgno`` (inside the file's ``pages`` whole pages, read once at most)."""
    if pgno < 2 or pgno >= pages or pgno in seen:
        raise _Malformed(f"page {pgno} is outside the file or read twice")
    seen.add(pgno)
    page = os.pread(fd, psize, pgno * psize)
    if len(page) != psize or _U64.unpack_from(page)[0] != pgno:
        raise _Malformed(f"page {pgno} does not say it is")
    return page


def _overflow(
    fd: int, page: bytes, at: int, dsize: int, psize: int, pages: int, seen: Set[int]
) -> bytes:
    """The ``dsize`` bytes of a big record, on the overflow pages the node names."""
    (first,) = _U64.unpack_from(page, at)
    span = (_PAGE_HEAD_BYTES - 1 + dsize) // psize + 1  # LMDB's OVPAGES
    if first < 2 or first + span > pages:
        raise _Malformed(f"overflow pages {first}+{span} outside the file")
    head = _read_page(fd, first, psize, pages, seen)
    if not _PAGE_HEAD.unpack_from(head)[2] & _P_OVERFLOW:
        raise _Malformed(f"page {first} is no overflow page")
    return os.pread(fd, dsize, first * psize + _PAGE_HEAD_BYTES)
