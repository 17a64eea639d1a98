"""Eviction order as data: which entries go first, in RAM and on disk. No I/O here."""

from typing import Iterable, List, Sequence, Tuple

from .index import KINDS

# mlx-lm's tier order: assistant turns go first, then user turns, system prompts last.
RAM_ORDER: Tuple[Tuple[bool, str], ...] = tuple(
    (pinned, kind) for pinned in (False, True) for kind in KINDS
)

KIND_RANK = {kind: rank for rank, kind in enumerate(KINDS)}


def stronger_kind(a: str, b: str) -> str:
    """The kind that is evicted later (system > user > assistant)."""
    return a if KIND_RANK[a] >= KIND_RANK[b] else b


def disk_victims(
    leaves: Iterable[Tuple[float, int, object]], excess: int
) -> List[object]:
    """Least recently used leaves whose sizes add up to at least ``excess`` bytes.

    Args:
        leaves: ``(last access time, bytes, key)`` of unpinned leaf nodes.
        excess: How many bytes must go.
    """
    victims, freed = [], 0
    for atime, nbytes, key in sorted(leaves, key=lambda leaf: leaf[0]):
        if freed >= excess:
            break
        victims.append(key)
        freed += nbytes
    return victims
