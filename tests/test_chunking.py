"""Unit tests for kvstore.disk.chunking: token validation, spans and the prefix hash chain."""

import struct

import mlx.core as mx
import numpy as np
import pytest
import xxhash

from kvstore.disk.chunking import (
    HASH_BYTES,
    MAX_TOKEN,
    as_token_array,
    chain_hash,
    chain_hashes,
    common_prefix,
    root_hash,
    split_spans,
)

# ---------------------------------------------------------------------------
# as_token_array: accepted inputs
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens",
    [
        [5, 0, 7, MAX_TOKEN],
        (5, 0, 7, MAX_TOKEN),
        np.array([5, 0, 7, MAX_TOKEN], dtype=np.int64),
        np.array([5, 0, 7, MAX_TOKEN], dtype=np.int32),
        np.array([5, 0, 7, MAX_TOKEN], dtype=np.uint32),
        [np.int64(5), np.uint8(0), np.int16(7), np.int32(MAX_TOKEN)],
        mx.array([5, 0, 7, MAX_TOKEN], dtype=mx.int32),
        mx.array([5, 0, 7, MAX_TOKEN], dtype=mx.uint32),
        mx.array([5, 0, 7, MAX_TOKEN], dtype=mx.int64),
    ],
    ids=[
        "list",
        "tuple",
        "np-int64",
        "np-int32",
        "np-uint32",
        "list-of-np-scalars",
        "mx-int32",
        "mx-uint32",
        "mx-int64",
    ],
)
def test_as_token_array_accepts(tokens):
    arr = as_token_array(tokens)
    assert isinstance(arr, np.ndarray)
    assert arr.dtype == np.dtype("<i4")
    assert arr.ndim == 1
    assert arr.tolist() == [5, 0, 7, MAX_TOKEN]


def test_as_token_array_small_numpy_dtypes():
    assert as_token_array(np.array([1, 255], dtype=np.uint8)).tolist() == [1, 255]
    assert as_token_array(np.array([3, 30000], dtype=np.int16)).tolist() == [3, 30000]


def test_as_token_array_empty():
    for empty in ([], (), np.array([], dtype=np.int64)):
        arr = as_token_array(empty)
        assert arr.dtype == np.dtype("<i4")
        assert arr.shape == (0,)


def test_as_token_array_does_not_alias_numpy_input():
    src = np.array([1, 2, 3], dtype=np.int32)
    arr = as_token_array(src)
    src[0] = 99
    assert arr.tolist() == [1, 2, 3]


# ---------------------------------------------------------------------------
# as_token_array: rejected inputs, with the index of the culprit in the message
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens, exc, index",
    [
        ([1, 2, "3"], TypeError, 2),
        ([1.5, 2], TypeError, 0),
        ([1, 2.0], TypeError, 1),
        ([1, np.float32(2)], TypeError, 1),
        ([0, 1, None], TypeError, 2),
        ([[1, 2], 3], TypeError, 0),
        ([1, [2]], TypeError, 1),
        ((4, 5, b"x"), TypeError, 2),
        ([1, 2, 3, -1], ValueError, 3),
        ([-(2**31)], ValueError, 0),
        ([0, MAX_TOKEN + 1], ValueError, 1),
        ([0, 1, 2**40], ValueError, 2),
        ([0, 2**64], ValueError, 1),
        ([7, -(2**31) - 1], ValueError, 1),
        (np.array([3, 4, -2], dtype=np.int64), ValueError, 2),
        (np.array([3, 2**40], dtype=np.int64), ValueError, 1),
        (np.array([0, 2**32 - 1], dtype=np.uint32), ValueError, 1),
        (mx.array([9, -5], dtype=mx.int32), ValueError, 1),
        (mx.array([0, 0, 2**31], dtype=mx.uint32), ValueError, 2),
    ],
)
def test_as_token_array_rejects_bad_element(tokens, exc, index):
    with pytest.raises(exc) as ei:
        as_token_array(tokens)
    assert f"tokens[{index}]" in str(ei.value)


def test_as_token_array_error_uses_what():
    with pytest.raises(TypeError, match=r"prompt\[1\]"):
        as_token_array([1, "a"], what="prompt")
    with pytest.raises(ValueError, match=r"prompt\[0\]"):
        as_token_array([-3], what="prompt")


