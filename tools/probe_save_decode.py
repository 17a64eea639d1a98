"""Decode speed of one stream while another thread moves KV to the host.

Why ``kvstore serve``'s saves wait for the generation loop to rest: with MLX's CUDA
backend a device array read on the CPU is moved into managed memory first, and the
moves slow the kernels of whatever decodes beside them. In one process, a model of a
real shape (random weights, ``tools/bench_gpu.py``) decodes ``--decode`` tokens after a
512-token prompt while a second thread copies the KV of a ``--kv-tokens`` prompt to
the host over and over, one way per case, cases rotated over ``--repeats``:

* none: nothing moves (the reference);
* cur: ``kvstore.platform.devices.host_copy`` (4 MiB device copies, each read on the
  host), the buffer cache cleared after each pass over the KV, as a save's release does;
* clear: the same slices, each moved buffer freed at once (``mx.clear_cache``);
* clear64: 64 MiB slices, each freed at once;
* whole: each array copied on the device whole, read on the host, freed;
* unique: slices of a different size each, so that no device copy reuses a buffer
  an earlier slice's host read moved (MLX's buffer cache reuses a buffer only within
  two pages of the size asked).

Prints one line per sample and writes every sample as JSON: decode tokens/s, GB/s
moved, and the longest wait for Python's GIL seen by a thread sleeping 1 ms in a loop.
A tool for the GPU machine (on the CPU nothing is moved); pytest does not collect it.

    python tools/probe_save_decode.py --shape llama-8b --repeats 4 --json out.json
"""

import argparse
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.modules.setdefault("torch", None)  # mlx-lm's tokenizer imports skip PyTorch

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from kvstore.platform import devices  # noqa: E402
from tools.bench_gpu import SHAPES, build  # noqa: E402

SLICE = 4 << 20


def _sliced(a: mx.array, rows_at, *, free_each: bool) -> np.ndarray:
    """``a``'s bytes on the host in slices of the token axis, ``rows_at(k)`` tokens
    for the k-th slice, each copied on the device first."""
    bits = a.view(mx.uint16)
    out = np.empty(a.shape, np.uint16)
    start, k = 0, 0
    while start < a.shape[2]:
        end = min(a.shape[2], start + rows_at(k))
        part = devices.device_copy(bits[:, :, start:end])
        mx.eval(part)
        out[:, :, start:end] = np.asarray(part)
        del part
        if free_each:
            mx.clear_cache()
        start, k = end, k + 1
    return out


def _rows(a: mx.array, nbytes: int) -> int:
    return max(1, nbytes // max(1, a.nbytes // a.shape[2]))


class _Unique:
    """Slice sizes that differ by more than two buffer-cache pages within a pass."""

    def __init__(self):
        self.k = 0

    def copy(self, a: mx.array) -> np.ndarray:
        row = max(1, a.nbytes // a.shape[2])
        gap = max(1, (3 * 16384 + row - 1) // row)

        def rows_at(_):
            self.k += 1
            return _rows(a, SLICE) + gap * self.k

        return _sliced(a, rows_at, free_each=False)


def _whole(a: mx.array) -> np.ndarray:
    part = devices.device_copy(a.view(mx.uint16))
    mx.eval(part)
    out = np.array(part)
    del part
    mx.clear_cache()
    return out


def methods():
    unique = _Unique()
    return {
        "cur": (lambda a: devices.host_copy(a.view(mx.uint16)), True),
        "clear": (
            lambda a: _sliced(a, lambda k: _rows(a, SLICE), free_each=True),
            False,
        ),
        "clear64": (
            lambda a: _sliced(a, lambda k: _rows(a, 64 << 20), free_each=True),
            False,
        ),
        "whole": (_whole, False),
        "unique": (unique.copy, True),
    }, unique


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-8b", choices=sorted(SHAPES))
    ap.add_argument("--kv-tokens", type=int, default=6500)
    ap.add_argument("--decode", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--cases", nargs="+", default=["none", "cur", "clear", "clear64", "unique"]
    )
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    model = build(args.shape)
    vocab = SHAPES[args.shape]["vocab_size"]
    rng = np.random.default_rng(0)
    cache = make_prompt_cache(model)
    toks = rng.integers(10, vocab, args.kv_tokens).tolist()
    for _ in generate_step(
        mx.array(toks), model, prompt_cache=cache, max_tokens=1, prefill_step_size=2048
    ):
        pass
    kv = []
    for c in cache:
        for a in (c.keys[:, :, : c.offset, :], c.values[:, :, : c.offset, :]):
            kv.append(devices.device_copy(a))
    mx.eval(kv)
    total = sum(a.nbytes for a in kv)
    ways, unique = methods()
    reference = np.asarray(kv[0].view(mx.uint16))
    for name, (copy, _) in ways.items():  # every way moves the same bytes
        assert np.array_equal(copy(kv[0]), reference), name
    results = {"kv_bytes": total, "shape": args.shape, "samples": {}}
    order = [
        c
        for r in range(args.repeats)
        for c in args.cases[r % len(args.cases) :] + args.cases[: r % len(args.cases)]
    ]
    for case in order:
        stop, moved, gaps = threading.Event(), [0], []

        def mover():
            copy, pass_end = ways[case]
            while not stop.is_set():
                for a in kv:
                    if stop.is_set():
                        break
                    copy(a)
                    moved[0] += a.nbytes
                if pass_end:
                    unique.k = 0
                    mx.clear_cache()  # as a save's release does

        def ticker():
            while not stop.is_set():
                t = time.perf_counter()
                time.sleep(0.001)
                gaps.append(time.perf_counter() - t - 0.001)

        threads = [threading.Thread(target=ticker, daemon=True)]
        if case != "none":
            threads.append(threading.Thread(target=mover, daemon=True))
        fresh = make_prompt_cache(model)
        prompt = rng.integers(10, vocab, 512).tolist()
        gen = generate_step(
            mx.array(prompt),
            model,
            prompt_cache=fresh,
            max_tokens=args.decode,
            prefill_step_size=2048,
        )
        next(gen)
        for t in threads:
            t.start()
        tic, n = time.perf_counter(), 0
        for _ in gen:
            n += 1
        seconds = time.perf_counter() - tic
        stop.set()
        for t in threads:
            t.join()
        gaps.sort()
        sample = {
            "decode_tok_s": n / seconds,
            "moved_gb_s": moved[0] / seconds / 1e9,
            "gil_wait_max_ms": gaps[-1] * 1e3,
        }
        results["samples"].setdefault(case, []).append(sample)
        print(case, json.dumps(sample), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
