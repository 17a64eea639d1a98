"""The CUDA branches of kvstore.platform.devices, namespace and saving, run on the CPU.

On CUDA, kvstore never reads the model's weights or the caller's live cache on the
host: it reads device copies. Whether MLX moved a buffer cannot be seen on the CPU
(the GPU benchmark measures it), but what these branches compute can: the same
bytes, files and restores as the in-place path.
"""

import mlx.core as mx
import numpy as np
import pytest
from conftest import compute_cache, next_logits, random_tokens, tiny_llama

import kvstore
from kvstore.disk import namespace
from kvstore.platform import devices

C = 16


def _data(file: bytes) -> bytes:
    """A node file's tensor bytes (after its header)."""
    (hlen,) = np.frombuffer(file[:8], "<u8")
    return file[8 + int(hlen) :]


@pytest.fixture
def as_on_cuda(monkeypatch):
    monkeypatch.setattr(devices, "host_access_moves_arrays", lambda: True)
    monkeypatch.setenv("KVSTORE_RESTORE_IO", "load")


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16, mx.uint32])
def test_device_copy_keeps_every_bit_in_a_buffer_of_its_own(dtype):
    raw = np.array([0x7FC00001, 0x80000000, 0x3F800000, 0xFFFFFFFF, 7], np.uint32)
    size = mx.array(0, dtype).dtype.size
    a = mx.array(raw.view(np.uint8)[: 5 * size].copy()).view(dtype)
    b = devices.device_copy(a)
    mx.eval(a, b)
    assert b.dtype == a.dtype and b.shape == a.shape
    assert bytes(memoryview(b)) == bytes(memoryview(a))
    address = lambda x: np.frombuffer(memoryview(x), np.uint8).ctypes.data  # noqa
    assert address(a) != address(b)


def test_weights_digest_on_cuda_reads_samples_and_sees_changes(as_on_cuda, monkeypatch):
    """Deterministic, and changed by a byte in a sampled place of a large tensor."""
    monkeypatch.setattr(namespace, "DEVICE_SAMPLE", 4096)
    model = tiny_llama(0)
    headers, content = namespace.weights_digest(model)
    assert namespace.weights_digest(model) == (headers, content)
    assert namespace.weights_digest(tiny_llama(1))[1] != content

    weight = model.model.embed_tokens.weight
    flat = np.array(weight).reshape(-1)
    assert flat.nbytes > 3 * namespace.DEVICE_SAMPLE  # sampled, not whole
    flat[1] += 1.0  # inside the first sample
    model.model.embed_tokens.weight = mx.array(flat.reshape(weight.shape))
    changed = namespace.weights_digest(model)
    assert changed[0] == headers and changed[1] != content


