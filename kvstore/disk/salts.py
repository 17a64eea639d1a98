"""Cache salts: separate trees of one namespace for tenants that must not share KV.

A salt (``cache_salt`` in a server request, ``salt=`` in the library) is mixed into
the root of the hash chain with a keyed hash whose key is a random secret kept in
the store's metadata::

    root(salt) = blake2b(root(namespace) || salt, key=secret, person="kvstore-salt")

so salted chains never meet each other or the unsalted one, and the store holds
no salt: a copy of the directory shows anonymous trees. (xxh3 takes only a 64-bit
seed and is not meant as a keyed hash; blake2b is, and costs ~1 us per request.)

A :class:`Tenant` (a gateway's tenant header in ``kvstore serve``) is another
domain, so tenant "A" and the salt "A" never share a tree::

    root(tenant) = blake2b(root(namespace) || tenant, key=secret, person="kvstore-tenant")
    root(tenant, salt) = blake2b(root(tenant) || salt, key=secret, person="kvstore-narrow")

A tenant's narrowed trees count against its own quota (``salt_disk_bytes``): the
index records which trees belong to which tenant's root (:func:`group_roots`), by
hash only.

The first node of every tree starts at token 0 and hangs from its root, which is
never a node: ``start == 0`` is how maintenance tools tell a tree's first nodes,
whatever root they hang from.
"""

import hashlib
import secrets
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple, Union

from .index import CorruptRecord, Index, StoreError
from .policy import DiskNode, disk_victims

MAX_SALT_BYTES = 256  # as vLLM's server: a longer cache_salt is refused
SECRET_KEY = b"salt_secret"  # in the meta DB
SECRET_BYTES = 32
_PERSON = b"kvstore-salt"
_TENANT = b"kvstore-tenant"
_NARROW = b"kvstore-narrow"
# Meta DB: GROUP_PREFIX + namespace + tenant root + narrowed tree root -> b"".
GROUP_PREFIX = b"tree_group:"


@dataclass(frozen=True)
class Tenant:
    """A tenant's cache salt: its own tree, apart from every plain salt's.

    ``Tenant("acme")`` is the tree ``kvstore serve --salt-header`` serves for the
    header value ``acme``; ``Tenant("acme", "s")`` the tree a request of that tenant
    with ``cache_salt: "s"`` uses. Both count against the tenant's quota.

    Args:
        name: The tenant (the header's value); a non-empty string of at most 256
            bytes in UTF-8.
        salt: A sub-salt narrowing the tenant's tree (the body's ``cache_salt``),
            or None.
    """

    name: str
    salt: Optional[str] = None


Salt = Union[None, str, Tenant]


def check_salt(salt, *, what: str = "salt") -> Optional[bytes]:
    """The UTF-8 bytes of ``salt`` (None for None).

    Raises:
        TypeError: ``salt`` is not a string.
        ValueError: it is empty, longer than :data:`MAX_SALT_BYTES` bytes in UTF-8,
            or not encodable (a lone surrogate).
    """
    if salt is None:
        return None
    if not isinstance(salt, str):
        raise TypeError(f"{what} must be a non-empty string, got {_type(salt)}")
    if not salt:
        raise ValueError(f"{what} must be a non-empty string, got ''")
    try:
        raw = salt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid text: {e.reason}") from None
    if len(raw) > MAX_SALT_BYTES:
        raise ValueError(
            f"{what} is {len(raw)} bytes long in UTF-8; at most {MAX_SALT_BYTES}"
        )
    return raw


def parse_salt(salt, *, what: str = "salt") -> Optional[Tuple[Optional[bytes], bytes]]:
    """``(tenant bytes or None, salt bytes)`` of a salt (None for None); for a
    :class:`Tenant` without a sub-salt, ``(tenant bytes, b"")``.

    Raises:
        TypeError: ``salt`` is neither None, a string nor a :class:`Tenant`, or a
            part of it is not a string.
        ValueError: a part is empty, longer than :data:`MAX_SALT_BYTES` bytes in
            UTF-8, or not encodable.
    """
    if isinstance(salt, Tenant):
        name = check_salt(salt.name, what=f"{what} tenant")
        if name is None:
            raise TypeError(f"{what} tenant must be a non-empty string, got null")
        return name, check_salt(salt.salt, what=f"{what} salt") or b""
    raw = check_salt(salt, what=what)
    return None if raw is None else (None, raw)


def salted_root(root: bytes, secret: bytes, salt: bytes, *, person=_PERSON) -> bytes:
    """The root hash of ``salt``'s tree under the namespace root ``root``."""
    h = hashlib.blake2b(key=secret, digest_size=len(root), person=person)
    h.update(root)  # fixed width: ``root || salt`` cannot be split two ways
    h.update(salt)
    return h.digest()


def tree_of(
    root: bytes, secret: bytes, parts: Tuple[Optional[bytes], bytes]
) -> Tuple[bytes, bytes]:
    """``(tree root, quota root)`` of a parsed salt (:func:`parse_salt`): a tenant's
    narrowed trees count against the tenant's root; any other tree against itself."""
    tenant, salt = parts
    if tenant is None:
        tree = salted_root(root, secret, salt)
        return tree, tree
    group = salted_root(root, secret, tenant, person=_TENANT)
    if not salt:
        return group, group
    return salted_root(group, secret, salt, person=_NARROW), group


