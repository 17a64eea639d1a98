"""What mlx-lm's RAM prompt cache holds of a prompt, found in time linear in it.

``LRUPromptCache.fetch_nearest_cache`` asks its ``PromptTrie.search`` for the
shortest cached prompt extending the one asked for, by a depth-first walk that
copies the path at every step: O(depth²) per branch. A prompt that leaves the trie
early (a returning user whose turns RAM no longer holds, beside others' prompts of
thousands of tokens) took 0.1-0.2 s of Python under the GIL per search on an H200
host, while the generation thread waited for the GIL. kvstore serve asks what RAM
holds of each request twice besides the lookup itself (on its arrival and in its
prefetch), and once more for each save it defers, so here the same answers
(:func:`nearest`, :func:`match`) come from one walk down the prompt and a
breadth-first look for the nearest cached prompt below where it leaves the trie.

The walk reads mlx-lm's trie (nested dicts, a cached prompt's value under
``"__value__"``); :func:`walkable` checks that shape, and where it does not hold
:func:`nearest` asks mlx-lm's own search.
"""

import copy
from typing import Any, List, NamedTuple, Optional, Tuple

VALUE = "__value__"  # PromptTrie's key of a cached prompt's value


class Match(NamedTuple):
    """A prompt against the trie, as ``PromptTrie.search`` reports it."""

    exact: bool  # the prompt itself is cached
    shorter: int  # tokens of the longest cached prompt that prefixes it (0: none)
    value: Optional[Any]  # the cached value of the prompt itself, or of that one
    common: int  # tokens it shares with the trie's paths
    longer: Optional[Any]  # the nearest cached value below ``common``, if any
    longer_len: int  # that value's prompt length


class Nearest(NamedTuple):
    """The cached prompt ``LRUPromptCache.fetch_nearest_cache`` copies for a prompt."""

    entry: Optional[Any]  # its LRU entry (``.prompt_cache``), None: nothing
    held: int  # tokens of the prompt it gives
    length: int  # its own prompt's tokens (trimmed to ``held`` when longer)


def walkable(trie: Any) -> bool:
    """Whether ``trie`` (an ``LRUPromptCache._trie``) is the nested-dict
    ``PromptTrie`` this module walks."""
    return isinstance(getattr(trie, "_trie", None), dict)


def match(trie: Any, model: Any, tokens: List[int]) -> Match:
    """``tokens`` against ``trie`` as ``PromptTrie.search`` reports it: walked where
    ``trie`` is :func:`walkable`, else by its own ``search``."""
    if walkable(trie):
        return _walked(trie, model, tokens)
    return _searched(trie, model, tokens)


def nearest(trie: Any, model: Any, tokens: List[int], can_trim) -> Nearest:
    """What ``LRUPromptCache.fetch_nearest_cache`` (mlx-lm 0.31-0.32) would copy
    for ``tokens`` (:func:`match`). ``can_trim``: mlx-lm's
    ``can_trim_prompt_cache``."""
    m = match(trie, model, tokens)
    if m.exact:
        return Nearest(m.value, len(tokens), len(tokens))
    if m.longer is not None and m.common > m.shorter:
        if can_trim(m.longer.prompt_cache):
            return Nearest(m.longer, min(len(tokens) - 1, m.common), m.longer_len)
    if m.shorter > 0:
        return Nearest(m.value, m.shorter, m.shorter)
    return Nearest(None, 0, 0)


def fetch_nearest(
    trie: Any, model: Any, tokens: List[int], can_trim, trim
) -> Tuple[Optional[List[Any]], List[int]]:
    """``LRUPromptCache.fetch_nearest_cache``: a copy of the nearest cached prompt's
    cache, trimmed to what ``tokens`` share with it, and the tokens left to compute.
    ``can_trim``, ``trim``: mlx-lm's ``can_trim_prompt_cache`` and
    ``trim_prompt_cache``."""
    found = nearest(trie, model, tokens, can_trim)
    if found.entry is None:
        return None, tokens
    cache = copy.deepcopy(found.entry.prompt_cache)
    if found.length > found.held:
        trim(cache, found.length - found.held)
    return cache, tokens[found.held :]


def _walked(trie: Any, model: Any, tokens: List[int]) -> Match:
    """``tokens`` against a :func:`walkable` ``trie``: one walk down the prompt."""
    current = trie._trie.get(model)
    if current is None:
        return Match(False, 0, None, 0, None, 0)
    if not tokens:
        return Match(VALUE in current, 0, current.get(VALUE), 0, None, 0)
    index, last, value = 0, -1, None
    for tok in tokens:
        child = current.get(tok)
        if child is None:
            break
        current = child
        if VALUE in current:
            last, value = index, current[VALUE]
        index += 1
    if last == len(tokens) - 1:
        return Match(True, len(tokens), value, index, None, 0)
    shorter = last + 1 if last > 0 else 0
    longer, depth = _nearest_value(current) if index > 0 else (None, 0)
    return Match(False, shorter, value, index, longer, index + depth)


def _searched(trie: Any, model: Any, tokens: List[int]) -> Match:
    """``tokens`` against ``trie`` by its own ``search`` (and ``get``)."""
    found = trie.search(model, tokens)
    if found.exact is not None:
        return Match(True, len(tokens), trie.get(found.model, found.exact), 0, None, 0)
    shorter = len(found.shorter) if found.shorter is not None else 0
    value = trie.get(found.model, found.shorter) if shorter else None
    longer = trie.get(found.model, found.longer) if found.longer is not None else None
    n = len(found.longer) if found.longer is not None else 0
    return Match(False, shorter, value, found.common_prefix, longer, n)


def _nearest_value(node: dict) -> Tuple[Optional[Any], int]:
    """The cached value nearest below ``node`` (breadth first) and its depth."""
    level, depth = [node], 0
    while level:
        for n in level:
            if VALUE in n:
                return n[VALUE], depth
        level = [c for n in level for k, c in n.items() if k != VALUE]
        depth += 1
    return None, 0
