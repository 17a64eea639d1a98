"""Store maintenance that needs no model: statistics, the prefix tree, verification and
repair, garbage collection, eviction down to a byte budget, pins.

Every public function takes the store directory, opens its index without creating one
(a directory that is not a store raises :class:`~kvstore.disk.index.StoreError`) and closes
it before returning: nothing here keeps an LMDB environment a ``fork()`` could carry
into a child. Namespaces and nodes are named by hex ids or unambiguous prefixes of at
least 8 hex digits.

:class:`kvstore.KVStore` uses the deletion and eviction helpers of this package too, so
their rules live in one place (:mod:`.common`):

* **Delete, then unlink.** Nodes leave the index in one write transaction
  (:func:`delete_subtree`, :func:`evict_to_budget`); their files are unlinked or
  quarantined afterwards inside a second write transaction that re-checks that each node
  is still absent (:func:`release_files`). A node another process re-added in between
  keeps its file; a crash in between leaves orphan files, which :func:`gc` removes.
* **Leaf-first LRU eviction** (:func:`evict_to_budget`): least recently used leaves go
  first (:func:`kvstore.disk.policy.disk_victims`); a parent whose last child went competes
  by its own access time, so no descendant is ever orphaned.
* **Reserve, then write.** A ``KVStore`` save reserves its files' bytes in the index
  and evicts for them in one write transaction (:func:`reserve_room`) before writing
  them, so files on disk, not only indexed bytes, stay within the disk budget under
  concurrent writers (:mod:`kvstore.disk.reservations`).

Submodules: :mod:`.common` (opening, budget, deletion, eviction, names), :mod:`.stats`
(:func:`store_stats`, :func:`list_tree`), :mod:`.verify` (:func:`verify`) and :mod:`.gc`
(:func:`gc`, :func:`set_pinned`, :func:`pin_path`).
"""

from .common import (
    DISK_BUDGET_KEY,
    Eviction,
    Released,
    delete_subtree,
    disk_budget,
    disk_nodes,
    evict_to_budget,
    make_room,
    read_disk_budget,
    release_files,
    reserve_room,
    set_disk_budget,
    write_disk_budget,
)
from .gc import gc, pin_path, set_pinned
from .stats import list_tree, store_stats
from .verify import INFO_KINDS, verify

__all__ = [
    "DISK_BUDGET_KEY",
    "Eviction",
    "INFO_KINDS",
    "Released",
    "delete_subtree",
    "disk_budget",
    "disk_nodes",
    "evict_to_budget",
    "gc",
    "list_tree",
    "make_room",
    "pin_path",
    "read_disk_budget",
    "release_files",
    "reserve_room",
    "set_disk_budget",
    "set_pinned",
    "store_stats",
    "verify",
    "write_disk_budget",
]
