"""Profile one server's generation loop under load with py-spy (``pip install py-spy``).

Starts ``kvstore serve`` or plain ``mlx_lm.server`` (as ``tools/bench_serve.py``
does), sends one request holding the system prompt, then records the process with
``py-spy record --threads --idle`` while ``--batches`` levels of ``--clients``
streaming clients run, and prints the generation thread's samples by leaf frame and
the samples spent in kvstore's own code (a kvstore frame with no mlx-lm frame below
it). Run it once per server, one after the other, and compare.

    python tools/profile_serve.py kvstore --model $KVSTORE_HOME/models/SmolLM2-135M-Instruct
    python tools/profile_serve.py plain --model $KVSTORE_HOME/models/SmolLM2-135M-Instruct
"""

import argparse
import collections
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_serve  # noqa: E402


def summarize(raw_path: str, top: int = 8) -> None:
    """Print the generation thread's leaf frames and kvstore's own samples."""
    leaves, own, total = collections.Counter(), collections.Counter(), 0
    with open(raw_path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            frames = stack.split(";")
            if "_run_generate" not in frames[0]:
                continue
            total += int(n)
            leaves[frames[-1]] += int(n)
            ours = [i for i, fr in enumerate(frames) if re.search(r"\(kvstore/", fr)]
            if ours and not any("mlx_lm/" in fr for fr in frames[ours[-1] + 1 :]):
                own[frames[ours[-1]]] += int(n)
    print(f"generation thread: {total} samples")
    for frame, n in leaves.most_common(top):
        print(f"  {n:6d}  {frame}")
    print(f"kvstore's own code: {sum(own.values())} samples")
    for frame, n in own.most_common(top):
        print(f"  {n:6d}  {frame}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("server", choices=["kvstore", "plain"])
    p.add_argument("--model", required=True, help="an mlx-lm model directory")
    p.add_argument("--system-tokens", type=int, default=256)
    p.add_argument("--user-tokens", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--batches", type=int, default=3)
    p.add_argument("--seconds", type=int, default=45, help="py-spy's duration")
    p.add_argument("--out", default="profile-serve.txt", help="py-spy's raw output")
    args = p.parse_args(argv)

    work = tempfile.mkdtemp(prefix="profile-serve-")
    text = bench_serve.Texts(args.model, None)
    system = text.make(random.Random(0), args.system_tokens - 4)

    def body(tag):
        user = text.make(random.Random(repr(tag)), args.user_tokens)
        return bench_serve.chat(system, user, args.max_tokens, text.eos)

    cmd = ["mlx_lm", "server", "--model", args.model]
    if args.server == "kvstore":
        cmd = ["kvstore", "serve", "--model", args.model, "--store", f"{work}/store"]
    server = bench_serve.Server(args.server, cmd, work)
    try:
        first = bench_serve.stream(server.port, body("warm"))
        server.settle()
        print(f"first request TTFT {first['ttft'] * 1e3:.0f} ms")
        spy = subprocess.Popen(
            ["py-spy", "record", "-p", str(server.proc.pid), "--threads", "--idle"]
            + ["-r", "50", "-f", "raw", "-o", args.out, "-d", str(args.seconds)]
        )
        time.sleep(2)  # py-spy attaches
        for b in range(args.batches):
            level = bench_serve.run_level(
                server, [[body((b, c))] for c in range(args.clients)]
            )
            ttfts = ", ".join(f"{t * 1e3:.0f}" for t in level["ttft"])
            print(f"batch {b}: wall {level['wall']:.2f} s, TTFT ms {ttfts}")
        spy.wait()
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    summarize(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
