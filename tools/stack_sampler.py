"""Where a server's threads spend their time: their Python stacks, sampled.

``tools/bench_serve_gpu.py --sample-stacks`` starts one in each server it launches
(plain ``mlx_lm.server`` and ``kvstore serve`` alike): every ``interval`` seconds a
daemon thread takes the stack of every other thread that is not parked in a wait
(a lock, a queue, a socket's accept) and appends one JSON line per busy thread to a
file, flushed each second and when the process ends: ``{"t": wall-clock seconds,
"thread": name, "stack": ["file:function:line", ...]}``, innermost frame first.
Lined up with the benchmark's ``sent_at`` times, it says what the generation
thread did between a round's arrival and its first token, in both servers.

Summarize a file: ``python tools/stack_sampler.py FILE --since T0 --until T1
[--thread NAME]`` (counts of each innermost kvstore/mlx frame, and of whole stacks).
"""

import argparse
import atexit
import collections
import json
import os
import signal
import sys
import threading
import time
from typing import List, Optional

# Innermost frames of a thread that is waiting, not working.
PARKED = (
    "threading.py:wait",
    "threading.py:_wait_for_tstate_lock",
    "queue.py:get",
    "selectors.py:select",
    "socketserver.py:serve_forever",
    "socket.py:accept",
    "socket.py:readinto",
    "thread.py:_worker",
    "concurrent/futures/thread.py:_worker",
)
DEPTH = 14


def _frames(frame, depth: int = DEPTH) -> List[str]:
    out = []
    while frame is not None and len(out) < depth:
        code = frame.f_code
        path = code.co_filename
        short = "/".join(path.split(os.sep)[-2:])
        out.append(f"{short}:{code.co_name}:{frame.f_lineno}")
        frame = frame.f_back
    return out


def _parked(stack: List[str]) -> bool:
    top = stack[0] if stack else ""
    name = top.rsplit(":", 1)[0]
    return any(name.endswith(p) for p in PARKED)


class StackSampler:
    """Samples the stacks of this process's threads into ``path`` (JSON lines)."""

    def __init__(self, path: str, *, interval: float = 0.01):
        self.path = path
        self.interval = interval
        self._lines: List[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="stack-sampler", daemon=True
        )

    def start(self) -> None:
        self._thread.start()
        atexit.register(self.flush)
        previous = signal.getsignal(signal.SIGTERM)

        def on_term(signum, frame):  # servers are stopped by SIGTERM
            self.flush()
            if callable(previous):
                previous(signum, frame)
            else:  # the default: end at once, as the server would have
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGTERM, on_term)
        # kvstore serve handles SIGTERM itself and ends with os._exit (no atexit).
        real_exit = os._exit

        def exit_flushed(status):
            self.flush()
            real_exit(status)

        os._exit = exit_flushed

    def _run(self) -> None:
        own = threading.get_ident()
        last_flush = time.monotonic()
        while not self._stop.wait(self.interval):
            now = time.time()
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == own:
                    continue
                stack = _frames(frame)
                if _parked(stack):
                    continue
                line = json.dumps(
                    {
                        "t": round(now, 4),
                        "thread": names.get(ident, str(ident)),
                        "stack": stack,
                    }
                )
                with self._lock:
                    self._lines.append(line)
            if time.monotonic() - last_flush > 1.0:
                self.flush()
                last_flush = time.monotonic()

    def trace_steps(self) -> None:
        """Also time every ``BatchGenerator.next()`` of mlx-lm's generation loop (a
        ``"step"`` line: start, seconds, prompt and generation responses)."""
        import importlib

        generate = importlib.import_module("mlx_lm.generate")  # not the function
        base = generate.BatchGenerator
        sampler = self

        def next_step(self, *args, **kwargs):
            tic = time.time()
            out = next_step.wrapped(self, *args, **kwargs)
            parts = out if isinstance(out, tuple) else ((), out)
            line = json.dumps(
                {
                    "t": round(tic, 4),
                    "thread": "step",
                    "dur": round(time.time() - tic, 4),
                    "prompts": len(parts[0] or ()),
                    "tokens": len(parts[-1] or ()),
                }
            )
            with sampler._lock:
                sampler._lines.append(line)
            return out

        next_step.wrapped = base.next
        base.next = next_step

    def flush(self) -> None:
        with self._lock:
            lines, self._lines = self._lines, []
        if lines:
            with open(self.path, "a") as f:
                f.write("\n".join(lines) + "\n")


def summarize(
    path: str,
    *,
    since: float = 0.0,
    until: float = float("inf"),
    thread: Optional[str] = None,
    top: int = 25,
) -> None:
    tops = collections.Counter()
    stacks = collections.Counter()
    threads = collections.Counter()
    with open(path) as f:
        for line in f:
            s = json.loads(line)
            if "stack" not in s:
                continue
            if not since <= s["t"] <= until:
                continue
            if thread and not s["thread"].startswith(thread):
                continue
            threads[s["thread"]] += 1
            tops[s["stack"][0]] += 1
            stacks[" < ".join(s["stack"][:6])] += 1
    print("samples per thread:", dict(threads))
    print("innermost frames:")
    for k, n in tops.most_common(top):
        print(f"  {n:6d}  {k}")
    print("stacks (6 frames):")
    for k, n in stacks.most_common(top):
        print(f"  {n:6d}  {k}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file")
    p.add_argument("--since", type=float, default=0.0, help="wall-clock seconds")
    p.add_argument("--until", type=float, default=float("inf"))
    p.add_argument("--thread", help="a thread name's start")
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args(argv)
    summarize(a.file, since=a.since, until=a.until, thread=a.thread, top=a.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