def test_save_and_restore_as_on_cuda_equal_the_cpu_path(tmp_path, as_on_cuda):
    """Saved from device copies (host arrays made on the writer thread), restored
    through mx.load: the node files are byte for byte the CPU path's, and the
    restore continues like a cold run."""
    model = tiny_llama(0, dtype=mx.float16)
    tokens = random_tokens(5 * C + 4, 2)
    cache = compute_cache(model, tokens)
    cuda_dir, cpu_dir = tmp_path / "cuda", tmp_path / "cpu"
    with kvstore.KVStore(cuda_dir, model, chunk_tokens=C, ram_bytes=0) as s:
        assert s.save(tokens, cache) == 6
        s.flush()
        assert s.stats()["writes_failed"] == 0
        files = sorted(p.name for p in (cuda_dir / "blobs").rglob("*.safetensors"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(devices, "host_access_moves_arrays", lambda: False)
        mp.setattr(namespace.devices, "host_access_moves_arrays", lambda: False)
        with kvstore.KVStore(cpu_dir, model, chunk_tokens=C, ram_bytes=0) as s:
            s.save(tokens, cache)
    cpu_files = {
        p.name: p.read_bytes() for p in (cpu_dir / "blobs").rglob("*.safetensors")
    }
    cuda_files = {
        p.name: p.read_bytes() for p in (cuda_dir / "blobs").rglob("*.safetensors")
    }
    assert len(files) == 6 and len(cpu_files) == 6
    # The same data; the headers name another namespace (the weights digest
    # differs), so compare the files' tensor bytes.
    assert sorted(_data(f) for f in cuda_files.values()) == sorted(
        _data(f) for f in cpu_files.values()
    )
    with kvstore.KVStore(cuda_dir, model, chunk_tokens=C, ram_bytes=0) as s:
        restored, n = s.fetch(tokens + [3])
        assert n == len(tokens) and s.stats()["corrupt"] == 0
    cold = next_logits(model, compute_cache(model, tokens), [3])
    warm = next_logits(model, restored, [3])
    assert np.allclose(
        np.array(cold.astype(mx.float32)), np.array(warm.astype(mx.float32)), atol=1e-2
    )
    for x, y in zip(restored, compute_cache(model, tokens)):
        k = np.array(x.keys[..., :n, :].view(mx.uint16))
        assert np.array_equal(k, np.array(y.keys[..., :n, :].view(mx.uint16)))


def test_a_save_is_immune_to_the_callers_later_updates_as_on_cuda(tmp_path, as_on_cuda):
    """The device copies are taken at save(): tokens the caller feeds afterwards,
    before the writer runs, do not reach the files."""
    model = tiny_llama(0)
    tokens = random_tokens(3 * C, 4)
    cache = compute_cache(model, tokens)
    with kvstore.KVStore(tmp_path, model, chunk_tokens=C, ram_bytes=0) as s:
        s.writer.submit(lambda: __import__("time").sleep(0.3))  # the writer is busy
        s.save(tokens, cache)
        next_logits(model, cache, random_tokens(2 * C, 5))  # updates in place
        for layer in cache:
            layer.keys[..., : 3 * C, :] = 0.0
        s.flush()
        restored, n = s.fetch(tokens + [1])
    assert n == len(tokens)
    fresh = compute_cache(model, tokens)
    for x, y in zip(restored, fresh):
        assert np.array_equal(
            np.array(x.keys[..., :n, :]), np.array(y.keys[..., :n, :])
        )


def test_a_checkpoint_only_save_clears_mlx_cache_as_on_cuda(
    tmp_path, as_on_cuda, monkeypatch
):
    """A save whose only new file is a checkpoint (its tokens are stored without one)
    moves the state's device copies to the host too: MLX's buffer cache is cleared
    after it, as after a save of new tokens."""
    from families import build

    model = build("mamba2")
    tokens = random_tokens(3 * C, 6)
    with kvstore.KVStore(tmp_path, model, chunk_tokens=C, ram_bytes=0) as s:
        s.save(tokens, compute_cache(model, tokens))  # a checkpoint at 3 * C only
        s.flush()
        cleared = []
        monkeypatch.setattr(mx, "clear_cache", lambda: cleared.append(1))
        prefix = tokens[: 2 * C]
        assert s.save(prefix, compute_cache(model, prefix)) == 1  # its checkpoint
        s.flush()
        assert s.stats()["writes_failed"] == 0 and cleared
        assert s.lookup(prefix + [1]) == len(prefix)  # restorable there now


def test_host_copy_in_slices_as_on_cuda(as_on_cuda, monkeypatch):
    """Where host access moves arrays, saves reach the host a slice at a time (no
    long GIL hold); the bytes are the array's, whatever the slice size."""
    monkeypatch.setattr(devices, "HOST_SLICE_BYTES", 3 * 2 * 8 * 2)  # 3 tokens
    a = mx.random.randint(0, 1 << 15, (1, 2, 10, 8)).astype(mx.uint16)
    got = devices.host_copy(a)
    assert got.dtype == np.uint16 and np.array_equal(got, np.array(a))
    one = mx.zeros((1, 2, 1, 8), mx.uint32)
    assert np.array_equal(devices.host_copy(one), np.zeros((1, 2, 1, 8), np.uint32))


def test_saves_in_slices_write_the_same_files(tmp_path, monkeypatch):
    model = tiny_llama(0)
    tokens = random_tokens(5 * C + 3, 8)
    cache = compute_cache(model, tokens)
    files = {}
    for label, on_cuda in (("in place", False), ("sliced", True)):
        with monkeypatch.context() as mp:
            mp.setattr(devices, "host_access_moves_arrays", lambda: on_cuda)
            mp.setattr(devices, "HOST_SLICE_BYTES", 512)  # a few tokens a slice
            path = tmp_path / label.replace(" ", "-")
            with kvstore.KVStore(path, model, chunk_tokens=C) as s:
                s.save(tokens, cache)
                s.flush()
                files[label] = sorted(
                    _data(p.read_bytes()) for p in path.rglob("*.safetensors")
                )
    assert files["in place"] == files["sliced"] and len(files["sliced"]) == 6


@pytest.mark.parametrize("on_cuda", [False, True])
def test_the_writer_steps_aside_while_the_foreground_is_busy(
    tmp_path, monkeypatch, on_cuda
):
    """With ``writer.yield_to`` saying the foreground is busy, a save's files wait
    (on CUDA between the slices of its host copy too), and are written once it
    rests, bit for bit; a flush never waits for it."""
    import threading

    if on_cuda:
        monkeypatch.setattr(devices, "host_access_moves_arrays", lambda: True)
        monkeypatch.setattr(devices, "HOST_SLICE_BYTES", 1024)
    model = tiny_llama(0)
    tokens = random_tokens(100, seed=3)
    cache = compute_cache(model, tokens)
    busy, asked = [True], []

    def yield_to():
        asked.append(threading.current_thread().name)
        return busy[0]

    with kvstore.KVStore(tmp_path / "s", model, chunk_tokens=C) as store:
        store.writer.yield_to = yield_to
        store.save(tokens, cache)
        threading.Event().wait(0.3)
        assert store.stats()["pending_write_jobs"] == 1  # waiting for its turn
        assert store.lookup(tokens + [1]) == 0
        busy[0] = False
        store.flush()
        assert store.lookup(tokens + [1]) == 100
        assert set(asked) == {"kvstore-writer"}
        assert store.stats()["write_yielded_seconds"] >= 0.25
        restored, n = store.fetch(tokens + [1])
        assert n == 100
        fresh = compute_cache(model, tokens)
        np.testing.assert_allclose(
            np.array(next_logits(model, restored, [1])),
            np.array(next_logits(model, fresh, [1])),
            atol=1e-4,
        )
        busy[0] = True  # a flush hurries the writer
        more = random_tokens(64, seed=4)
        store.save(more, compute_cache(model, more))
        store.flush()
        assert store.lookup(more + [1]) == 64


def test_a_busy_foreground_holds_a_job_back_no_longer_than_max_yield_s(tmp_path):
    model = tiny_llama(0)
    tokens = random_tokens(64, seed=5)
    with kvstore.KVStore(tmp_path / "s", model, chunk_tokens=C) as store:
        store.writer.yield_to = lambda: True
        store.writer.max_yield_s = 0.3
        store.save(tokens, compute_cache(model, tokens))
        for _ in range(100):
            if store.lookup(tokens + [1]) == 64:
                break
            threading_wait(0.05)
        assert store.lookup(tokens + [1]) == 64


def threading_wait(seconds):
    import threading

    threading.Event().wait(seconds)
