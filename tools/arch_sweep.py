#!/usr/bin/env python
"""Every architecture mlx-lm ships, through kvstore: restored equals computed.

Usage::

    python tools/arch_sweep.py [--test-models PATH] [--only TYPE ...] [--first]
                               [--markdown OUT]

The tiny configurations come from mlx-lm's own ``tests/test_models.py`` (every
``ModelArgs(...)`` / ``ModelArgs.from_dict({...})`` with literal arguments, and the
list in ``test_all_models``). The wheel does not ship its tests: without
``--test-models`` the file is taken from the source distribution of the installed
mlx-lm (``pip download mlx-lm==VERSION --no-binary :all: --no-deps``, unpacked in
a temp dir).

For each configuration (random weights, float32), with 16-token chunks:

1. ``KVStore(...)``: a layout kvstore cannot store must be refused here, with an
   ``UnsupportedCacheError`` naming the layer (row ``refused``);
2. the caller's own cache, computed over 24 tokens and ``save``d, then 16 more
   tokens and ``save``d again (checkpoints at 24 and 40 for state layouts);
   ``save`` must not raise and must not refuse the cache;
3. a new ``KVStore`` object on the same directory, RAM tier off: ``fetch`` of the 40
   tokens + 4 more (expects 40 restored), and of a prompt that leaves the stored one
   at token 30 (nearest prefix: 30 for delta layouts, the checkpoint at 24 for
   state layouts); the rest is computed. The logits must be ``allclose`` (atol 1e-4,
   rtol 1e-3), with equal argmax and equal greedy tokens (3 steps), to the caller's
   own cache (the restored prefix computed in the caller's steps, then the rest) and
   to a cold computation of the whole prompt in one pass.

Rows: ``ok``; ``ok*`` when the restore equals the caller's cache but the model itself
gives other logits when a prompt is prefilled in steps than in one pass (then no
store can match the one-pass result); ``refused`` at open; ``skipped`` when the
configuration does not run here (Metal-only kernels, a missing package); ``FAIL``.
Exits 1 if any row is ``FAIL``. This is a tool, not a test: pytest never collects it
(``tests/test_cache_types.py`` runs one tiny model of each cache family).
"""

import argparse
import ast
import glob
import importlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from typing import Any, Dict, List, Tuple

import mlx.core as mx
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvstore import KVStore, UnsupportedCacheError  # noqa: E402

CHUNK = 16
FIRST, PROMPT, NEAR = (
    24,
    40,
    30,
)  # saved at FIRST and PROMPT; NEAR: where a query leaves
STEPS = 3


# -- configurations -------------------------------------------------------------------


