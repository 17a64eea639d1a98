"""Unit tests for kvstore.disk.blobs: chunk file writing, strict header parsing and verified reads."""

import json
import math
import os
import random
import struct

import mlx.core as mx
import numpy as np
import pytest

from kvstore.disk.blobs import (
    DATA_ALIGN,
    MAX_HEADER_BYTES,
    Blobs,
    CorruptBlob,
    TensorEntry,
    check_layout,
    file_checksum,
    parse_header,
    serialize_node,
)
from kvstore.disk.publish import write_one

NS = bytes(range(16))
H = bytes(range(100, 116))
META = {"format": "KVSTORE", "namespace": NS.hex(), "node": H.hex()}


def make_tensors(seed: int = 0, ntokens: int = 5):
    """``name -> (mlx dtype, shape, numpy data)`` in three dtypes (bf16 as uint16 bits)."""
    rng = np.random.default_rng(seed)
    f32 = rng.standard_normal((2, ntokens, 4)).astype(np.float32)
    f16 = rng.standard_normal((2, ntokens, 3)).astype(np.float16)
    bf16 = rng.integers(0, 2**16, size=(1, ntokens, 6), dtype=np.uint16)
    return {
        "0.keys": ("float32", f32.shape, f32),
        "0.values": ("float16", f16.shape, f16),
        "1.keys": ("bfloat16", bf16.shape, bf16),
    }


def expected_of(tensors):
    return {name: (dtype, tuple(shape)) for name, (dtype, shape, _) in tensors.items()}


@pytest.fixture
def blobs(tmp_path):
    return Blobs(str(tmp_path / "blobs"), str(tmp_path / "quarantine"))


@pytest.fixture
def written(blobs):
    """A valid node file on disk: ``(blobs, tensors, data, checksum, path)``."""
    tensors = make_tensors()
    data = serialize_node(tensors, META)
    write_one(blobs, NS, H, data)
    return blobs, tensors, data, file_checksum(data), blobs.path(NS, H)


def raw_file(header, data: bytes = b"", *, hlen=None) -> bytes:
    """A file with ``header`` (an object, or raw bytes) and ``data``."""
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(head) if hlen is None else hlen) + head + data


def parse(raw: bytes):
    return parse_header(raw, len(raw))


# ---------------------------------------------------------------------------
# round trip
# ---------------------------------------------------------------------------


def test_serialize_parse_round_trip():
    tensors = make_tensors()
    data = serialize_node(tensors, META)
    data_start, parsed, meta = parse(data)
    assert meta == META
    assert set(parsed) == set(tensors)
    codes = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
    for name, (dtype, shape, arr) in tensors.items():
        entry = parsed[name]
        assert entry.dtype == codes[dtype]
        assert entry.shape == tuple(shape)
        assert entry.start >= data_start
        assert data[entry.start : entry.end] == arr.tobytes()
    check_layout(parsed, expected_of(tensors))


@pytest.mark.parametrize("ntokens", range(1, 9))
def test_serialized_data_starts_aligned_and_stays_safetensors(ntokens):
    """Header padding aligns the data section; safetensors' own reader agrees."""
    from safetensors.numpy import load

    tensors = make_tensors(ntokens=ntokens)
    del tensors["1.keys"]  # bfloat16: numpy has no such dtype
    data = serialize_node(tensors, META)
    data_start, parsed, meta = parse(data)
    assert data_start % DATA_ALIGN == 0
    assert meta == META
    loaded = load(data)
    np.testing.assert_array_equal(loaded["0.keys"], tensors["0.keys"][2])
    np.testing.assert_array_equal(loaded["0.values"], tensors["0.values"][2])


def test_write_read_all_round_trip(written):
    blobs, tensors, data, checksum, path = written
    assert os.path.isfile(path)
    assert path == os.path.join(
        blobs.root, NS.hex(), H.hex()[:3], H.hex() + ".safetensors"
    )
    got, parsed, meta = blobs.read_all(
        NS, H, nbytes=len(data), checksum=checksum, expected=expected_of(tensors)
    )
    assert got == data
    assert meta == META
    for name, (_, _, arr) in tensors.items():
        assert got[parsed[name].start : parsed[name].end] == arr.tobytes()


