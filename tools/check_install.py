"""Check that installing kvstore leaves an environment's MLX build as it was.

MLX's Linux builds (``mlx-cpu``, ``mlx-cuda-12``, ``mlx-cuda-13``) each ship
``mlx/lib/libmlx.so``; a package that required one would replace another's library on
install. This tool records, in the target environment, which MLX distributions are
installed, which one owns ``libmlx.so`` (and its sha256), which file a process maps and
``mx.default_device()``; then installs kvstore from this checkout and records it all
again. It exits 1 if anything changed.

Examples::

    # a fresh venv holding MLX's CUDA 13 build (no GPU needed: the files are compared,
    # and the device where one can be created)
    python tools/check_install.py --venv /tmp/ci-cuda \\
        --mlx "--no-deps mlx==0.32.4 mlx-cuda-13==0.32.4"

    # an existing environment with no network (the wheels kvstore needs in a folder)
    python tools/check_install.py --python /opt/torch/.venv/bin/python \\
        --pip-args "--no-index --find-links .gpu/a --no-build-isolation"
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run in the target environment: prints one JSON object.
PROBE = r"""
import hashlib, importlib.util, json, os, sys
from importlib import metadata
out = {"dists": {}, "owner": None, "lib_sha256": None, "mapped": None, "device": None}
for d in metadata.distributions():
    name = (d.metadata["Name"] or "").lower().replace("_", "-")
    if name.startswith("mlx") and name != "mlx-lm":
        out["dists"][name] = d.version
        if any(str(f).replace(os.sep, "/") == "mlx/lib/libmlx.so" for f in d.files or []):
            out["owner"] = name
spec = importlib.util.find_spec("mlx")
lib = spec and os.path.join(spec.submodule_search_locations[0], "lib", "libmlx.so")
if lib and os.path.exists(lib):
    h = hashlib.sha256()
    with open(lib, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    out["lib_sha256"] = h.hexdigest()
try:
    import mlx.core as mx
    mx.eval(mx.ones(4) * 2)
    out["device"] = str(mx.default_device())
except Exception as e:  # no GPU here, no MLX at all: recorded, compared as is
    out["device"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
if os.path.exists("/proc/self/maps"):
    with open("/proc/self/maps") as f:
        paths = {l.split()[-1] for l in f if l.rstrip().endswith("libmlx.so")}
    out["mapped"] = sorted(paths) or None
print(json.dumps(out))
"""


def probe(python: str) -> Dict:
    run = subprocess.run(
        [python, "-c", PROBE], capture_output=True, text=True, check=True
    )
    return json.loads(run.stdout.strip().splitlines()[-1])


def pip(python: str, args: List[str]) -> None:
    print("+ pip install " + " ".join(args), flush=True)
    subprocess.run([python, "-m", "pip", "install", "-q", *args], check=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--python", help="an existing environment's interpreter")
    where.add_argument("--venv", help="make a fresh virtualenv here first")
    p.add_argument(
        "--mlx",
        default="",
        help="pip arguments that install MLX into the environment first",
    )
    p.add_argument(
        "--pip-args", default="", help="extra arguments for installing kvstore"
    )
    p.add_argument("--project", default=ROOT, help="the kvstore checkout to install")
    p.add_argument("--json", help="write both records and the verdict here")
    a = p.parse_args(argv)

    python = a.python
    if a.venv:
        subprocess.run([sys.executable, "-m", "venv", a.venv], check=True)
        python = os.path.join(a.venv, "bin", "python")
    if a.mlx:
        pip(python, shlex.split(a.mlx))
    before = probe(python)
    print("before:", json.dumps(before), flush=True)
    pip(python, [*shlex.split(a.pip_args), a.project])
    after = probe(python)
    print("after: ", json.dumps(after), flush=True)

    changed = [k for k in before if before[k] != after[k]]
    for k in changed:
        print(f"CHANGED {k}: {before[k]} -> {after[k]}")
    if not before["dists"]:
        print("note: no MLX build was installed before; nothing to keep")
    print("FAIL: installing kvstore changed MLX" if changed else "OK: MLX kept")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"before": before, "after": after, "changed": changed}, f)
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