def fetch_test_models(version: str, dest: str) -> str:
    """``tests/test_models.py`` of mlx-lm ``version``'s source distribution."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            f"mlx-lm=={version}",
            "--no-binary",
            ":all:",
            "--no-deps",
            "-d",
            dest,
        ],
        check=True,
    )
    (sdist,) = glob.glob(os.path.join(dest, "mlx_lm-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        member = next(
            m for m in tar.getmembers() if m.name.endswith("tests/test_models.py")
        )
        try:
            tar.extract(member, dest, filter="data")
        except TypeError:  # Python before 3.10.12 / 3.11.4: no extraction filters
            tar.extract(member, dest)
    return os.path.join(dest, member.name)


def _literal(node) -> Tuple[bool, Any]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def configs_from(path: str) -> Tuple[List[Tuple[str, Dict[str, Any]]], int]:
    """``([(test name, config)], number skipped)`` from mlx-lm's test file: configs
    built from literals only, each with a ``model_type``; exact duplicates dropped."""
    tree = ast.parse(open(path).read())
    found, skipped = [], 0
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef) or not fn.name.startswith("test_"):
            continue
        for node in ast.walk(fn):
            config = None
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "test_configs" for t in node.targets
            ):
                for element in getattr(node.value, "elts", ()):
                    ok, value = _literal(element)
                    if ok and isinstance(value, dict) and "model_type" in value:
                        found.append((fn.name, value))
                    else:
                        skipped += 1
                continue
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == "ModelArgs":
                pairs = [(k.arg, _literal(k.value)) for k in node.keywords if k.arg]
                if node.args or any(not ok for _, (ok, _) in pairs):
                    skipped += 1
                    continue
                config = {k: v for k, (_, v) in pairs}
            elif (
                isinstance(f, ast.Attribute)
                and f.attr == "from_dict"
                and isinstance(f.value, ast.Attribute)
                and f.value.attr == "ModelArgs"
                and len(node.args) == 1
            ):
                ok, config = _literal(node.args[0])
                if not ok:
                    skipped += 1
                    continue
            if isinstance(config, dict) and "model_type" in config:
                found.append((fn.name, config))
    out, seen = [], set()
    for name, config in found:
        key = json.dumps(config, sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            out.append((name, config))
    return out, skipped


# -- one configuration ------------------------------------------------------------------


SMALL_PARAMS = 20_000_000
MAX_PARAMS = 200_000_000


def _module(model_type: str):
    """The mlx-lm module of ``model_type``, remapped as ``mlx_lm.load`` does."""
    from mlx_lm.utils import MODEL_REMAPPING

    return importlib.import_module(
        f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}"
    )  # a "tiny" configuration that is not: a real model's sizes


def build(config: Dict[str, Any], max_params: int = None):
    from mlx.utils import tree_flatten

    arch = _module(config["model_type"])
    mx.random.seed(0)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    # Parameters are lazy until evaluated: count them before any memory is used.
    n = sum(p.size for _, p in tree_flatten(model.parameters()))
    if n > (max_params or MAX_PARAMS):
        raise NotTiny(f"{n / 1e6:.0f}M parameters")
    mx.eval(model.parameters())
    return model


class NotTiny(ValueError):
    """A test configuration with a real model's sizes (mlx-lm runs it on a Mac)."""


_SHRINK = {  # the usual names, and those of GPT-J and OpenELM
    "num_hidden_layers": 4,
    "n_layer": 4,
    "num_transformer_layers": 4,
    "hidden_size": 256,
    "n_embd": 256,
    "model_dim": 256,
    "intermediate_size": 512,
    "vocab_size": 1000,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_head": 4,
    "head_dim": 64,
    "kv_channels": 64,
}


def shrunk(config: Dict[str, Any]) -> Dict[str, Any]:
    """``config`` with its sizes cut to a tiny model's, defaults included."""
    arch = _module(config["model_type"])
    args = arch.ModelArgs.from_dict(config)
    out = dict(config)
    for key, most in _SHRINK.items():
        value = config.get(key, getattr(args, key, None))
        if isinstance(value, int) and value > most:
            out[key] = most
    return out


def build_small(config: Dict[str, Any]):
    """``(model, note)``: the configuration as given when small; else with its sizes
    cut (MLX's CPU back end is slow here), or as given if the cut one does not run
    and the original fits in memory."""
    try:
        return build(config, max_params=SMALL_PARAMS), ""
    except NotTiny as e:
        note = f"sizes cut down (was {e})"
    try:
        model = build(shrunk(config))
        logits(model, None, [0])
        return model, note
    except NotTiny:
        raise
    except Exception:
        return build(config), ""


def logits(model, cache, tokens: List[int]) -> mx.array:
    out = model(mx.array(tokens)[None], cache=cache)[0, -1].astype(mx.float32)
    mx.eval(out)
    return out


def _same(model, warm_cache, warm, ref_cache, ref) -> Tuple[bool, float]:
    """Logits allclose, equal argmax, equal greedy tokens; and the max abs diff."""
    # Equal entries (masked vocabulary: -inf) count as equal; others as allclose.
    gap = mx.where(warm == ref, 0.0, mx.abs(warm - ref))
    diff = gap.max().item()
    ok = mx.all(gap <= 1e-4 + 1e-3 * mx.abs(ref)).item()
    ok = ok and mx.argmax(warm).item() == mx.argmax(ref).item()
    for _ in range(STEPS):
        a, b = int(mx.argmax(warm).item()), int(mx.argmax(ref).item())
        if not ok or a != b:
            return False, diff
        warm, ref = logits(model, warm_cache, [a]), logits(model, ref_cache, [b])
    return bool(ok), diff