def test_written_file_is_valid_safetensors_for_mlx(written):
    """An independent reader (mlx) sees the same values, bf16 included."""
    _, tensors, _, _, path = written
    loaded = mx.load(path)
    assert set(loaded) == set(tensors)
    np.testing.assert_array_equal(np.array(loaded["0.keys"]), tensors["0.keys"][2])
    np.testing.assert_array_equal(np.array(loaded["0.values"]), tensors["0.values"][2])
    assert loaded["1.keys"].dtype == mx.bfloat16
    np.testing.assert_array_equal(
        np.array(loaded["1.keys"].view(mx.uint16)), tensors["1.keys"][2]
    )


def test_read_staged_round_trip_reuses_staging(written, blobs):
    _, tensors, data, checksum, _ = written
    with pytest.raises(ValueError, match="staging buffer"):
        blobs.read_staged(
            NS,
            H,
            nbytes=len(data),
            checksum=checksum,
            expected=expected_of(tensors),
            staging=bytearray(10),
        )
    staging = bytearray(len(data) + 100)
    view, parsed, meta = blobs.read_staged(
        NS,
        H,
        nbytes=len(data),
        checksum=checksum,
        expected=expected_of(tensors),
        staging=staging,
    )
    assert meta == META and bytes(view) == data and len(staging) >= len(data)
    for name, (_, _, arr) in tensors.items():
        assert bytes(view[parsed[name].start : parsed[name].end]) == arr.tobytes()
    before = len(staging)
    view2, _, _ = blobs.read_staged(
        NS,
        H,
        nbytes=len(data),
        checksum=checksum,
        expected=expected_of(tensors),
        staging=staging,
    )
    assert len(staging) == before and bytes(view2) == data


@pytest.mark.parametrize("split", [1, 3])
def test_read_into_fills_the_targets(written, monkeypatch, split):
    """Data lands in the caller's buffers, also across several vectored reads."""
    import kvstore.disk.blobs as blobs_mod

    blobs, tensors, data, checksum, _ = written
    monkeypatch.setattr(blobs_mod, "_IOV_MAX", 2)  # 3 tensors x split: 2-5 calls
    got, meta = _read_into(blobs, tensors, len(data), checksum, split=split)
    assert meta == META
    assert got == {name: arr.tobytes() for name, (_, _, arr) in tensors.items()}


def test_read_into_refuses_targets_that_do_not_tile(written):
    blobs, tensors, data, checksum, _ = written
    opened = blobs.open_checked(NS, H, nbytes=len(data), expected=expected_of(tensors))
    with pytest.raises(ValueError, match="targets cover"):
        blobs.read_into(
            opened, checksum=checksum, targets=lambda parsed: [bytearray(4)]
        )
    assert opened.fd == -1  # closed by read_into, also when it raises


def test_open_checked_closes_the_file_when_the_header_is_bad(written, monkeypatch):
    blobs, tensors, data, checksum, _ = written
    opened, closed = [], []
    real_open, real_close = os.open, os.close
    monkeypatch.setattr(
        os, "open", lambda *a, **k: opened.append(real_open(*a, **k)) or opened[-1]
    )
    monkeypatch.setattr(os, "close", lambda fd: (closed.append(fd), real_close(fd)))
    wrong = dict(expected_of(tensors), **{"0.keys": ("float32", (2, 6, 4))})
    with pytest.raises(CorruptBlob):
        blobs.open_checked(NS, H, nbytes=len(data), expected=wrong)
    assert len(opened) >= 1
    assert sorted(closed) == sorted(opened)  # the file and the directories it is in


def test_read_staged_with_large_header(blobs):
    """A header longer than the first read is fetched whole."""
    tensors = make_tensors(3)
    meta = dict(META, padding="x" * 20000)
    data = serialize_node(tensors, meta)
    assert struct.unpack_from("<Q", data)[0] > 16384
    write_one(blobs, NS, H, data)
    _, _, got = blobs.read_staged(
        NS,
        H,
        nbytes=len(data),
        checksum=file_checksum(data),
        expected=expected_of(tensors),
        staging=bytearray(len(data)),
    )
    assert got == meta


