"""Checking every page of a ``data.mdb`` that LMDB will read, before it reads one.

liblmdb trusts its file. A zeroed page inside a B-tree (a lost disk sector) ends the
process in an assertion (``IS_LEAF(mp)`` in ``mdb_cursor_next``: SIGABRT) when a
cursor steps onto it, a page of the wrong type met by a search is
``MDB_CORRUPTED``, a page number past the file's end kills it with SIGBUS, a node
offset pointing outside its page reads unmapped memory. None of these can be caught
in the process. So before a scan of the whole index (the maintenance commands,
``kvstore serve`` at start) this module reads, with ``pread``, every page reachable
from the meta page its read transaction uses (:func:`check_file`), and checks that
each one is what LMDB would have written there:

* its header names its own page number (a zeroed page names 0, a misdirected
  pointer another page), it lies inside the file and before the meta page's last
  page, and no page is reached twice;
* it is a branch page above its tree's depth and a leaf at it (LMDB's trees have all
  leaves at one depth), with sane bounds, node offsets and sizes inside the page,
  at least two keys in a branch (an assertion otherwise), keys in ascending order,
  and node flags kvstore's databases can have;
* overflow pages (large values) are overflow pages, long enough for their value;
* every database's page and entry counts equal what its record says;
* the free list lists no page a tree uses (LMDB would hand it out and overwrite a
  live page) and every meta page agrees with the other on the page size, and two
  meta pages of one transaction id are the same.

:func:`check_roots` is the bounded check of every other open (the main database,
small trees, each large tree's root page, a small free list: a time that does not
grow with the index), after which the open store runs :func:`check_file` in the
background and checks the key ranges its cursors read meanwhile with
:func:`check_range` (:mod:`kvstore.disk.pageguard`). :func:`walk` is the same walk
in a tolerant mode for salvaging (it skips what it cannot read and reports it). The
format is that of :mod:`kvstore.disk.mdbfile`.
"""

import os
import struct
from bisect import bisect_right
from typing import (
    Callable,
    Dict,
    Iterator,
    List,
    NamedTuple,
    Optional,
    Set,
    Tuple,
)

from .mdbfile import MAGIC, P_INVALID

_PAGE_HEAD = struct.Struct("<QHHHH")  # pgno, pad, flags, lower, upper
_HEAD = 16  # PAGEHDRSZ
_NODE = struct.Struct("<HHHH")  # lo, hi, flags, key size
_NODE_BYTES = 8
_OVERFLOW_PAGES = struct.Struct("<I")  # mp_pages, at offset 12 of an overflow page
_P_BRANCH, _P_LEAF, _P_OVERFLOW, _P_META, _P_LEAF2, _P_SUBP = 1, 2, 4, 8, 0x20, 0x40
_TYPE_BITS = _P_BRANCH | _P_LEAF | _P_OVERFLOW | _P_META | _P_LEAF2 | _P_SUBP
_F_BIGDATA, _F_SUBDATA = 0x01, 0x02
_DB = struct.Struct("<IHHQQQQQ")  # MDB_db: pad, flags, depth, pages..., entries, root
_META_HEAD = struct.Struct("<II")  # magic, version
_META_TAIL = struct.Struct("<QQ")  # last page, txn id (offset 136)
_FREE_AT, _MAIN_AT, META_END = 40, 88, 152
_U64 = struct.Struct("<Q")
_MAX_DEPTH = 32  # LMDB's CURSOR_STACK
_DATA_VERSION = 1  # MDB_DATA_VERSION
SMALL_TREE_PAGES = 16  # trees check_roots checks whole: a bounded cost at every open


class Damage(Exception):
    """A page LMDB would read is not what LMDB writes: the message says which."""


class Stopped(Exception):
    """Raised by a walk's ``tick`` to end it (the index is being closed)."""


class DbRecord(NamedTuple):
    """An ``MDB_db``: one B-tree's record (in a meta page, or in the main database)."""

    flags: int
    depth: int
    branch_pages: int
    leaf_pages: int
    overflow_pages: int
    entries: int
    root: int

    @classmethod
    def parse(cls, raw: bytes, at: int = 0) -> "DbRecord":
        _, flags, depth, branch, leaf, overflow, entries, root = _DB.unpack_from(
            raw, at
        )
        return cls(flags, depth, branch, leaf, overflow, entries, root)