def compare(model, store, prompt: List[int], query: List[int]) -> Dict[str, Any]:
    """Restore ``query``'s stored prefix and compute the rest; compare with a cold
    computation of the whole prompt in one pass, and with the caller's own cache:
    the stored ``prompt`` computed in the caller's steps, cut back to the restored
    length (delta layers), then the rest."""
    warm_cache, n = store.fetch(query)
    warm = logits(model, warm_cache, query[n:])
    cold_cache = store.new_cache()
    cold = logits(model, cold_cache, query)
    steps_cache = store.new_cache()
    for s, e in ((0, FIRST), (FIRST, PROMPT)):
        if s < n:
            logits(model, steps_cache, prompt[s:e])
    excess = (FIRST if n <= FIRST else PROMPT) - n
    if excess and n:  # only delta layouts restore between the caller's steps
        for c in steps_cache:
            c.trim(excess)
    steps = logits(model, steps_cache, query[n:])
    cold_ok, cold_diff = _same(model, warm_cache, warm, cold_cache, cold)
    warm_cache, _ = store.fetch(query)  # the greedy steps moved it on
    warm = logits(model, warm_cache, query[n:])
    steps_ok, steps_diff = _same(model, warm_cache, warm, steps_cache, steps)
    return {
        "n": n,
        "diff": cold_diff,
        "cold_ok": cold_ok,
        "steps_ok": steps_ok,
        "steps_diff": steps_diff,
    }


def sweep_one(config: Dict[str, Any], root: str) -> Dict[str, Any]:
    row: Dict[str, Any] = {"model_type": config["model_type"]}
    tic = time.perf_counter()
    try:
        model, row["shrunk"] = build_small(config)
        vocab = logits(model, None, [0]).shape[-1]
    except (Exception, SystemExit) as e:  # does not run here (olmo's import exits)
        row.update(result="skipped", note=f"model does not build/run: {_short(e)}")
        return row
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, vocab, size=PROMPT).tolist()
    extra = rng.integers(0, vocab, size=8).tolist()
    extra[0] = (prompt[NEAR] + 1) % vocab  # the nearest-prefix query leaves at NEAR
    path = os.path.join(root, "store")
    try:
        store = KVStore(path, model, chunk_tokens=CHUNK)
    except UnsupportedCacheError as e:
        row.update(result="refused", note=str(e))
        return row
    except Exception as e:
        row.update(result="FAIL", note=f"KVStore() raised {_short(e)}")
        return row
    row["caches"] = "+".join(sorted({leaf.cls for leaf in store.layout.leaves}))
    row["mode"] = "state" if store.layout.has_state else "delta"
    try:
        with store:
            cache = store.new_cache()
            logits(model, cache, prompt[:FIRST])
            store.save(prompt[:FIRST], cache)
            logits(model, cache, prompt[FIRST:])
            store.save(prompt, cache)
            store.flush()
            stats = store.stats()
    except Exception as e:
        row.update(result="FAIL", note=f"save raised {_short(e)}")
        return row
    if stats["saves_refused"] or stats["errors"] or stats.get("writes_failed"):
        row.update(result="FAIL", note=f"save refused or failed: {stats}")
        return row
    try:
        with KVStore(path, model, chunk_tokens=CHUNK, ram_bytes=0) as again:
            exact = compare(model, again, prompt, prompt + extra[:4])
            near = compare(model, again, prompt, prompt[:NEAR] + extra)
            stats = again.stats()
    except Exception as e:
        row.update(result="FAIL", note=f"fetch/compare raised {_short(e)}")
        return row
    want_near = FIRST if row["mode"] == "state" else NEAR
    row.update(
        exact_n=exact["n"],
        near_n=near["n"],
        diff=max(exact["diff"], near["diff"]),
        steps_diff=max(exact["steps_diff"], near["steps_diff"]),
        seconds=round(time.perf_counter() - tic, 1),
    )
    problems, notes = [], []
    if not exact["steps_ok"] or not near["steps_ok"]:
        problems.append(
            "restored logits differ from the caller's own cache "
            f"(max diff {max(exact['steps_diff'], near['steps_diff']):.1e})"
        )
    elif not exact["cold_ok"] or not near["cold_ok"]:
        # The model itself: prefilling in steps differs from one pass (a sliding
        # window attending across a step, say). The store gave back what was saved.
        notes.append(
            "the model's own prefill in steps (24 + 16 tokens) differs from one pass; "
            "restored equals the caller's cache"
        )
    if exact["n"] != PROMPT:
        problems.append(f"exact prompt restored {exact['n']}, not {PROMPT}")
    if near["n"] != want_near:
        problems.append(f"nearest prefix restored {near['n']}, not {want_near}")
    if stats["errors"] or stats["corrupt"]:
        problems.append(f"errors {stats['errors']}, corrupt {stats['corrupt']}")
    row["result"] = "FAIL" if problems else ("ok*" if notes else "ok")
    extra = [row["shrunk"]] if row.get("shrunk") else []
    row["note"] = "; ".join(problems + notes + extra)
    return row