# ---------------------------------------------------------------------------
# atomic writes and file management
# ---------------------------------------------------------------------------


def test_write_leaves_no_temp_files(blobs):
    for i in range(5):
        h = bytes([i]) * 16
        data = serialize_node(make_tensors(i), META)
        write_one(blobs, NS, h, data)
        write_one(blobs, NS, h, data)  # rewriting the same node is fine
    files = [os.path.join(d, f) for d, _, names in os.walk(blobs.root) for f in names]
    assert len(files) == 5
    assert all(f.endswith(".safetensors") for f in files)
    kinds = sorted(kind for kind, _ in blobs.iter_files())
    assert kinds == ["blob"] * 5


def test_write_never_replaces_a_published_file(blobs):
    """A second writer of the same node adopts the first file (its size and checksum)."""
    tensors = make_tensors(3)
    first = serialize_node(tensors, META)
    other = serialize_node(make_tensors(4), META)  # same node, other numerics
    assert len(first) == len(other) and first != other
    a = write_one(blobs, NS, H, first)
    b = write_one(blobs, NS, H, other)
    assert a.ours and not b.ours
    assert (b.nbytes, b.checksum, b.inode) == (
        len(first),
        file_checksum(first),
        a.inode,
    )
    with open(blobs.path(NS, H), "rb") as f:
        assert f.read() == first
    assert [k for k, _ in blobs.iter_files()] == ["blob"]  # no temp file left


def test_write_publishes_when_the_file_it_would_adopt_vanishes(blobs, monkeypatch):
    """Another process evicts the existing file between our link and our adopt: we
    publish ours instead of failing the save."""
    first = serialize_node(make_tensors(3), META)
    mine = serialize_node(make_tensors(4), META)
    write_one(blobs, NS, H, first)
    adopt = Blobs.adopt

    def vanish_once(self, final):
        monkeypatch.setattr(Blobs, "adopt", adopt)
        os.unlink(final)
        return adopt(self, final)  # raises FileNotFoundError, as in the race

    monkeypatch.setattr(Blobs, "adopt", vanish_once)
    got = write_one(blobs, NS, H, mine)
    assert got.ours and got.checksum == file_checksum(mine)
    assert got.inode == os.stat(blobs.path(NS, H)).st_ino
    with open(blobs.path(NS, H), "rb") as f:
        assert f.read() == mine
    assert [k for k, _ in blobs.iter_files()] == ["blob"]


def test_failed_write_cleans_up_temp_file(blobs):
    with pytest.raises(TypeError):
        write_one(blobs, NS, H, 12345)  # not a bytes-like object
    assert not os.path.exists(blobs.path(NS, H))
    assert list(blobs.iter_files()) == []


def test_parse_path_and_remove(written):
    blobs, _, _, _, path = written
    assert blobs.parse_path(path) == (NS, H)
    assert blobs.parse_path(os.path.join(blobs.root, "junk.txt")) is None
    bad = os.path.join(blobs.root, NS.hex(), "zz", H.hex() + ".safetensors")
    assert blobs.parse_path(bad) is None
    blobs.remove(NS, H)
    assert not os.path.exists(path)
    blobs.remove(NS, H)  # removing a missing file is fine


def test_quarantine_moves_file_with_reason(written):
    blobs, _, data, _, path = written
    dst = blobs.quarantine(NS, H, "checksum mismatch")
    assert not os.path.exists(path)
    with open(dst, "rb") as f:
        assert f.read() == data
    with open(dst + ".reason") as f:
        assert f.read() == "checksum mismatch\n"
    assert blobs.quarantine(NS, H, "again") is None


# ---------------------------------------------------------------------------
# parse_header: everything inconsistent is CorruptBlob
# ---------------------------------------------------------------------------

F32_1 = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}


def test_parse_header_minimal_valid():
    raw = raw_file({"a": F32_1, "__metadata__": {"k": "v"}}, b"\1\2\3\4")
    data_start, tensors, meta = parse(raw)
    assert data_start == len(raw) - 4
    assert tensors == {"a": TensorEntry("F32", (1,), data_start, data_start + 4)}
    assert meta == {"k": "v"}
    assert parse(raw_file({})) == (10, {}, {})


