"""The restore path MLX's CUDA backend takes (kvstore.engine.loadpath), run on the CPU.

The whole store and corruption suites also run through it in CI
(``KVSTORE_RESTORE_IO=load``); these tests pin what is particular to it: segments
joined on the device, reads that arrive out of order, and the choice of path.
"""

import io
import os
import threading

import mlx.core as mx
import numpy as np
import pytest
from conftest import compute_cache, next_logits, random_tokens, tiny_llama

import kvstore
from kvstore.engine import loadpath
from kvstore.engine.loadpath import Failures, FileSource, MemorySource, RestoreFile

C = 16


def _stored(path, model, tokens):
    with kvstore.KVStore(path, model, chunk_tokens=C, ram_bytes=0) as s:
        s.save(tokens, compute_cache(model, tokens))


def _kv(cache, n):
    return [
        np.array(a[..., :n, :].view(mx.uint16))
        for layer in cache
        for a in (layer.keys, layer.values)
    ]


@pytest.mark.parametrize("segment_nodes", [1, 3, 64])
@pytest.mark.parametrize("room", [0, 40])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_load_path_restores_what_assemble_does(
    tmp_path, monkeypatch, segment_nodes, room, dtype
):
    """Bit-identical KV from both paths, with the restore split into segments that
    are joined on the device, with and without room; then the same next logits."""
    model = tiny_llama(2, dtype=dtype)
    tokens = random_tokens(150, 3)
    _stored(tmp_path, model, tokens)
    monkeypatch.setattr(loadpath, "SEGMENT_NODES", segment_nodes)
    monkeypatch.setattr(kvstore.engine.restore, "ROOM_MIN_BYTES", 0)
    out = {}
    for io_path in ("assemble", "load"):
        monkeypatch.setenv("KVSTORE_RESTORE_IO", io_path)
        with kvstore.KVStore(
            tmp_path, model, chunk_tokens=C, ram_bytes=0, restore_room=room
        ) as s:
            assert s.restore_io == io_path
            cache, n = s.fetch(tokens + [7])
            assert n == len(tokens) and s.stats()["corrupt"] == 0
            if room:
                assert cache[0].keys.shape[2] > n
            logits = next_logits(model, cache, [7]).astype(mx.float32)
            out[io_path] = (_kv(cache, n), np.array(logits))
    for a, b in zip(out["assemble"][0], out["load"][0]):
        assert np.array_equal(a, b)
    assert np.array_equal(out["assemble"][1], out["load"][1])
    cold = next_logits(model, compute_cache(model, tokens), [7]).astype(mx.float32)
    assert np.allclose(np.array(cold), out["load"][1], atol=1e-2)


def _node_sources(store, tokens):
    """The whole nodes of ``tokens``' restore, opened as the load path opens them."""
    arr = np.array(tokens, np.int32)
    path = store.index.read(
        lambda txn: store.parts.reads.trie.walk(txn, arr, limit=len(arr))
    )
    return path, [store.parts.reads._node_source(step) for step in path]


def _flip_a_byte(path):
    """Invert a byte near the end of a node file (in its KV)."""
    with open(path, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))


def _restore_file(store, path, sources, failures, *, threads=2):
    offsets = np.cumsum([0] + [s.take for s in path])[:-1].tolist()
    name = next(iter(store.layout.rows))
    return RestoreFile(
        {name: store.layout.rows[name]},
        sum(s.take for s in path),
        sources=sources,
        offsets=offsets,
        takes=[s.take for s in path],
        first=0,
        failures=failures,
        pool=None,
        threads=threads,
    )


def test_reads_out_of_order_are_placed_right_and_verified_again(tmp_path, model):
    """A reader that asks for the file in odd pieces, backwards, gets the same bytes
    as one that reads it in order; the nodes are then hashed again from disk, and a
    flipped byte is still found."""
    tokens = random_tokens(4 * C, 5)
    _stored(tmp_path, model, tokens)
    with kvstore.KVStore(tmp_path, model, chunk_tokens=C, ram_bytes=0) as s:
        path, sources = _node_sources(s, tokens)
        whole = _restore_file(s, path, sources, Failures(len(path)))
        expected = whole.read()
        assert all(src.in_order for src in sources)
        for src in sources:
            src.verify()
            src.close()

        path, sources = _node_sources(s, tokens)
        odd = _restore_file(s, path, sources, Failures(len(path)))
        size = len(expected)
        got = bytearray(size)
        for start in reversed(range(0, size, 1000)):
            odd.seek(start)
            odd.readinto(memoryview(got)[start : start + 1000])
        assert bytes(got) == expected
        assert not any(src.in_order for src in sources)
        for src in sources:
            src.verify()  # hashed again from disk: passes

        _flip_a_byte(s.blobs.path(s.namespace, path[2].h))
        with pytest.raises(kvstore.disk.blobs.CorruptBlob, match="checksum"):
            sources[2].verify()
        for src in sources:
            src.close()


