"""Token validation, chunk spans and the prefix hash chain.

The chain is ``h0 = xxh3_128(namespace)``, ``h_i = xxh3_128(h_{i-1} || tokens_i)``
with tokens as little-endian int32, so a node's hash names its whole prefix and is
identical across processes and machines.
"""

import array
import sys
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from typing import Iterable, List, Sequence, Tuple

import numpy as np
import xxhash

HASH_BYTES = 16
MAX_TOKEN = 2**31 - 1


def as_token_array(tokens, *, what: str = "tokens") -> np.ndarray:
    """Validate ``tokens`` and return them as a little-endian int32 numpy array.

    Args:
        tokens: A list, tuple, numpy or mlx array of non-negative integer token ids.
        what: Name used in error messages.

    Raises:
        TypeError: ``tokens`` is not a sequence of ints.
        ValueError: a token id is negative or does not fit in int32.
    """
    if isinstance(tokens, (str, bytes, Mapping, AbstractSet)) or not hasattr(
        tokens, "__len__"
    ):
        raise TypeError(f"{what} must be a list of ints, got {type(tokens).__name__}")
    if not isinstance(tokens, (list, tuple)):
        tokens = _array_to_list(tokens, what)
    try:
        # array.array checks types and the C int range in one fast pass.
        arr = np.frombuffer(array.array("i", tokens), dtype=np.int32)
    except (TypeError, OverflowError):
        for i, t in enumerate(tokens):
            try:
                array.array("i", [t])
            except TypeError:
                raise TypeError(
                    f"{what}[{i}] is {type(t).__name__} {t!r}, expected int"
                ) from None
            except OverflowError:
                raise ValueError(f"{what}[{i}] = {t} does not fit in int32") from None
        raise
    if arr.size and arr.min() < 0:
        bad = int(np.flatnonzero(arr < 0)[0])
        raise ValueError(f"{what}[{bad}] = {arr[bad]} is negative")
    if sys.byteorder != "little":
        arr = arr.astype("<i4")
    return arr


def _array_to_list(tokens, what: str) -> list:
    if hasattr(tokens, "dtype") and hasattr(tokens, "tolist"):
        if getattr(tokens, "ndim", 1) != 1:
            raise TypeError(f"{what} must be one-dimensional, got shape {tokens.shape}")
        kind = str(tokens.dtype)
        if "int" not in kind:
            raise TypeError(f"{what} must hold integers, got dtype {kind}")
        return tokens.tolist()
    return list(tokens)


def split_spans(
    start: int, end: int, chunk_tokens: int, boundaries: Iterable[int] = ()
) -> List[Tuple[int, int]]:
    """Split ``[start, end)`` into node spans of at most ``chunk_tokens`` tokens.

    A boundary (for example the end of a system prompt) always ends a span, and
    chunking restarts after it, so the same message produces the same nodes
    whatever follows it.
    """
    cuts = sorted({b for b in boundaries if start < b < end})
    spans = []
    for seg_start, seg_end in zip([start] + cuts, cuts + [end]):
        for s in range(seg_start, seg_end, chunk_tokens):
            spans.append((s, min(s + chunk_tokens, seg_end)))
    return spans


def root_hash(namespace: bytes) -> bytes:
    """The hash every chain starts from: ``xxh3_128(namespace)``."""
    return xxhash.xxh3_128_digest(namespace)


def chain_hash(parent: bytes, tokens: np.ndarray) -> bytes:
    """``xxh3_128(parent || tokens)`` with tokens as little-endian int32 bytes."""
    h = xxhash.xxh3_128(parent)
    h.update(memoryview(np.ascontiguousarray(tokens, dtype="<i4")))
    return h.digest()


def chain_hashes(
    parent: bytes, tokens: np.ndarray, spans: Sequence[Tuple[int, int]]
) -> List[bytes]:
    """Hashes of consecutive spans, each chained on the previous one."""
    out = []
    for s, e in spans:
        parent = chain_hash(parent, tokens[s:e])
        out.append(parent)
    return out


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two int32 arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n