@pytest.mark.parametrize("raw", [b"", b"\x00", b"\x02\x00\x00\x00\x00\x00\x00"])
def test_parse_header_rejects_file_shorter_than_8_bytes(raw):
    with pytest.raises(CorruptBlob):
        parse(raw)


def test_parse_header_rejects_header_length_beyond_file():
    good = raw_file({"a": F32_1}, b"\0" * 4)
    hlen = struct.unpack_from("<Q", good)[0]
    for bad_len in (hlen + 5, len(good), len(good) - 7, 2**63, 2**64 - 1):
        with pytest.raises(CorruptBlob):
            parse(struct.pack("<Q", bad_len) + good[8:])


def test_parse_header_rejects_header_larger_than_max():
    # The file would be big enough; the header is still refused without reading it.
    prefix = struct.pack("<Q", MAX_HEADER_BYTES + 1)
    with pytest.raises(CorruptBlob):
        parse_header(prefix, MAX_HEADER_BYTES * 4)


def test_parse_header_rejects_truncated_prefix():
    good = raw_file({"a": F32_1}, b"\0" * 4)
    with pytest.raises(CorruptBlob):
        parse_header(good[:20], len(good))


@pytest.mark.parametrize(
    "header",
    [
        b"{not json}",
        b'{"a": ',
        b"\xff\xfe\xfd\xfc",
        b"\x80" * 10,
        b"{}}",
        b"",
    ],
)
def test_parse_header_rejects_non_json(header):
    with pytest.raises(CorruptBlob):
        parse(raw_file(header))


@pytest.mark.parametrize("header", [[], [1, 2], 1, "x", None, True, 1.5])
def test_parse_header_rejects_json_that_is_not_an_object(header):
    with pytest.raises(CorruptBlob):
        parse(raw_file(header))


@pytest.mark.parametrize("meta", ["x", [1], 5, True])
def test_parse_header_rejects_bad_metadata(meta):
    with pytest.raises(CorruptBlob):
        parse(raw_file({"a": F32_1, "__metadata__": meta}, b"\0" * 4))


@pytest.mark.parametrize(
    "entry",
    [
        dict(F32_1, dtype="F64"),
        dict(F32_1, dtype="float32"),
        dict(F32_1, dtype="f32"),
        dict(F32_1, dtype=None),
        dict(F32_1, dtype=["F32"]),
        dict(F32_1, dtype={"x": 1}),
    ],
)
def test_parse_header_rejects_unknown_dtype(entry):
    with pytest.raises(CorruptBlob):
        parse(raw_file({"a": entry}, b"\0" * 4))


@pytest.mark.parametrize(
    "shape, offsets",
    [
        ([-1], [0, 4]),
        ([-1, -1], [0, 4]),
        ([2, -2], [0, 4]),
        ([1.0], [0, 4]),
        (["1"], [0, 4]),
        ([[1]], [0, 4]),
        ([None], [0, 4]),
        (1, [0, 4]),
        ("1", [0, 4]),
        (None, [0, 4]),
        ({"0": 1}, [0, 4]),
        ([2**40], [0, 4]),
        ([2**31, 2**31], [0, 4]),
        ([2**62], [0, 4]),
        ([2**20, 2**20, 2**20], [0, 4]),
    ],
)
def test_parse_header_rejects_bad_or_huge_shapes(shape, offsets):
    with pytest.raises(CorruptBlob):
        parse(
            raw_file({"a": dict(F32_1, shape=shape, data_offsets=offsets)}, b"\0" * 4)
        )


@pytest.mark.parametrize(
    "offsets",
    [
        [0, 8],  # past the end of the file
        [4, 8],  # starts after a gap, ends past the file
        [100, 104],
        [2**62, 2**62 + 4],
        [-4, 0],
        [4, 0],  # end before start
        [0],
        [0, 4, 8],
        ["0", "4"],
        [0.0, 4.0],
        None,
        4,
        "04",
        {"0": 0, "1": 4},
    ],
)
def test_parse_header_rejects_bad_data_offsets(offsets):
    with pytest.raises(CorruptBlob):
        parse(raw_file({"a": dict(F32_1, data_offsets=offsets)}, b"\0" * 4))


