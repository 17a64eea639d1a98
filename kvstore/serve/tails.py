"""What the store adds to a request's RAM copy, for ``kvstore serve``'s lookups and
prefetches (:mod:`kvstore.serve.prompt_cache`): the stored nodes past the copy (a
:class:`~kvstore.engine.tail.Tail`), a restore joined to another request's, the RAM
copy extended by a tail, and whether a prefetch's result still fits the lookup.
"""

import logging
from typing import Any, List, Optional, Tuple

from ..engine.tail import Tail
from .prefetch import Prefetched

log = logging.getLogger("kvstore.server")


def prefetched_tail(pre: Optional[Prefetched], model, tokens, ram_n: int, salt):
    """``(tail or None, True)`` when the prefetch ``pre`` of this very request
    (model, salt, tokens) tells what the store adds to ``ram_n`` RAM tokens;
    ``(None, False)`` when it cannot (none, or RAM lost tokens since)."""
    if pre is None or pre.model_key != model or pre.salt != salt:
        return None, False
    if pre.tokens != list(tokens):
        return None, False
    tail = pre.tail
    if tail is None:
        return None, ram_n >= pre.held  # nothing past what RAM held, or not worth it
    if tail.start > ram_n:
        return None, False  # RAM lost the tokens the tail goes after
    return (tail if tail.end > ram_n else None), True


def stored_tail(store, tokens: List[int], ram_n: int, salt, weigh: bool = True):
    """What the store holds of ``tokens`` past a RAM copy of ``ram_n`` of them (a
    :class:`kvstore.engine.tail.Tail`: only the nodes past the copy are read), or None
    when it holds no more or (``weigh``) prefilling the difference is cheaper (by
    the measured rates)."""
    # The index alone tells whether the store holds more (a remote tier may).
    if store.remote is None and store.lookup(tokens, salt=salt) <= ram_n:
        return None
    tail = store.fetch_beyond(tokens, ram_n, salt=salt, weigh=weigh)
    return tail if tail is not None and tail.end > ram_n else None


def joined_tail(store, tokens: List[int], head, common: int, salt, weigh: bool):
    """A whole-prefix restore of ``tokens`` from ``head`` (another request's restore,
    not yet used, sharing their first ``common`` tokens) and the stored nodes past
    those: fresh cache objects (the requests' generate loops write to their own)."""
    rest = store.fetch_beyond(tokens, common, salt=salt, weigh=weigh)
    if rest is None or rest.end <= common:
        rest = Tail(head.cache, common, common)  # nothing more: the shared part only
    cache = store.join_tail(head.cache, rest, query=len(tokens))
    return Tail(cache, 0, rest.end)


def extended(
    store, tokens: List[int], cache, ram_n: int, tail, salt
) -> Optional[Tuple[List[Any], int, int]]:
    """The RAM copy ``cache`` (``ram_n`` tokens) with ``tail`` appended:
    ``(cache, tokens held, tokens of them taken from the RAM copy)``."""
    if tail.start == 0:
        return tail.cache, tail.end, 0
    try:
        return store.join_tail(cache, tail, query=len(tokens)), tail.end, tail.start
    except (TypeError, ValueError) as e:  # LayoutMismatch: a RAM copy of other layers
        log.info("kvstore: RAM copy not extended (%s); restoring the prefix", e)
    whole, n = store.fetch(tokens, salt=salt)
    return (whole, n, 0) if n > ram_n else None