def _group_key(ns: bytes, group: bytes, tree: bytes = b"") -> bytes:
    return GROUP_PREFIX + ns + group + tree


def join_group(index: Index, txn, ns: bytes, group: bytes, tree: bytes) -> None:
    """Inside a write transaction: record that ``tree`` counts against ``group``."""
    if tree != group:
        txn.put(_group_key(ns, group, tree), b"", db=index.db["meta"])


def group_roots(index: Index, txn, ns: bytes, group: bytes) -> List[bytes]:
    """``group`` and the roots of the trees recorded as counting against it."""
    prefix = _group_key(ns, group)
    out = [group]
    cursor = txn.cursor(db=index.db["meta"])
    if cursor.set_range(prefix):
        for key in cursor.iternext(values=False):
            key = bytes(key)
            if not key.startswith(prefix):
                break
            if len(key) == len(prefix) + len(group):
                out.append(key[len(prefix) :])
    return out


def store_secret(index: Index) -> bytes:
    """The store's salt secret, created (random, once per store) on first use.

    Two processes creating it at once agree: the put does not overwrite, and both
    read the value that won.

    Raises:
        StoreError: the recorded secret has the wrong size (a damaged index).
    """
    meta = index.db["meta"]
    raw = index.read(lambda txn: txn.get(SECRET_KEY, db=meta))
    if raw is None:

        def create(txn):
            txn.put(
                SECRET_KEY, secrets.token_bytes(SECRET_BYTES), db=meta, overwrite=False
            )
            return txn.get(SECRET_KEY, db=meta)

        raw = index.write(create)
    raw = bytes(raw)
    if len(raw) != SECRET_BYTES:
        raise StoreError(
            f"{index.path}: the salt secret has {len(raw)} bytes, not {SECRET_BYTES}"
        )
    return raw


def tree_roots(nodes: Mapping[bytes, Tuple[bytes, int]]) -> Dict[bytes, bytes]:
    """The root each node's tree hangs from.

    Args:
        nodes: ``hash -> (parent, start)`` of one namespace's nodes.

    Returns:
        ``hash -> root``: the parent of the node's first ancestor starting at token 0
        (the namespace's root or a salted one). Nodes cut off from any root (a parent
        missing from ``nodes``, a loop) are left out.
    """
    out: Dict[bytes, bytes] = {}
    for h in nodes:
        chain = []
        x, root = h, None
        while x in nodes and x not in out and len(chain) <= len(nodes):
            chain.append(x)
            parent, start = nodes[x]
            if start == 0:
                root = parent
                break
            x = parent
        else:
            root = out.get(x)
        if root is not None:
            out.update(dict.fromkeys(chain, root))
    return out


def make_tree_room(
    index: Index,
    txn,
    ns: bytes,
    root: bytes,
    max_bytes: int,
    incoming: int,
    *,
    keep=frozenset(),
    group: Optional[bytes] = None,
) -> List[Tuple[Tuple[bytes, bytes], object]]:
    """Inside a write transaction: delete least recently used unpinned leaves of the
    trees counting against ``group`` (the tree hanging from ``root`` and, for a
    tenant, its narrowed trees; never another tenant's) until their node files and
    ``incoming`` bytes fit ``max_bytes``: a per-salt disk quota.

    Args:
        index: The store's index.
        txn: The write transaction (of the commit adding ``incoming`` bytes).
        ns: The namespace.
        root: The salted tree's root hash (recorded as ``group``'s).
        max_bytes: The quota.
        incoming: Bytes the transaction is about to add to the tree.
        keep: ``(ns, hash)`` of nodes that must stay (the new nodes' parents); their
            ancestors stay too.
        group: The quota's root (:func:`tree_of`); None: ``root``.

    Returns:
        ``((ns, hash), record)`` of the deleted nodes, children before parents: their
        files are unlinked after the commit.
    """
    group = root if group is None else group
    join_group(index, txn, ns, group, root)
    nodes: Dict[Tuple[bytes, bytes], DiskNode] = {}
    todo = []
    for tree in group_roots(index, txn, ns, group):
        if tree in (root, group) or index.children(ns, tree, txn):
            todo.append(tree)
        else:  # an emptied narrowed tree: forget it
            txn.delete(_group_key(ns, group, tree), db=index.db["meta"])
    while todo:
        parent = todo.pop()
        for h in index.children(ns, parent, txn):
            try:
                rec = index.get_node(ns, h, txn)
            except CorruptRecord:
                continue  # a fetch or verify reports it
            if rec is None or (ns, h) in nodes:
                continue
            pinned = rec.pinned or (ns, h) in keep
            nodes[ns, h] = DiskNode(
                index.atime(txn, ns, h), rec.total_bytes, (ns, rec.parent), pinned
            )
            todo.append(h)
    excess = sum(n.nbytes for n in nodes.values()) + incoming - max_bytes
    if excess <= 0:
        return []
    gone = []
    for key in disk_victims(nodes, excess):  # children before their parents
        if not index.has_children(txn, *key):
            gone.append((key, index.delete_node(txn, *key)))
    return gone


def _type(value) -> str:
    return "null" if value is None else type(value).__name__
