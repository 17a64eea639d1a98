"""kvstore: a persistent, disk-backed KV snapshot store for MLX / mlx-lm."""

try:
    import mlx.core  # noqa: F401
except ImportError as e:  # on Linux MLX's build is the user's to install
    raise ImportError(
        f"kvstore needs MLX, which cannot be imported here ({e}). On Linux install "
        "one build of it: pip install 'kvstore[cpu]' (CPU), 'kvstore[cuda13]' or "
        "'kvstore[cuda12]' (NVIDIA GPUs); on macOS: pip install mlx"
    ) from e

from .disk.adapters import UnsupportedCacheError
from .disk.index import StoreError
from .disk.salts import Tenant
from .generate import stream_generate
from .store import KVStore

__all__ = [
    "KVStore",
    "StoreError",
    "Tenant",
    "UnsupportedCacheError",
    "stream_generate",
]
__version__ = "0.1.0"