@pytest.mark.parametrize(
    "entry",
    [
        {"shape": [1], "data_offsets": [0, 4]},
        {"dtype": "F32", "data_offsets": [0, 4]},
        {"dtype": "F32", "shape": [1]},
        [1, 2, 3],
        "F32",
        3,
        None,
    ],
)
def test_parse_header_rejects_malformed_entries(entry):
    with pytest.raises(CorruptBlob):
        parse(raw_file({"a": entry}, b"\0" * 4))


def test_parse_header_rejects_overlap_gap_and_trailing_bytes():
    def two(a, b, data_len):
        return raw_file(
            {
                "a": {"dtype": "F32", "shape": [a[1] - a[0] >> 2], "data_offsets": a},
                "b": {"dtype": "F32", "shape": [b[1] - b[0] >> 2], "data_offsets": b},
            },
            b"\0" * data_len,
        )

    assert len(parse(two([0, 8], [8, 12], 12))[1]) == 2  # the valid tiling
    assert len(parse(two([4, 12], [0, 4], 12))[1]) == 2  # header order does not matter
    for bad in (
        two([0, 8], [4, 12], 12),  # overlap
        two([0, 8], [0, 8], 8),  # same range twice
        two([0, 4], [8, 12], 12),  # gap in the middle
        two([4, 8], [8, 12], 12),  # gap at the start
        two([0, 4], [4, 8], 12),  # trailing bytes
        two([0, 8], [8, 12], 11),  # file too short
    ):
        with pytest.raises(CorruptBlob):
            parse(bad)


@pytest.mark.parametrize(
    "dtype, shape, nbytes",
    [
        ("F32", [2], 4),
        ("F32", [1], 8),
        ("F16", [3], 4),
        ("BF16", [2, 2], 6),
        ("U8", [0], 1),
        ("I32", [], 2),
        ("F32", [2, 0], 4),
    ],
)
def test_parse_header_rejects_size_not_matching_shape(dtype, shape, nbytes):
    header = {"a": {"dtype": dtype, "shape": shape, "data_offsets": [0, nbytes]}}
    with pytest.raises(CorruptBlob):
        parse(raw_file(header, b"\0" * nbytes))


def test_parse_header_accepts_scalar_and_empty_tensors():
    raw = raw_file(
        {
            "s": {"dtype": "I32", "shape": [], "data_offsets": [0, 4]},
            "e": {"dtype": "F16", "shape": [3, 0], "data_offsets": [4, 4]},
        },
        b"\0" * 4,
    )
    _, tensors, _ = parse(raw)
    assert tensors["s"].shape == () and tensors["e"].shape == (3, 0)


def test_parse_header_shape_beyond_int64_is_corrupt():
    with pytest.raises(CorruptBlob):
        parse(raw_file({"a": dict(F32_1, shape=[2**70])}, b"\0" * 4))


def test_parse_header_shape_product_overflow_is_corrupt():
    header = {"a": {"dtype": "U8", "shape": [2**32, 2**32], "data_offsets": [0, 0]}}
    with pytest.raises(CorruptBlob):
        parse(raw_file(header))


def test_parse_header_deeply_nested_json_is_corrupt():
    head = b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(CorruptBlob):
        parse(raw_file(head))


# ---------------------------------------------------------------------------
# check_layout
# ---------------------------------------------------------------------------


def test_check_layout():
    tensors = make_tensors()
    _, parsed, _ = parse(serialize_node(tensors, META))
    expected = expected_of(tensors)
    check_layout(parsed, expected)  # no error

    missing = dict(expected)
    missing.pop("0.values")
    extra = dict(expected, **{"2.keys": ("float32", (1,))})
    renamed = {("0.KEYS" if k == "0.keys" else k): v for k, v in expected.items()}
    wrong_dtype = dict(expected, **{"0.keys": ("float16", expected["0.keys"][1])})
    bf16_vs_f16 = dict(expected, **{"1.keys": ("float16", expected["1.keys"][1])})
    wrong_shape = dict(expected, **{"0.keys": ("float32", (2, 4, 5))})
    wrong_rank = dict(expected, **{"0.keys": ("float32", (2, 5, 4, 1))})
    for bad in (
        missing,
        extra,
        renamed,
        wrong_dtype,
        bf16_vs_f16,
        wrong_shape,
        wrong_rank,
        {},
    ):
        with pytest.raises(CorruptBlob):
            check_layout(parsed, bad)


