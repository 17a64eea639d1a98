#!/usr/bin/env python
"""Run kvstore's store, cache-type and server tests against each end of the
supported mlx-lm range, each in a virtualenv of its own.

Usage::

    python tools/mlx_lm_range.py [--versions 0.32.0 0.32.2] [--venvs DIR]
                                 [--tests tests/test_store.py ...] [--json OUT]

For each mlx-lm version: a virtualenv under ``--venvs`` (kept between runs; made on
first use), ``pip install -e ".[cpu,test]" mlx-lm==VERSION`` (this checkout; a version
outside ``pyproject.toml``'s range is forced in afterwards, to see what breaks), then ``python -m pytest`` of the
suites below with ``-m "not model"`` (the real model's tests do not depend on the
mlx-lm version more than the tiny models' do, and take minutes), and ``kvstore
serve``'s start-up check (:mod:`kvstore.platform.compat`) run in that venv. Prints one row per
version; nothing is asserted. The default versions are the ends of
:data:`kvstore.platform.compat.SUPPORTED_RANGE`. This is a tool, not a test: pytest never
collects it.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DEFAULT_TESTS = [
    "tests/test_store.py",
    "tests/test_cache_types.py",
    "tests/test_server.py",
    "tests/test_serve_processes.py",
    "tests/test_serve_prefetch.py",
    "tests/test_serve_saves.py",
    "tests/test_serve_shared.py",
    "tests/test_serve_ramtrie.py",
    "tests/test_serve_salts.py",
    "tests/test_compat.py",
]

# The check `kvstore serve` runs at start, printed as one JSON line.
_PROBE = """
import json, importlib.metadata as md
from kvstore.platform import compat
from kvstore.server import PersistentPromptCache
problems = compat.server_problems(cache_class=PersistentPromptCache)
print(json.dumps({
    "mlx_lm": md.version("mlx-lm"), "mlx": md.version("mlx"),
    "transformers": md.version("transformers"), "problems": problems}))
"""


def run(cmd, *, cwd=ROOT, env=None, log=None) -> subprocess.CompletedProcess:
    """Run ``cmd``; its output goes to ``log`` (a file) and is returned."""
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if log is not None:
        log.write(f"$ {' '.join(cmd)}\n{p.stdout}{p.stderr}\nexit {p.returncode}\n")
        log.flush()
    return p


def make_venv(path: str, version: str, log) -> str:
    """The venv's python, with this checkout and ``mlx-lm==version`` installed."""
    python = os.path.join(path, "bin", "python")
    if not os.path.exists(python):
        p = run([sys.executable, "-m", "venv", path], log=log)
        if p.returncode:
            raise RuntimeError(f"venv {path}: {p.stderr.strip()}")
    from kvstore.platform.compat import SUPPORTED_RANGE

    pip = [python, "-m", "pip", "install", "-q"]
    if SUPPORTED_RANGE.contains(version):
        steps = [pip + ["-e", ".[cpu,test]", f"mlx-lm=={version}"]]
    else:  # outside the declared range: install, then force the version in
        steps = [pip + ["-e", ".[cpu,test]"], pip + [f"mlx-lm=={version}"]]
    for cmd in steps:
        if run(cmd, log=log).returncode:
            raise RuntimeError(f"{' '.join(cmd[3:])} failed (see the log)")
    return python


def summary(output: str) -> str:
    """pytest's closing counts ("12 passed, 1 skipped"), or the last line."""
    for line in reversed(output.strip().splitlines()):
        if re.search(r"\d+ (passed|failed|error)", line):
            return line.strip("= ").split(" in ")[0]
    return (output.strip().splitlines() or ["no output"])[-1]


def main(argv=None) -> int:
    from kvstore.platform.compat import SUPPORTED_RANGE

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--versions", nargs="+", default=list(SUPPORTED_RANGE.tested))
    p.add_argument("--venvs", default=os.path.join("/tmp", "kvstore-mlx-lm-range"))
    p.add_argument("--tests", nargs="+", default=DEFAULT_TESTS)
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)

    os.makedirs(args.venvs, exist_ok=True)
    rows = []
    for version in args.versions:
        log_path = os.path.join(args.venvs, f"mlx-lm-{version}.log")
        row = {"mlx_lm": version, "log": log_path}
        with open(log_path, "w") as log:
            tic = time.monotonic()
            try:
                python = make_venv(
                    os.path.join(args.venvs, f"mlx-lm-{version}"), version, log
                )
            except RuntimeError as e:
                row.update(result=f"install failed: {e}")
                rows.append(row)
                print(f"{version}: {row['result']}", flush=True)
                continue
            row["install_s"] = round(time.monotonic() - tic, 1)
            probe = run([python, "-c", _PROBE], log=log)
            try:
                row.update(json.loads(probe.stdout.strip().splitlines()[-1]))
            except (ValueError, IndexError):
                row["problems"] = [f"start-up check did not run: {probe.stderr[-300:]}"]
            env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
            tic = time.monotonic()
            t = run(
                [
                    python,
                    "-m",
                    "pytest",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    "-m",
                    "not model",
                    *args.tests,
                ],
                env=env,
                log=log,
            )
            row["tests_s"] = round(time.monotonic() - tic, 1)
            row["result"] = summary(t.stdout)
            row["exit"] = t.returncode
        rows.append(row)
        print(
            f"{version}: {row['result']} (exit {row['exit']}, {row['tests_s']} s); "
            f"start-up check: {row.get('problems') or 'ok'}",
            flush=True,
        )

    print()
    head = f"{'mlx-lm':<8} {'mlx':<8} {'transformers':<13} {'serve check':<12} tests"
    print(head)
    print("-" * max(len(head), 60))
    for r in rows:
        check = "ok" if r.get("problems") == [] else "FAILS"
        print(
            f"{r['mlx_lm']:<8} {r.get('mlx', '-'):<8} {r.get('transformers', '-'):<13} "
            f"{check:<12} {r['result']}"
        )
        for problem in r.get("problems") or ():
            print(f"{'':<8} {problem}")
    print(f"\nsuites: {' '.join(args.tests)} (-m 'not model'); logs in {args.venvs}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r.get("exit") == 0 and r.get("problems") == [] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
