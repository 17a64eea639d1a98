"""What mlx-lm's RAM prompt cache holds of a prompt, found in time linear in it.

``LRUPromptCache.fetch_nearest_cache`` asks its ``PromptTrie.search`` for the
shortest cached prompt extending the one asked for, by a depth-first walk that
copies the path at every step: O(depth²) per branch. A prompt that leaves the trie
early (a returning user whose turns RAM no longer holds, beside others' prompts of
thousands of tokens) took 0.1-0.2 s of Python under the GIL per search on an H200
host, while the generation thread waited for the GIL. kvstore serve asks what RAM
holds of each request twice besides the lookup itself (on its arrival and in its
prefetch), so here the same answer comes from one walk down the prompt and a
breadth-first look for the nearest cached prompt below where it leaves the trie.

The walk reads mlx-lm's trie (nested dicts, a cached prompt's value under
``"__value__"``); :func:`walkable` checks that shape, and callers fall back to
mlx-lm's own search where it does not hold.
"""

import copy
from typing import Any, List, NamedTuple, Optional, Tuple

VALUE = "__value__"  # PromptTrie's key of a cached prompt's value


class Match(NamedTuple):
    """A prompt against the trie, as ``PromptTrie.search`` reports it."""

    exact: bool  # the prompt itself is cached
    shorter: int  # tokens of the longest cached prompt that prefixes it (0: none)
    common: int  # tokens it shares with the trie's paths
    longer: Optional[Any]  # the nearest cached value below ``common``, if any
    longer_len: int  # that value's prompt length


def walkable(trie: Any) -> bool:
    """Whether ``trie`` (an ``LRUPromptCache._trie``) is the nested-dict
    ``PromptTrie`` this module walks."""
    return isinstance(getattr(trie, "_trie", None), dict)


def match(trie: Any, model: Any, tokens: List[int]) -> Match:
    """``tokens`` against ``trie`` (see :func:`walkable`) for ``model``."""
    current = trie._trie.get(model)
    if current is None:
        return Match(False, 0, 0, None, 0)
    if not tokens:
        return Match(VALUE in current, 0, 0, None, 0)
    index, last = 0, -1
    for tok in tokens:
        child = current.get(tok)
        if child is None:
            break
        current = child
        if VALUE in current:
            last = index
        index += 1
    if last == len(tokens) - 1:
        return Match(True, len(tokens), index, None, 0)
    shorter = last + 1 if last > 0 else 0
    longer, depth = _nearest_value(current) if index > 0 else (None, 0)
    return Match(False, shorter, index, longer, index + depth)


def held(trie: Any, model: Any, tokens: List[int], can_trim) -> int:
    """Tokens of ``tokens`` that ``LRUPromptCache.fetch_nearest_cache`` would give
    now; ``can_trim``: mlx-lm's ``can_prompt_cache_trim``."""
    m = match(trie, model, tokens)
    if m.exact:
        return len(tokens)
    if m.longer is not None and m.common > m.shorter:
        if can_trim(m.longer.prompt_cache):
            return min(len(tokens) - 1, m.common)
    return m.shorter


def fetch_nearest(
    trie: Any, model: Any, tokens: List[int], can_trim, trim
) -> Tuple[Optional[List[Any]], List[int]]:
    """``LRUPromptCache.fetch_nearest_cache`` (mlx-lm 0.31-0.32): a copy of the
    nearest cached prompt's cache, trimmed to what ``tokens`` share with it, and the
    tokens left to compute. ``can_trim``, ``trim``: mlx-lm's
    ``can_trim_prompt_cache`` and ``trim_prompt_cache``."""
    m = match(trie, model, tokens)
    if m.exact:
        return copy.deepcopy(trie.get(model, tokens).prompt_cache), []
    if m.longer is not None and m.common > m.shorter:
        if can_trim(m.longer.prompt_cache):
            cache = copy.deepcopy(m.longer.prompt_cache)
            prefix = min(len(tokens) - 1, m.common)
            trim(cache, m.longer_len - prefix)
            return cache, tokens[prefix:]
    if m.shorter > 0:
        entry = trie.get(model, tokens[: m.shorter])
        return copy.deepcopy(entry.prompt_cache), tokens[m.shorter :]
    return None, tokens


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
