"""The "after a restart" case: a fresh process loads the model, opens the store and
restores one prompt. Run by :mod:`kvstore.bench` as
``python -m kvstore.bench.child ARGS.json`` and prints one JSON line. A spec with a
``case`` runs one of :mod:`kvstore.bench.cases` instead.

A fresh process matters: its first evaluation of new arrays pays the page faults of
new memory, which a warm process never shows.
"""

import json
import sys
import time
from dataclasses import asdict


def run(spec: dict) -> dict:
    """Load, open, fetch (and run the first token when ``spec["forward"]``)."""
    t_start = time.perf_counter()
    import mlx.core as mx

    from kvstore.bench.measure import minor_faults, timed_fetch
    from kvstore.bench.models import first_token, load

    from ..store import KVStore

    t_import = time.perf_counter()
    model, tokenizer = load(spec["model"])
    t_model = time.perf_counter()
    store = KVStore(
        spec["store"], model, tokenizer, chunk_tokens=spec["chunk_tokens"], ram_bytes=0
    )
    t_open = time.perf_counter()
    tokens = spec["tokens"]
    faults = minor_faults()
    phases, cache = timed_fetch(store, tokens, expect=spec["expect"])
    faults = minor_faults() - faults
    forward = None
    if spec["forward"]:
        t0 = time.perf_counter()
        first_token(model, cache, tokens[phases.tokens :])
        forward = time.perf_counter() - t0
    store.close()
    del cache
    mx.clear_cache()
    out = {
        "import_s": t_import - t_start,
        "model_load_s": t_model - t_import,
        "open_s": t_open - t_model,
        "fetch": asdict(phases),
        "fetch_faults": faults,
        "forward_s": forward,
    }
    out["fetch"].pop("parts")
    return out


def spawn(spec: dict, tmp: str) -> dict:
    """Run :func:`run` in a fresh Python process; returns its result plus the wall time
    of the whole process as seen from here."""
    import os
    import subprocess

    path = os.path.join(tmp, "restart-spec.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    env = dict(os.environ)
    # The child must import this very kvstore (a worktree, say), not another install.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "kvstore.bench.child", path],
        capture_output=True,
        text=True,
        env=env,
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(
            f"restart child failed ({proc.returncode}):\n{proc.stderr[-2000:]}"
        )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["process_wall_s"] = wall
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        spec = json.load(f)
    if "case" in spec:  # one measured case (kvstore.bench.cases)
        from kvstore.bench.cases import run as run_case

        print(json.dumps(run_case(spec)), flush=True)
        return 0
    print(json.dumps(run(spec)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
