"""kvstore: a persistent, disk-backed KV snapshot store for MLX / mlx-lm."""

from .adapters import UnsupportedCacheError
from .generate import stream_generate
from .index import StoreError
from .salts import Tenant
from .store import KVStore

__all__ = [
    "KVStore",
    "StoreError",
    "Tenant",
    "UnsupportedCacheError",
    "stream_generate",
]
__version__ = "0.1.0"