class MetaPage(NamedTuple):
    """One of the two meta pages at the start of ``data.mdb``."""

    number: int  # 0 or 1
    page_size: int
    last_page: int
    txnid: int
    free: DbRecord
    main: DbRecord
    body: bytes  # the meta fields after the page header, for comparing two pages


def read_meta_pages(fd: int) -> List[Optional[MetaPage]]:
    """Meta pages 0 and 1 (None for one that is not an LMDB meta page). Page 1 lies
    at page 0's page size, where LMDB reads it."""
    first = _parse_meta(0, os.pread(fd, META_END, 0))
    if first is None:
        return [None, None]
    return [first, _parse_meta(1, os.pread(fd, META_END, first.page_size))]


def _parse_meta(number: int, raw: bytes) -> Optional[MetaPage]:
    if len(raw) < META_END:
        return None
    flags = _PAGE_HEAD.unpack_from(raw)[2]
    magic, version = _META_HEAD.unpack_from(raw, _HEAD)
    if not flags & _P_META or magic != MAGIC or version != _DATA_VERSION:
        return None
    psize = struct.unpack_from("<I", raw, _FREE_AT)[0]  # the free DB's md_pad
    if psize < 512 or psize > 1 << 16 or psize & (psize - 1):
        return None
    last, txnid = _META_TAIL.unpack_from(raw, 136)
    return MetaPage(
        number,
        psize,
        last,
        txnid,
        DbRecord.parse(raw, _FREE_AT),
        DbRecord.parse(raw, _MAIN_AT),
        raw[_HEAD + 8 :],  # after magic and version: the map address may differ
    )


def meta_problem(metas: List[Optional[MetaPage]]) -> Optional[str]:
    """Why LMDB would open these meta pages differently from what kvstore checks (or
    not at all), or None: a page that is not a meta page, two page sizes, or two
    different pages of one transaction id (LMDB's readers then take one by the
    id's parity, its open the other)."""
    first, second = metas
    if first is None:
        return "meta page 0 is not an LMDB meta page"
    if second is None:
        return "meta page 1 is not an LMDB meta page"
    if first.page_size != second.page_size:
        return (
            f"its meta pages disagree on the page size ({first.page_size} and "
            f"{second.page_size} bytes)"
        )
    if first.txnid == second.txnid and first.body[16:] != second.body[16:]:
        return (
            f"both meta pages claim transaction {first.txnid} but name different "
            "pages"
        )
    return None


