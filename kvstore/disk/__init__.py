"""What a store holds on disk and the rules every writer of it follows.

The index (:mod:`.index`; its checks at open, :mod:`.storecheck` and :mod:`.mdbfile`;
the spare room, :mod:`.spare`), the node files
(:mod:`.blobs`) and how a group of them is published durably (:mod:`.publish`),
chunking and the hash chain (:mod:`.chunking`), namespaces and cache layouts
(:mod:`.namespace`, :mod:`.adapters`), salted trees (:mod:`.salts`), disk-budget
reservations (:mod:`.reservations`) and the eviction order (:mod:`.policy`). The read
and write paths (:mod:`kvstore.engine`) and the maintenance commands
(:mod:`kvstore.maintenance`) both build on this layer; it imports only
:mod:`kvstore.platform`.
"""
