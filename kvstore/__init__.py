"""kvstore: a persistent, disk-backed KV snapshot store for MLX / mlx-lm.

The public names are imported on first use: ``python -m kvstore stats`` and the other
commands that run no model start without loading MLX, mlx-lm and transformers.
"""

import importlib
import importlib.util

_NEEDS_MLX = (
    "kvstore needs MLX, which cannot be imported here ({}). On Linux install "
    "one build of it: pip install 'kvstore[cpu]' (CPU), 'kvstore[cuda13]' or "
    "'kvstore[cuda12]' (NVIDIA GPUs); on macOS: pip install mlx"
)


def _mlx_missing() -> str:
    """Why MLX cannot be imported here, or "" (a look-up only: nothing is loaded)."""
    try:
        found = importlib.util.find_spec("mlx") is not None
    except (ImportError, ValueError) as e:
        return str(e)
    return "" if found else "No module named 'mlx'"


if _mlx_missing():  # on Linux MLX's build is the user's to install
    raise ImportError(_NEEDS_MLX.format(_mlx_missing()))

# Public name -> the module that defines it.
_EXPORTS = {
    "KVStore": ".store",
    "StoreError": ".disk.index",
    "Tenant": ".disk.salts",
    "UnsupportedCacheError": ".disk.adapters",
    "stream_generate": ".generate",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    try:
        module = importlib.import_module(_EXPORTS[name], __name__)
    except ImportError as e:
        if e.name is None or e.name.split(".")[0] != "mlx":
            raise
        raise ImportError(_NEEDS_MLX.format(e)) from e
    value = getattr(module, name)
    globals()[name] = value  # the next look-up is a plain attribute
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