class _Walker:
    """Reads pages of one file for one meta page, each at most once."""

    def __init__(
        self,
        fd: int,
        meta: MetaPage,
        file_size: int,
        tick: Optional[Callable[[], None]] = None,
    ):
        self.fd = fd
        self.tick = tick  # called before each page is read
        self.psize = meta.page_size
        self.last_page = meta.last_page
        self.file_pages = file_size // meta.page_size
        self.live: Set[int] = set()

    def page(self, pgno: int, what: str) -> bytes:
        """Page ``pgno`` (reached as ``what``), checked to be readable and its own."""
        if pgno < 2 or pgno > self.last_page:
            raise Damage(
                f"{what} is page {pgno}, outside the file's pages 2..{self.last_page}"
            )
        if pgno in self.live:
            raise Damage(f"{what} is page {pgno}, which another pointer reaches too")
        if self.tick is not None:
            self.tick()
        if pgno >= self.file_pages:
            raise Damage(f"page {pgno} ({what}) lies past the end of the file")
        self.live.add(pgno)
        page = os.pread(self.fd, self.psize, pgno * self.psize)
        if len(page) < self.psize:
            raise Damage(f"page {pgno} ({what}) lies past the end of the file")
        own = _U64.unpack_from(page)[0]
        if own != pgno:
            state = "is zeroed" if not any(page) else f"holds page {own}'s header"
            raise Damage(f"page {pgno} ({what}) {state}")
        return page

    def overflow(
        self, pgno: int, dsize: int, what: str, *, read: bool = True
    ) -> Tuple[int, bytes]:
        """``(pages, bytes)`` of the ``dsize``-byte value on overflow pages at
        ``pgno`` (no bytes unless ``read``)."""
        page = self.page(pgno, what)
        flags = _PAGE_HEAD.unpack_from(page)[2]
        if flags & _TYPE_BITS != _P_OVERFLOW:
            raise Damage(f"page {pgno} ({what}) is {_kind(flags)}, not overflow")
        (count,) = _OVERFLOW_PAGES.unpack_from(page, 12)
        need = -(-(_HEAD + dsize) // self.psize)
        if count < need or pgno + count - 1 > self.last_page:
            raise Damage(
                f"page {pgno} ({what}) is an overflow run of {count} pages for "
                f"{dsize} bytes"
            )
        if pgno + count > self.file_pages:
            raise Damage(f"page {pgno} ({what}) runs past the end of the file")
        for extra in range(pgno + 1, pgno + count):
            if extra in self.live:
                raise Damage(f"{what} overlaps page {extra}, which another uses")
            self.live.add(extra)
        data = b""
        if read and dsize:
            rest = max(0, _HEAD + dsize - self.psize)  # bounded: count pages hold it
            data = page[_HEAD:] + os.pread(self.fd, rest, (pgno + 1) * self.psize)
            data = data[:dsize]
        return count, data


class _Counts:
    def __init__(self):
        self.branch = self.leaf = self.overflow = self.entries = 0


Record = Tuple[bytes, bytes, int]  # key, value (or a DbRecord's bytes), node flags


def _tree(
    walker: _Walker,
    name: str,
    db: DbRecord,
    *,
    values: bool,
    on_damage: Optional[Callable[[str], None]] = None,
) -> Iterator[Record]:
    """Every record of the tree ``db`` (values read only with ``values``; sub-database
    records always), checking each page. A damaged page raises :class:`Damage`, or
    with ``on_damage`` is reported there and skipped with what hangs below it."""
    if db.root == P_INVALID:
        if db.depth or db.entries:
            _raise_or(on_damage, f"the {name} database is empty but has records")
        return
    if not 1 <= db.depth <= _MAX_DEPTH:
        _raise_or(on_damage, f"the {name} database has depth {db.depth}")
        return
    counts = _Counts()
    free_db = name == "free-list"
    stack = [(db.root, 1, f"the root of the {name} database")]
    while stack:
        pgno, level, what = stack.pop()
        try:
            records = _page_records(walker, pgno, level, db.depth, what, name, free_db)
            kind, nodes = records
        except Damage as e:
            _raise_or(on_damage, str(e))
            continue
        if kind == _P_BRANCH:
            counts.branch += 1
            stack.extend(
                (child, level + 1, f"a child of page {pgno} in the {name} database")
                for child, _ in reversed(nodes)
            )
            continue
        counts.leaf += 1
        for key, dsize, nflags, at, page in nodes:
            counts.entries += 1
            if nflags & _F_BIGDATA:
                opg = _U64.unpack_from(page, at)[0]
                try:
                    pages, data = walker.overflow(
                        opg, dsize, f"a value of page {pgno} in {name}", read=values
                    )
                except Damage as e:
                    _raise_or(on_damage, str(e))
                    continue
                counts.overflow += pages
            else:
                data = page[at : at + dsize] if values or nflags else b""
            yield key, data, nflags
    if on_damage is None:
        have = (counts.branch, counts.leaf, counts.overflow, counts.entries)
        said = (db.branch_pages, db.leaf_pages, db.overflow_pages, db.entries)
        if have != said:
            raise Damage(
                f"the {name} database's pages hold {have[3]} records in "
                f"{have[0]}+{have[1]}+{have[2]} pages, its record says {said[3]} in "
                f"{said[0]}+{said[1]}+{said[2]}"
            )


def _raise_or(on_damage, message: str) -> None:
    if on_damage is None:
        raise Damage(message)
    on_damage(message)


def _page_records(
    walker: _Walker, pgno: int, level: int, depth: int, what: str, name, free_db
):
    """``(P_BRANCH, [(child pgno, key)...])`` or ``(P_LEAF, [(key, data size, node
    flags, data offset, page)...])`` of page ``pgno``, checked."""
    page = walker.page(pgno, what)
    psize = walker.psize
    _, _, flags, lower, upper = _PAGE_HEAD.unpack_from(page)
    want = _P_LEAF if level == depth else _P_BRANCH
    if flags & _TYPE_BITS != want:
        wanted = "a leaf" if want == _P_LEAF else "a branch page"
        raise Damage(f"page {pgno} ({what}) is {_kind(flags)} where {wanted} belongs")
    if not _HEAD <= lower <= upper <= psize or lower & 1:
        raise Damage(f"page {pgno} ({name}) has bounds {lower}..{upper}")
    count = (lower - _HEAD) >> 1
    if count < (1 if want == _P_LEAF or free_db else 2):
        raise Damage(f"page {pgno} ({name}) holds {count} keys")
    out = []
    last = None
    words = memoryview(page).cast("H")  # LMDB writes its pages in native byte order
    allowed = _F_SUBDATA if name == "main" else _F_BIGDATA
    is_leaf = want == _P_LEAF
    for i, ptr in enumerate(words[_HEAD // 2 : _HEAD // 2 + count]):
        if ptr < upper or ptr & 1 or ptr > psize - _NODE_BYTES:
            raise Damage(f"page {pgno} ({name}): node {i} at offset {ptr}")
        w = ptr >> 1
        at = ptr + _NODE_BYTES + words[w + 3]
        if at > psize:
            raise Damage(f"page {pgno} ({name}): node {i}'s key runs past the page")
        key = page[ptr + _NODE_BYTES : at]
        if i or is_leaf:  # a branch's first key is never compared
            order = int.from_bytes(key, "little") if free_db else key
            if last is not None and order <= last:
                raise Damage(f"page {pgno} ({name}): keys out of order at node {i}")
            last = order
        nflags = words[w + 2]
        if not is_leaf:
            out.append((words[w] | words[w + 1] << 16 | nflags << 32, key))
            continue
        dsize = words[w] | words[w + 1] << 16
        if nflags & ~allowed:
            raise Damage(f"page {pgno} ({name}): node {i} has flags {nflags:#x}")
        end = at + (8 if nflags & _F_BIGDATA else dsize)
        if end > psize or (nflags & _F_SUBDATA and dsize != _DB.size):
            raise Damage(f"page {pgno} ({name}): node {i}'s value runs past the page")
        out.append((key, dsize, nflags, at, page))
    return want, out


def _kind(flags: int) -> str:
    if not flags:
        return "no page (flags 0)"
    bits = ((1, "branch"), (2, "leaf"), (4, "overflow"), (8, "meta"))
    names = [name for bit, name in bits if flags & bit]
    return (" and ".join(names) or f"flags {flags:#x}") + " page"


def check_file(
    fd: int,
    meta: MetaPage,
    file_size: int,
    *,
    tick: Optional[Callable[[], None]] = None,
) -> int:
    """Check every page reachable from ``meta`` (see the module docstring).

    Returns:
        The number of pages checked.

    Raises:
        Damage: the first problem found.
        Stopped: from ``tick``, called before each page is read.
    """
    walker = _Walker(fd, meta, file_size, tick)
    for key, data, nflags in _tree(walker, "main", meta.main, values=False):
        if nflags & _F_SUBDATA:
            db = DbRecord.parse(data)
            label = key.decode("ascii", "replace")[:40]
            for _ in _tree(walker, label, db, values=False):
                pass
    free = set()
    for _, data, _ in _tree(walker, "free-list", meta.free, values=True):
        free.update(_free_ids(data))
    used = free & walker.live
    if used:
        raise Damage(
            f"the free list names {len(used)} page(s) in use (page {min(used)} "
            "first): LMDB would overwrite them"
        )
    beyond = [p for p in free if p > meta.last_page or p < 2]
    if beyond:
        raise Damage(f"the free list names page {beyond[0]}, outside the file's pages")
    return len(walker.live)


def check_roots(fd: int, meta: MetaPage, file_size: int) -> int:
    """The bounded check of a library open: every page of the main database (in
    kvstore's index one leaf naming its few databases: :mod:`kvstore.disk.storecheck`
    walks it all), every page of each named database of at most
    ``SMALL_TREE_PAGES`` pages (its whole scans, such as the namespaces', are then
    safe), the root page of every larger one, and the free list whole when it has at
    most ``SMALL_TREE_PAGES`` pages (its root only otherwise): the pages it names
    must lie in the file and be none of the pages checked here. The pages below a
    large tree's root are left to :func:`check_file` (the maintenance scans, and
    the open store's check in the background: :mod:`kvstore.disk.pageguard`) and to
    :func:`check_range` for what the read path steps onto meanwhile.

    Returns:
        The number of pages checked.

    Raises:
        Damage: the first problem found.
    """
    walker = _Walker(fd, meta, file_size)
    roots = []
    for key, data, nflags in _tree(walker, "main", meta.main, values=False):
        if nflags & _F_SUBDATA:
            roots.append((key.decode("ascii", "replace")[:40], DbRecord.parse(data)))
    roots.append(("free-list", meta.free))  # last: it is checked against the rest
    for name, db in roots:
        pages = db.branch_pages + db.leaf_pages + db.overflow_pages
        if pages <= SMALL_TREE_PAGES:
            records = _tree(walker, name, db, values=name == "free-list")
            if name == "free-list":
                _free_list_clear(walker, meta, records)
            else:
                for _ in records:
                    pass
            continue
        if not 1 <= db.depth <= _MAX_DEPTH or db.root == P_INVALID:
            raise Damage(f"the {name} database has depth {db.depth}")
        what = f"the root of the {name} database"
        _page_records(walker, db.root, 1, db.depth, what, name, name == "free-list")
    return len(walker.live)


def _free_list_clear(walker: _Walker, meta: MetaPage, records) -> None:
    """Check that the free list's ``records`` name no page ``walker`` has seen in
    use (LMDB would hand it to a writer, which overwrites it) and none outside the
    file's pages."""
    free = set()
    for _, data, _ in records:
        free.update(_free_ids(data))
    used = free & walker.live
    if used:
        raise Damage(
            f"the free list names {len(used)} page(s) in use (page {min(used)} "
            "first): LMDB would overwrite them"
        )
    beyond = sorted(p for p in free if p > meta.last_page or p < 2)
    if beyond:
        raise Damage(f"the free list names page {beyond[0]}, outside the file's pages")


def named_databases(fd: int, meta: MetaPage, file_size: int) -> Dict[str, DbRecord]:
    """The records of the named databases in ``meta``'s main database, its pages
    checked."""
    walker = _Walker(fd, meta, file_size)
    return {
        key.decode("ascii", "replace"): DbRecord.parse(data)
        for key, data, nflags in _tree(walker, "main", meta.main, values=False)
        if nflags & _F_SUBDATA
    }


def check_range(
    fd: int,
    meta: MetaPage,
    file_size: int,
    name: str,
    db: DbRecord,
    lo: bytes,
    hi: Optional[bytes],
    sound: Set[int],
    branches: Dict[int, Tuple[bytes, List[int], List[bytes]]],
) -> int:
    """Check the pages of database ``name`` (``db``, of ``meta``'s snapshot) that a
    cursor confined to keys ``lo``..``hi`` (None: to the end) can step onto:
    every page whose keys meet that range, and at every level the neighbour on
    each side of it down to the leaf next to the range (a cursor's first step past
    it), with the page checks of :func:`check_file`. Leaves in ``sound`` (checked
    before) are not read again; every page checked is added to it. ``branches``
    keeps each branch page checked with its children and keys: one that reads
    the same again is not parsed again. A search
    (LMDB's ``get``) needs none of this: it answers ``MDB_CORRUPTED`` for a page
    of the wrong type; a step sideways (``next``, ``prev``, a ``set_range``
    past a leaf's last key) asserts instead, ending the process.

    Returns:
        The number of pages read.

    Raises:
        Damage: the first problem found.
    """
    if db.root == P_INVALID:
        return 0
    if not 1 <= db.depth <= _MAX_DEPTH:
        raise Damage(f"the {name} database has depth {db.depth}")
    walker = _Walker(fd, meta, file_size)
    stack = [(db.root, 1, 0, f"the root of the {name} database")]
    while stack:
        pgno, level, side, what = stack.pop()  # side: 0 the range, -1/1 an edge
        if level == db.depth:
            if pgno not in sound:
                _check_leaf(walker, pgno, level, what, name)
                sound.add(pgno)
            continue
        known = branches.get(pgno)
        if known is None or _read(walker, pgno) != known[0]:
            _, nodes = _page_records(walker, pgno, level, db.depth, what, name, False)
            # a branch's first key is never compared
            known = (
                _read(walker, pgno),
                [c for c, _ in nodes],
                [k for _, k in nodes[1:]],
            )
            branches[pgno] = known
        _, children, keys = known
        below = f"a child of page {pgno} in the {name} database"
        if side:  # the edge of a neighbour: its last child (left) or first (right)
            stack.append((children[-1 if side < 0 else 0], level + 1, side, below))
            continue
        first = bisect_right(keys, lo)
        last = len(children) - 1 if hi is None else bisect_right(keys, hi)
        stack.extend((c, level + 1, 0, below) for c in children[first : last + 1])
        if first > 0:
            stack.append((children[first - 1], level + 1, -1, below))
        if last < len(children) - 1:
            stack.append((children[last + 1], level + 1, 1, below))
    return len(walker.live)


def _read(walker: _Walker, pgno: int) -> bytes:
    return os.pread(walker.fd, walker.psize, pgno * walker.psize)


def _check_leaf(walker: _Walker, pgno: int, level: int, what: str, name: str) -> None:
    """Check leaf page ``pgno`` and the overflow pages of its values."""
    _, nodes = _page_records(walker, pgno, level, level, what, name, False)
    for _, dsize, nflags, at, page in nodes:
        if nflags & _F_BIGDATA:
            opg = _U64.unpack_from(page, at)[0]
            walker.overflow(opg, dsize, f"a value of page {pgno}", read=False)


def _free_ids(data: bytes) -> List[int]:
    if len(data) < 8:
        raise Damage(f"a free-list record of {len(data)} bytes")
    (n,) = _U64.unpack_from(data)
    if 8 * (n + 1) > len(data):
        raise Damage(f"a free-list record of {n} pages in {len(data)} bytes")
    return list(struct.unpack_from(f"<{n}Q", data, 8))


def walk(
    fd: int, meta: MetaPage, file_size: int, on_damage: Callable[[str], None]
) -> Iterator[Tuple[str, bytes, bytes]]:
    """``(database name, key, value)`` of every record of the named databases that
    can be read from ``meta``'s trees; what cannot is passed to ``on_damage``."""
    walker = _Walker(fd, meta, file_size)
    subs = []
    for key, data, nflags in _tree(
        walker, "main", meta.main, values=True, on_damage=on_damage
    ):
        if nflags & _F_SUBDATA:
            subs.append((key, DbRecord.parse(data)))
    for key, db in subs:
        name = key.decode("ascii", "replace")
        for k, v, _ in _tree(walker, name, db, values=True, on_damage=on_damage):
            yield name, k, v


def leaf_records(
    fd: int, psize: int, file_size: int
) -> Iterator[Tuple[int, bytes, bytes]]:
    """``(page, key, value)`` of every record on any page of the file that reads as
    a whole leaf page, reachable or not (its tree may have lost the branch above it;
    it may also be a page freed long ago: the caller checks what it takes)."""
    pages = file_size // psize
    for pgno in range(2, pages):
        page = os.pread(fd, psize, pgno * psize)
        if len(page) < psize or _U64.unpack_from(page)[0] != pgno:
            continue
        if _PAGE_HEAD.unpack_from(page)[2] & _TYPE_BITS != _P_LEAF:
            continue
        fake = MetaPage(0, psize, pages - 1, 0, None, None, b"")
        walker = _Walker(fd, fake, file_size)
        try:
            _, nodes = _page_records(walker, pgno, 1, 1, "a page", "any", False)
        except Damage:
            continue
        for key, dsize, nflags, at, page_bytes in nodes:
            if nflags & _F_BIGDATA:
                try:
                    _, data = walker.overflow(
                        _U64.unpack_from(page_bytes, at)[0], dsize, "a value"
                    )
                except Damage:
                    continue
            else:
                data = page_bytes[at : at + dsize]
            yield pgno, key, data
