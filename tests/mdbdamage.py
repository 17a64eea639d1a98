"""Damage to an LMDB ``data.mdb`` as a lost disk sector, a flipped bit or a careless
tool makes it, for the damaged-index tests. Pages are found by their role (which
database, which depth) with a reader of the test's own, so the damage hits what
the test means whatever the store's page numbers are."""

import os
import struct
from typing import Dict, List, NamedTuple

_U64 = struct.Struct("<Q")
_DB = struct.Struct(
    "<IHHQQQQQ"
)  # MDB_db: pad, flags, depth, 3 page counts, entries, root
P_INVALID = (1 << 64) - 1
META_PSIZE, META_MAIN, META_FREE, META_TXNID = 40, 88, 40, 144


class Page(NamedTuple):
    number: int
    db: str
    level: int  # 1: the root
    depth: int  # the tree's depth: level == depth is a leaf


def data_file(store) -> str:
    return os.path.join(str(store), "index", "data.mdb")


def _read(path, at, n) -> bytes:
    with open(path, "rb") as f:
        f.seek(at)
        return f.read(n)


def _write(path, at, raw: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(raw)


def page_size(path) -> int:
    return struct.unpack("<I", _read(path, META_PSIZE, 4))[0]


def newest_meta(path) -> int:
    """Which meta page (0 or 1) has the higher transaction id."""
    psize = page_size(path)
    ids = [_U64.unpack(_read(path, n * psize + META_TXNID, 8))[0] for n in (0, 1)]
    return int(ids[1] > ids[0])


def _db(path, at) -> tuple:
    return _DB.unpack(_read(path, at, _DB.size))


def pages(store) -> List[Page]:
    """Every page of every named database (and the main one) of the newest meta."""
    path = data_file(store)
    psize = page_size(path)
    meta_at = newest_meta(path) * psize
    out: List[Page] = []
    roots = [("main", _db(path, meta_at + META_MAIN))]
    while roots:
        name, db = roots.pop()
        depth, root = db[2], db[7]
        if root == P_INVALID:
            continue
        todo = [(root, 1)]
        while todo:
            pgno, level = todo.pop()
            out.append(Page(pgno, name, level, depth))
            raw = _read(path, pgno * psize, psize)
            lower = struct.unpack_from("<H", raw, 12)[0]
            for ptr in struct.unpack_from(f"<{(lower - 16) // 2}H", raw, 16):
                lo, hi, flags, ksize = struct.unpack_from("<HHHH", raw, ptr)
                if level < depth:
                    todo.append((lo | hi << 16 | flags << 32, level + 1))
                elif name == "main":
                    key = raw[ptr + 8 : ptr + 8 + ksize].decode()
                    roots.append((key, _DB.unpack_from(raw, ptr + 8 + ksize)))
    return out


def find(store, db: str, *, level: int = None, leaf: bool = None) -> List[int]:
    """Page numbers of database ``db`` at ``level`` (1: root) or of its leaves."""
    found = []
    for p in pages(store):
        if p.db != db:
            continue
        if level is not None and p.level != level:
            continue
        if leaf is not None and (p.level == p.depth) != leaf:
            continue
        found.append(p.number)
    return sorted(found)


def zero_page(store, pgno: int) -> None:
    path = data_file(store)
    psize = page_size(path)
    _write(path, pgno * psize, bytes(psize))


def flip_main_root(store, bit: int = 3) -> None:
    """Flip one bit of the newest meta page's main-database root page number."""
    path = data_file(store)
    at = newest_meta(path) * page_size(path) + META_MAIN + 40
    (root,) = _U64.unpack(_read(path, at, 8))
    _write(path, at, _U64.pack(root ^ (1 << bit)))


def tie_meta_pages(store, *, to: str = "older") -> int:
    """Give both meta pages one transaction id: the older page's (``to="older"``:
    LMDB's readers then take the page of that id's parity, the older snapshot) or
    the newer's. Returns the id."""
    path = data_file(store)
    psize = page_size(path)
    new = newest_meta(path)
    src, dst = (1 - new, new) if to == "older" else (new, 1 - new)
    txnid = _read(path, src * psize + META_TXNID, 8)
    _write(path, dst * psize + META_TXNID, txnid)
    return _U64.unpack(txnid)[0]


def meta_of_other_page_size(store, size: int = 8192) -> None:
    """Make meta page 1 the newest, with another page size."""
    path = data_file(store)
    psize = page_size(path)
    ids = [_U64.unpack(_read(path, n * psize + META_TXNID, 8))[0] for n in (0, 1)]
    _write(path, psize + META_TXNID, _U64.pack(max(ids) + 1))
    _write(path, psize + META_PSIZE, struct.pack("<I", size))


def free_list_lists(store, live: int) -> None:
    """Rewrite the first page number of the first free-list record as ``live``."""
    path = data_file(store)
    psize = page_size(path)
    free = _db(path, newest_meta(path) * psize + META_FREE)
    depth, root = free[2], free[7]
    assert root != P_INVALID and depth == 1, "the test wants a one-page free list"
    raw = _read(path, root * psize, psize)
    ptr = struct.unpack_from("<H", raw, 16)[0]
    lo, hi, flags, ksize = struct.unpack_from("<HHHH", raw, ptr)
    assert not flags & 1, "the record lies on overflow pages"
    data_at = root * psize + ptr + 8 + ksize
    (count,) = _U64.unpack(_read(path, data_at, 8))
    assert count >= 1
    _write(path, data_at + 8, _U64.pack(live))


def node_keys_by_page(store) -> Dict[int, List[bytes]]:
    """The keys on each leaf page of the nodes database."""
    path = data_file(store)
    psize = page_size(path)
    out = {}
    for pgno in find(store, "nodes", leaf=True):
        raw = _read(path, pgno * psize, psize)
        lower = struct.unpack_from("<H", raw, 12)[0]
        keys = []
        for ptr in struct.unpack_from(f"<{(lower - 16) // 2}H", raw, 16):
            ksize = struct.unpack_from("<H", raw, ptr + 6)[0]
            keys.append(raw[ptr + 8 : ptr + 8 + ksize])
        out[pgno] = keys
    return out