def _short(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return text if len(text) < 160 else text[:157] + "..."


# -- main -------------------------------------------------------------------------------


def table(rows: List[Dict[str, Any]]) -> str:
    head = (
        "| model_type | cache classes | stored as | result | restored (exact / nearest) "
        "| max abs logit diff vs one pass | vs caller's steps | note |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        n = f"{r['exact_n']} / {r['near_n']}" if "exact_n" in r else ""
        diff = f"{r['diff']:.1e}" if "diff" in r else ""
        diff += f" | {r['steps_diff']:.1e}" if "steps_diff" in r else " | "
        note = r.get("note", "").replace("|", "\\|")
        lines.append(
            f"| {r['label']} | {r.get('caches', '')} | {r.get('mode', '')} | "
            f"{r['result']} | {n} | {diff} | {note} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    from kvstore.platform.compat import mlx_lm_version

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--test-models",
        help="mlx-lm's tests/test_models.py (default: "
        "from the installed version's source distribution)",
    )
    p.add_argument("--only", nargs="+", help="these model types only")
    p.add_argument(
        "--first",
        action="store_true",
        help="one configuration per model type (the first found)",
    )
    p.add_argument("--markdown", help="also write the table here")
    args = p.parse_args(argv)

    version = mlx_lm_version()
    with tempfile.TemporaryDirectory(prefix="arch-sweep-") as tmp:
        path = args.test_models or fetch_test_models(version, tmp)
        configs, skipped = configs_from(path)
    if args.only:
        configs = [(n, c) for n, c in configs if c["model_type"] in args.only]
    if args.first:
        seen, firsts = set(), []
        for n, c in configs:
            if c["model_type"] not in seen:
                seen.add(c["model_type"])
                firsts.append((n, c))
        configs = firsts
    counts: Dict[str, int] = {}
    for _, c in configs:
        counts[c["model_type"]] = counts.get(c["model_type"], 0) + 1
    print(
        f"mlx-lm {version}, mlx {mx.__version__}: {len(configs)} configurations of "
        f"{len(counts)} model types ({skipped} non-literal ModelArgs calls skipped)",
        flush=True,
    )
    rows, index = [], {}
    for name, config in configs:
        mt = config["model_type"]
        index[mt] = index.get(mt, 0) + 1
        with tempfile.TemporaryDirectory(prefix="arch-sweep-") as root:
            try:
                row = sweep_one(config, root)
            except Exception as e:  # a bug in the sweep itself: show it, go on
                traceback.print_exc()
                row = {
                    "model_type": mt,
                    "result": "FAIL",
                    "note": f"sweep: {_short(e)}",
                }
        row["label"] = mt if counts[mt] == 1 else f"{mt} ({name} #{index[mt]})"
        rows.append(row)
        print(
            f"{row['label']:<48} {row['result']:<8} {row.get('caches', ''):<40} "
            f"{row.get('note', '')[:120]}",
            flush=True,
        )
    print()
    print(table(rows))
    totals: Dict[str, int] = {}
    for r in rows:
        totals[r["result"]] = totals.get(r["result"], 0) + 1
    print("\n" + ", ".join(f"{v} {k}" for k, v in sorted(totals.items())))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table(rows) + "\n")
    return 0 if set(totals) <= {"ok", "ok*", "refused", "skipped"} else 1


if __name__ == "__main__":
    sys.exit(main())