def test_a_failed_node_stops_the_reads_after_it(tmp_path, model):
    """Nodes after the first one that fails are not read (their rows stay as they
    were), and the failure names the node."""
    tokens = random_tokens(4 * C, 6)
    _stored(tmp_path, model, tokens)
    with kvstore.KVStore(tmp_path, model, chunk_tokens=C, ram_bytes=0) as s:
        path, sources = _node_sources(s, tokens)
        failures = Failures(len(path))
        sources[1].opened.close()  # reading it now fails: EBADF
        file = _restore_file(s, path, sources, failures, threads=1)
        data = file.read()
        assert failures.first == 1 and isinstance(failures.errors[1], OSError)
        reads_after = [src.pos > len(src.opened.head) for src in sources[2:]]
        assert reads_after == [False, False]
        assert len(data) == file.seek(0, io.SEEK_END)
        for src in sources:
            src.close()


def test_restores_on_two_threads_read_at_the_same_time(tmp_path, model, monkeypatch):
    """Two threads' restores overlap (no lock held across a load): each waits in its
    first read for the other to reach its own, and both restore the right KV."""
    prompts = [random_tokens(3 * C, 40 + i) for i in range(2)]
    for p in prompts:
        _stored(tmp_path / "s", model, p)
    both_reading = threading.Barrier(2, timeout=10)
    real_init, real_fill = RestoreFile.__init__, RestoreFile.fill
    met = []

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.restore = threading.current_thread().name  # MLX may read elsewhere

    def fill(self, out, start):
        if self.restore not in met:
            met.append(self.restore)
            both_reading.wait()  # BrokenBarrierError if the restores take turns
        return real_fill(self, out, start)

    monkeypatch.setattr(RestoreFile, "__init__", init)
    monkeypatch.setattr(RestoreFile, "fill", fill)
    monkeypatch.setenv("KVSTORE_RESTORE_IO", "load")
    got, errors = {}, []
    with kvstore.KVStore(tmp_path / "s", model, chunk_tokens=C, ram_bytes=0) as s:

        def restore(i):
            try:
                cache, n = s.fetch(prompts[i] + [1])
                got[i] = (n, _kv(cache, n))
            except Exception as e:  # reported below
                errors.append(e)

        threads = [
            threading.Thread(target=restore, args=(i,), name=f"restore-{i}")
            for i in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors and sorted(met) == ["restore-0", "restore-1"]
    for i, p in enumerate(prompts):
        n, kv = got[i]
        assert n == len(p)
        for a, b in zip(kv, _kv(compute_cache(model, p), n)):
            assert np.array_equal(a, b)


def test_memory_sources_copy_only_the_rows_taken():
    data = bytes(range(48))  # one tensor, 2 heads of 4 rows of 6 bytes
    entry = kvstore.disk.blobs.TensorEntry("U8", (1, 2, 4, 6), 0, 48)
    src = MemorySource(data, {"t": entry})
    out = bytearray(12)
    src.read([(0, memoryview(out)[:6]), (24, memoryview(out)[6:])])
    assert bytes(out) == data[0:6] + data[24:30]


def test_the_path_is_chosen_by_backend_and_can_be_forced(monkeypatch):
    monkeypatch.delenv("KVSTORE_RESTORE_IO", raising=False)
    cuda = getattr(mx, "cuda", None)
    on_cuda = cuda is not None and cuda.is_available()
    assert loadpath.default_restore_io() == ("load" if on_cuda else "assemble")
    for forced in ("load", "assemble"):
        monkeypatch.setenv("KVSTORE_RESTORE_IO", forced)
        assert loadpath.default_restore_io() == forced
    monkeypatch.setenv("KVSTORE_RESTORE_IO", "bogus")
    assert loadpath.default_restore_io() == ("load" if on_cuda else "assemble")


def test_file_source_is_hashed_in_order_through_a_real_load(tmp_path, model):
    """Through mx.load itself every node file is read once, front to back."""
    tokens = random_tokens(5 * C + 3, 8)
    _stored(tmp_path, model, tokens)
    seen = []
    real = FileSource.verify

    def verify(self):
        seen.append((self.in_order, self.pos == self.opened.nbytes))
        return real(self)

    mp = pytest.MonkeyPatch()
    mp.setattr(FileSource, "verify", verify)
    mp.setenv("KVSTORE_RESTORE_IO", "load")
    try:
        with kvstore.KVStore(tmp_path, model, chunk_tokens=C, ram_bytes=0) as s:
            assert s.fetch(tokens + [1])[1] == len(tokens)
    finally:
        mp.undo()
    assert seen == [(True, True)] * 6


def test_groups_stack_consecutive_tensors_of_one_shape_up_to_the_bytes(monkeypatch):
    monkeypatch.setattr(loadpath, "SEGMENT_TENSOR_BYTES", 4096)
    kv = ("bfloat16", 2, 8)  # 32 bytes a row
    rows = {"a": kv, "b": kv, "c": kv, "d": ("float16", 2, 8), "e": kv, "f": kv}
    assert loadpath._groups(rows, 64) == [["a", "b"], ["c"], ["d"], ["e", "f"]]
    assert loadpath._groups(rows, 1) == [["a", "b", "c"], ["d"], ["e", "f"]]
    assert loadpath._groups(rows, 1000) == [[n] for n in rows]  # one at least


def test_a_restore_loads_its_tensors_stacked(tmp_path, model, monkeypatch):
    """One load per segment where every tensor fits (each load waits for its copy
    to the device), the tensors then in buffers of their own, the KV right."""
    tokens = random_tokens(4 * C + 5, 9)
    _stored(tmp_path, model, tokens)
    loads = []
    real = mx.load

    def load(file, *args, **kwargs):
        loads.append(len(file.names))
        return real(file, *args, **kwargs)

    monkeypatch.setattr(loadpath.mx, "load", load)
    monkeypatch.setenv("KVSTORE_RESTORE_IO", "load")
    with kvstore.KVStore(tmp_path, model, chunk_tokens=C, ram_bytes=0) as s:
        cache, n = s.fetch(tokens + [1])
    tensors = 2 * len(cache)
    assert n == len(tokens) and loads == [tensors]
    for got, want in zip(_kv(cache, n), _kv(compute_cache(model, tokens), n)):
        assert np.array_equal(got, want)
    for layer in cache:
        assert layer.keys.shape[0] == 1 and layer.values.shape[0] == 1


def test_segments_bound_nodes_and_bytes(monkeypatch):
    rows = {"k": ("bfloat16", 8, 128), "v": ("bfloat16", 8, 128)}  # 2 KiB a token
    monkeypatch.setattr(loadpath, "SEGMENT_TENSOR_BYTES", 16 << 20)
    assert loadpath._segments(rows, [256] * 128) == [
        (0, 32),
        (32, 64),
        (64, 96),
        (96, 128),
    ]
    monkeypatch.setattr(loadpath, "SEGMENT_NODES", 2)
    assert loadpath._segments(rows, [5] * 5) == [(0, 2), (2, 4), (4, 5)]
    monkeypatch.setattr(loadpath, "SEGMENT_TENSOR_BYTES", 1)  # one node at least
    assert loadpath._segments(rows, [5, 5]) == [(0, 1), (1, 2)]
    assert loadpath._segments(rows, []) == []


@pytest.mark.parametrize("victim", [1, 2, 5])
def test_a_broken_node_ends_the_restore_at_it_whichever_segment_holds_it(
    tmp_path, model, monkeypatch, victim
):
    """A flipped byte in node ``victim`` (segments of two nodes): the restore returns
    exactly the nodes before it, with their right KV, counts one corrupt node, and
    the next fetch restores as far again."""
    tokens = random_tokens(7 * C, 12)
    _stored(tmp_path, model, tokens)
    monkeypatch.setattr(loadpath, "SEGMENT_NODES", 2)
    monkeypatch.setenv("KVSTORE_RESTORE_IO", "load")
    with kvstore.KVStore(tmp_path, model, chunk_tokens=C, ram_bytes=0) as s:
        path, sources = _node_sources(s, tokens)
        for src in sources:
            src.close()
        _flip_a_byte(s.blobs.path(s.namespace, path[victim].h))
        cache, n = s.fetch(tokens + [1])
        assert n == victim * C and s.stats()["corrupt"] == 1
        for got, want in zip(_kv(cache, n), _kv(compute_cache(model, tokens), n)):
            assert np.array_equal(got, want)
        assert s.fetch(tokens + [1])[1] == victim * C