@pytest.mark.parametrize(
    "tokens",
    [
        "1 2 3",
        "",
        b"\x01\x02",
        None,
        12,
        3.5,
        (i for i in range(3)),
        np.array([1.0, 2.0]),
        np.array([True, False]),
        np.array([[1, 2], [3, 4]]),
        np.array(5),
        mx.array([1.0, 2.0]),
        mx.array([[1, 2], [3, 4]]),
    ],
    ids=[
        "str",
        "empty-str",
        "bytes",
        "None",
        "int",
        "float",
        "generator",
        "np-float",
        "np-bool",
        "np-2d",
        "np-0d",
        "mx-float",
        "mx-2d",
    ],
)
def test_as_token_array_rejects_non_token_sequences(tokens):
    with pytest.raises(TypeError):
        as_token_array(tokens)


def test_as_token_array_names_real_culprit_after_bool():
    with pytest.raises(TypeError, match=r"tokens\[1\]"):
        as_token_array([True, 2.5])


def test_as_token_array_timedelta_element_is_type_error():
    with pytest.raises(TypeError):
        as_token_array([1, np.timedelta64(1)])


# ---------------------------------------------------------------------------
# split_spans
# ---------------------------------------------------------------------------


def test_split_spans_basic():
    assert split_spans(0, 10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert split_spans(0, 8, 4) == [(0, 4), (4, 8)]
    assert split_spans(0, 3, 4) == [(0, 3)]
    assert split_spans(0, 5, 1) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    assert split_spans(0, 0, 4) == []
    assert split_spans(7, 7, 4) == []


def test_split_spans_nonzero_start():
    assert split_spans(5, 14, 4) == [(5, 9), (9, 13), (13, 14)]
    assert split_spans(256, 600, 256) == [(256, 512), (512, 600)]


def test_split_spans_boundaries_restart_chunking():
    assert split_spans(0, 10, 4, [3]) == [(0, 3), (3, 7), (7, 10)]
    assert split_spans(0, 20, 8, [5, 9]) == [(0, 5), (5, 9), (9, 17), (17, 20)]
    # unsorted and duplicated boundaries
    assert split_spans(0, 10, 4, [7, 3, 3]) == [(0, 3), (3, 7), (7, 10)]
    # a boundary that falls on a chunk edge changes nothing
    assert split_spans(0, 12, 4, [4, 8]) == [(0, 4), (4, 8), (8, 12)]


def test_split_spans_boundaries_outside_range_ignored():
    plain = split_spans(2, 12, 4)
    assert split_spans(2, 12, 4, [-5, 0, 1, 2, 12, 13, 100]) == plain
    assert plain == [(2, 6), (6, 10), (10, 12)]


def test_split_spans_prefix_stable_whatever_follows():
    # The same message (ending at boundary 6) yields the same nodes whatever follows it.
    short = split_spans(0, 6, 4, [6])
    for end in (7, 10, 33):
        assert split_spans(0, end, 4, [6])[: len(short)] == short
    assert short == [(0, 4), (4, 6)]


def test_split_spans_properties_random():
    rng = np.random.default_rng(0)
    for _ in range(200):
        start = int(rng.integers(0, 50))
        end = start + int(rng.integers(0, 200))
        chunk = int(rng.integers(1, 40))
        bounds = rng.integers(-10, end + 10, size=int(rng.integers(0, 6))).tolist()
        spans = split_spans(start, end, chunk, bounds)
        inside = sorted({b for b in bounds if start < b < end})
        # spans tile [start, end) in order, none empty, none longer than chunk
        pos = start
        for s, e in spans:
            assert s == pos and s < e <= s + chunk
            pos = e
        assert pos == end
        ends = {e for _, e in spans}
        starts = {s for s, _ in spans}
        for b in inside:
            assert b in ends and b in starts
        # each segment between cuts is chunked from its own start
        cuts = [start] + inside + [end]
        expected = []
        for a, b in zip(cuts, cuts[1:]):
            expected += [(s, min(s + chunk, b)) for s in range(a, b, chunk)]
        assert spans == expected


# ---------------------------------------------------------------------------
# hashes
# ---------------------------------------------------------------------------


def _reference_chain(parent: bytes, tokens) -> bytes:
    """xxh3_128(parent || tokens as little-endian int32), computed without numpy."""
    return xxhash.xxh3_128(parent + struct.pack(f"<{len(tokens)}i", *tokens)).digest()


def test_root_hash_is_xxh3_128_of_namespace():
    ns = bytes(range(16))
    assert root_hash(ns) == xxhash.xxh3_128(ns).digest()
    assert len(root_hash(ns)) == HASH_BYTES
    assert root_hash(ns) != root_hash(bytes(16))


def test_chain_hash_matches_reference_encoding():
    parent = root_hash(b"namespace-0123456")
    for tokens in ([1], [1, 2, 3], [0, MAX_TOKEN, 256, 65536], list(range(300))):
        got = chain_hash(parent, np.array(tokens, dtype=np.int32))
        assert got == _reference_chain(parent, tokens)
        assert len(got) == HASH_BYTES


# xxh3_128(bytes(range(16)) || <i4 [1, 2, 3, 256, 2**31 - 1]), computed once with xxhash.
PINNED_CHAIN_HEX = "9103fa488585b26501ef14d7ab1a14d3"


def test_chain_hash_pinned_value():
    # Pinned literal: any change of hash function, byte order or token width fails here.
    parent = bytes(range(16))
    tokens = np.array([1, 2, 3, 256, MAX_TOKEN], dtype=np.int32)
    expected = _reference_chain(parent, [1, 2, 3, 256, MAX_TOKEN])
    assert chain_hash(parent, tokens) == expected
    assert expected.hex() == PINNED_CHAIN_HEX


def test_chain_hash_input_dtype_and_layout_do_not_matter():
    parent = root_hash(b"ns")
    base = np.arange(20, dtype=np.int32) * 1000
    ref = chain_hash(parent, base[::2].copy())
    assert chain_hash(parent, base[::2]) == ref  # non-contiguous view
    assert chain_hash(parent, base[::2].astype(np.int64)) == ref
    assert chain_hash(parent, base[::2].astype(">i4")) == ref  # big-endian input
    assert chain_hash(parent, as_token_array(base[::2].tolist())) == ref


def test_chain_hash_is_deterministic_and_order_sensitive():
    parent = root_hash(b"ns")
    a = np.array([10, 20, 30], dtype=np.int32)
    assert chain_hash(parent, a) == chain_hash(parent, a.copy())
    assert chain_hash(parent, a) != chain_hash(parent, a[::-1].copy())
    assert chain_hash(parent, np.array([1, 2], np.int32)) != chain_hash(
        parent, np.array([2, 1], np.int32)
    )
    # the parent is part of the hash
    assert chain_hash(parent, a) != chain_hash(root_hash(b"other"), a)
    # token width is part of the encoding: [1, 0] differs from [1]
    assert chain_hash(parent, np.array([1, 0], np.int32)) != chain_hash(
        parent, np.array([1], np.int32)
    )


def test_chain_hashes_chain_on_previous():
    parent = root_hash(b"ns")
    tokens = np.arange(10, dtype=np.int32) + 100
    spans = split_spans(0, 10, 4)
    hashes = chain_hashes(parent, tokens, spans)
    assert len(hashes) == 3
    h = parent
    for (s, e), got in zip(spans, hashes):
        h = _reference_chain(h, tokens[s:e].tolist())
        assert got == h
    assert len(set(hashes)) == 3
    assert chain_hashes(parent, tokens, []) == []


def test_chain_hashes_name_the_whole_prefix():
    parent = root_hash(b"ns")
    a = np.array([1, 2, 3, 4, 5, 6, 7, 8], dtype=np.int32)
    b = a.copy()
    b[1] = 99  # differs in the first chunk only
    spans = [(0, 4), (4, 8)]
    ha, hb = chain_hashes(parent, a, spans), chain_hashes(parent, b, spans)
    assert ha[0] != hb[0]
    assert ha[1] != hb[1]  # same tokens in chunk 2, different prefix
    # a shared prefix gives shared hashes
    c = a.copy()
    c[6] = 0
    hc = chain_hashes(parent, c, spans)
    assert hc[0] == ha[0] and hc[1] != ha[1]


# ---------------------------------------------------------------------------
# common_prefix
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "a, b, n",
    [
        ([], [], 0),
        ([1, 2], [], 0),
        ([1, 2, 3], [1, 2, 3], 3),
        ([1, 2, 3], [1, 2], 2),
        ([1, 2], [1, 2, 3, 4], 2),
        ([5, 2, 3], [1, 2, 3], 0),
        ([1, 2, 3, 4], [1, 2, 9, 4], 2),
        ([MAX_TOKEN, 0], [MAX_TOKEN, 1], 1),
    ],
)
def test_common_prefix(a, b, n):
    got = common_prefix(np.array(a, dtype=np.int32), np.array(b, dtype=np.int32))
    assert got == n
    assert isinstance(got, int)


def test_common_prefix_random_against_python():
    rng = np.random.default_rng(1)
    for _ in range(200):
        a = rng.integers(0, 3, size=int(rng.integers(0, 30))).astype(np.int32)
        b = rng.integers(0, 3, size=int(rng.integers(0, 30))).astype(np.int32)
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        assert common_prefix(a, b) == n