# ---------------------------------------------------------------------------
# read_staged / read_all failures
# ---------------------------------------------------------------------------


def _flip(path: str, offset: int, mask: int = 0x01):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ mask]))


def _read_staged(blobs, tensors, data_len, checksum):
    return blobs.read_staged(
        NS,
        H,
        nbytes=data_len,
        checksum=checksum,
        expected=expected_of(tensors),
        staging=bytearray(max(data_len, 0) + 64),
    )


def _read_all(blobs, tensors, data_len, checksum):
    return blobs.read_all(
        NS, H, nbytes=data_len, checksum=checksum, expected=expected_of(tensors)
    )


def _read_into(blobs, tensors, data_len, checksum, *, split=1):
    """``read_into`` with one buffer per tensor (``split`` pieces each): name -> bytes."""
    got = {}

    def targets(parsed):
        out = []
        for name, entry in sorted(parsed.items(), key=lambda kv: kv[1].start):
            got[name] = bytearray(entry.end - entry.start)
            step = -(-len(got[name]) // split)
            view = memoryview(got[name])
            out += [view[i : i + step] for i in range(0, len(view), step)]
        return out

    opened = blobs.open_checked(NS, H, nbytes=data_len, expected=expected_of(tensors))
    meta = blobs.read_into(opened, checksum=checksum, targets=targets)
    assert opened.fd == -1
    return {name: bytes(b) for name, b in got.items()}, meta


def test_checksum_mismatch_on_data_byte(written):
    blobs, tensors, data, checksum, path = written
    _flip(path, len(data) - 7)
    with pytest.raises(CorruptBlob, match="checksum"):
        _read_staged(blobs, tensors, len(data), checksum)
    with pytest.raises(CorruptBlob, match="checksum"):
        _read_all(blobs, tensors, len(data), checksum)
    with pytest.raises(CorruptBlob, match="checksum"):
        _read_into(blobs, tensors, len(data), checksum)


def test_checksum_mismatch_on_header_byte(written):
    blobs, tensors, data, checksum, path = written
    pos = data.index(b"KVSTORE")  # inside a metadata value: the header stays valid JSON
    assert pos < 8 + struct.unpack_from("<Q", data)[0]
    _flip(path, pos, 0x20)  # "K" -> "k"
    with open(path, "rb") as f:
        parse(f.read())  # still a well-formed header
    with pytest.raises(CorruptBlob, match="checksum"):
        _read_staged(blobs, tensors, len(data), checksum)
    with pytest.raises(CorruptBlob, match="checksum"):
        _read_all(blobs, tensors, len(data), checksum)
    with pytest.raises(CorruptBlob, match="checksum"):
        _read_into(blobs, tensors, len(data), checksum)


def test_wrong_checksum_value(written):
    blobs, tensors, data, checksum, _ = written
    with pytest.raises(CorruptBlob):
        _read_staged(blobs, tensors, len(data), checksum ^ 1)
    with pytest.raises(CorruptBlob):
        _read_all(blobs, tensors, len(data), checksum ^ 1)
    with pytest.raises(CorruptBlob):
        _read_into(blobs, tensors, len(data), checksum ^ 1)


@pytest.mark.parametrize("keep", [0, 5, 8, 60, -1, -100])
def test_truncated_file(written, keep):
    blobs, tensors, data, checksum, path = written
    keep = keep % len(data)
    os.truncate(path, keep)
    # the index still says the original size
    with pytest.raises(CorruptBlob):
        _read_staged(blobs, tensors, len(data), checksum)
    with pytest.raises(CorruptBlob):
        _read_all(blobs, tensors, len(data), checksum)
    with pytest.raises(CorruptBlob):
        _read_into(blobs, tensors, len(data), checksum)
    # an index that agrees with the truncated size
    with pytest.raises(CorruptBlob):
        _read_staged(blobs, tensors, keep, file_checksum(data[:keep]))
    with pytest.raises(CorruptBlob):
        _read_all(blobs, tensors, keep, file_checksum(data[:keep]))
    with pytest.raises(CorruptBlob):
        _read_into(blobs, tensors, keep, file_checksum(data[:keep]))


def test_missing_file(written):
    blobs, tensors, data, checksum, path = written
    os.unlink(path)
    with pytest.raises(CorruptBlob, match="missing"):
        _read_staged(blobs, tensors, len(data), checksum)
    with pytest.raises(CorruptBlob, match="missing"):
        _read_all(blobs, tensors, len(data), checksum)
    with pytest.raises(CorruptBlob, match="missing"):
        _read_into(blobs, tensors, len(data), checksum)


@pytest.mark.parametrize("delta", [-1, 1, 1000])
def test_nbytes_mismatch(written, delta):
    blobs, tensors, data, checksum, _ = written
    with pytest.raises(CorruptBlob):
        _read_staged(blobs, tensors, len(data) + delta, checksum)
    with pytest.raises(CorruptBlob):
        _read_all(blobs, tensors, len(data) + delta, checksum)
    with pytest.raises(CorruptBlob):
        _read_into(blobs, tensors, len(data) + delta, checksum)


def test_layout_mismatch(written):
    blobs, tensors, data, checksum, _ = written
    expected = dict(expected_of(tensors), **{"0.keys": ("float32", (2, 6, 4))})
    with pytest.raises(CorruptBlob):
        blobs.read_staged(
            NS,
            H,
            nbytes=len(data),
            checksum=checksum,
            expected=expected,
            staging=bytearray(len(data)),
        )
    with pytest.raises(CorruptBlob):
        blobs.read_all(NS, H, nbytes=len(data), checksum=checksum, expected=expected)


# ---------------------------------------------------------------------------
# fuzz: every mutation parses to the original layout or raises CorruptBlob
# ---------------------------------------------------------------------------

_JUNK = [
    0,
    1,
    -1,
    4,
    7,
    2**31,
    -(2**40),
    2**40,
    1.5,
    -0.0,
    "F32",
    "BF16",
    "",
    "x" * 50,
    None,
    True,
    False,
    [],
    [0],
    [0, 4],
    [4, 0],
    [1, 2, 3],
    [-1, 5],
    ["a"],
    [None, None],
    {},
    {"dtype": "F32"},
]


def _random_json(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth > 3 or r < 0.5:
        return rng.choice(_JUNK)
    if r < 0.75:
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {
        rng.choice(
            ["a", "dtype", "shape", "data_offsets", "__metadata__", "0.keys"]
        ): _random_json(rng, depth + 1)
        for _ in range(rng.randrange(4))
    }


def _mutate(rng: random.Random, data: bytes, header: dict) -> bytes:
    hlen = struct.unpack_from("<Q", data)[0]
    body = data[8 + hlen :]
    kind = rng.randrange(7)
    if kind == 0:  # flip 1-3 random bytes anywhere
        out = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            out[rng.randrange(len(out))] ^= rng.randint(1, 255)
        return bytes(out)
    if kind == 1:  # flip bytes inside the header
        out = bytearray(data)
        for _ in range(rng.randint(1, 2)):
            out[rng.randrange(8 + hlen)] ^= rng.randint(1, 255)
        return bytes(out)
    if kind == 2:  # truncate
        return data[: rng.randrange(len(data))]
    if kind == 3:  # random header length
        new = rng.choice([0, 1, hlen - 1, hlen + 1, len(data), 2**32, 2**64 - 1])
        new = new if rng.random() < 0.7 else rng.randrange(2**64)
        return struct.pack("<Q", new % 2**64) + data[8:]
    # random JSON: perturb one field of the real header, or replace it entirely
    h = json.loads(json.dumps(header))
    if kind == 6:  # move one tensor's range, keeping its size (tiling must catch it)
        name = rng.choice([n for n in h if n != "__metadata__"])
        s, e = h[name]["data_offsets"]
        d = rng.choice([-8, -4, -2, -1, 1, 2, 4, 8, e - s, s - e])
        h[name]["data_offsets"] = [s + d, e + d]
    elif kind == 4:
        name = rng.choice(list(h))
        if isinstance(h[name], dict) and rng.random() < 0.85:
            field = rng.choice(["dtype", "shape", "data_offsets"])
            if rng.random() < 0.2:
                h[name].pop(field, None)
            else:
                h[name][field] = _random_json(rng)
        else:
            h[name] = _random_json(rng)
    else:
        h = (
            _random_json(rng)
            if rng.random() < 0.5
            else dict(h, extra=_random_json(rng))
        )
    head = json.dumps(h).encode()
    if rng.random() < 0.2:
        body = body[: rng.randrange(len(body) + 1)]
    return struct.pack("<Q", len(head)) + head + body


_ITEM = {"F32": 4, "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "U8": 1, "I8": 1}


def _check_invariants(m: bytes, start: int, tensors) -> None:
    """An independent statement of what a successful parse promises."""
    assert start == 8 + struct.unpack_from("<Q", m)[0]
    pos = start
    for e in sorted(tensors.values(), key=lambda e: (e.start, e.end)):
        assert e.dtype in _ITEM
        assert all(type(d) is int and d >= 0 for d in e.shape)
        assert e.end - e.start == math.prod(e.shape) * _ITEM[e.dtype]
        assert e.start == pos
        pos = e.end
    assert pos == len(m)


def _relative(data_start, tensors):
    return {
        n: (e.dtype, e.shape, e.start - data_start, e.end - data_start)
        for n, e in tensors.items()
    }


def test_fuzz_mutations_parse_identically_or_raise_corrupt(blobs):
    tensors = make_tensors(7)
    data = serialize_node(tensors, META)
    checksum = file_checksum(data)
    expected = expected_of(tensors)
    data_start, orig, _ = parse(data)
    hlen = struct.unpack_from("<Q", data)[0]
    header = json.loads(data[8 : 8 + hlen])
    path = blobs.path(NS, H)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    rng = random.Random(1234)
    outcomes = {"corrupt": 0, "same": 0}
    for i in range(300):
        m = _mutate(rng, data, header)
        if m == data:
            continue
        # 1. whatever the parser accepts is self-consistent ...
        try:
            start, parsed, meta = parse_header(m, len(m))
        except CorruptBlob:
            outcomes["corrupt"] += 1
            parsed = None
        else:
            _check_invariants(m, start, parsed)
        # ... and, with the layout check, identical to the original
        try:
            if parsed is None:
                raise CorruptBlob("already refused")
            check_layout(parsed, expected)
        except CorruptBlob:
            pass
        else:
            # re-encoded JSON may move the data section: compare offsets inside it
            assert _relative(start, parsed) == _relative(
                data_start, orig
            ), f"mutation {i}"
            assert len(m) - start == len(data) - data_start
            assert isinstance(meta, dict)
            outcomes["same"] += 1
        # 2. the index's checksum catches every change, whatever the parser says
        with open(path, "wb") as f:
            f.write(m)
        for nbytes in {len(m), len(data)}:
            with pytest.raises(CorruptBlob):
                blobs.read_all(
                    NS, H, nbytes=nbytes, checksum=checksum, expected=expected
                )
            with pytest.raises(CorruptBlob):
                _read_staged(blobs, tensors, nbytes, checksum)
            with pytest.raises(CorruptBlob):
                _read_into(blobs, tensors, nbytes, checksum)
        # 3. even with a checksum that matches the damaged file, no other exception
        try:
            _, parsed, _ = blobs.read_all(
                NS, H, nbytes=len(m), checksum=file_checksum(m), expected=expected
            )
        except CorruptBlob:
            pass
        else:
            start = 8 + struct.unpack_from("<Q", m)[0]
            assert _relative(start, parsed) == _relative(
                data_start, orig
            ), f"mutation {i}"
    # the generator exercised both outcomes
    assert outcomes["corrupt"] > 150
    assert outcomes["same"] > 10
