"""How kvstore's requirements resolve per platform: on Linux MLX's build is left to the
user (each build ships mlx/lib/libmlx.so, so requiring one replaces another)."""

import subprocess
import sys
from importlib import metadata

import pytest
from packaging.requirements import Requirement

MLX_DISTS = {"mlx", "mlx-cpu", "mlx-cuda-12", "mlx-cuda-13", "mlx-metal"}


def _requires(platform: str, extra: str = "") -> dict:
    """Name -> extras of kvstore's requirements on ``platform`` with ``extra``."""
    env = {
        "linux": {"sys_platform": "linux", "platform_system": "Linux"},
        "darwin": {"sys_platform": "darwin", "platform_system": "Darwin"},
    }[platform]
    out = {}
    for line in metadata.requires("kvstore") or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(env | {"extra": extra}):
            out[req.name.lower()] = set(req.extras)
    return out


def test_linux_without_extras_requires_no_mlx_build():
    assert not MLX_DISTS & set(_requires("linux")), _requires("linux")
    assert "mlx-lm" in _requires("linux")


@pytest.mark.parametrize("extra", ["cpu", "cuda12", "cuda13"])
def test_linux_extras_pick_one_build(extra):
    reqs = _requires("linux", extra)
    assert reqs.get("mlx") == {extra}
    assert not (MLX_DISTS - {"mlx"}) & set(reqs)


def test_macos_requires_plain_mlx():
    assert _requires("darwin").get("mlx") == set()
    assert _requires("darwin", "cpu").get("mlx") == set()  # the extra adds nothing


def test_import_without_mlx_says_what_to_install():
    code = "import sys; sys.modules['mlx'] = None; import kvstore"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 1
    assert "kvstore needs MLX" in run.stderr and "kvstore[cpu]" in run.stderr
