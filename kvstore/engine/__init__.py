"""The read and write paths that :class:`kvstore.KVStore` composes.

The read path (:mod:`.restore`, with :mod:`.assemble` and :mod:`.loadpath` for the
destination arrays and :mod:`.payoff` for restore-or-recompute), the write path
(:mod:`.saving`, run on :mod:`.writer`'s thread), removal of node files
(:mod:`.removal`) and the RAM tier (:mod:`.ram`).
"""
