"""Turning mlx-lm cache objects into per-node tensors and back.

Only classes on the allow-list below are handled; a class name is never looked
up from anything read off disk.
"""

from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

# Allow-list of cache classes kvstore can store and rebuild.
SUPPORTED_CACHES = {"KVCache": KVCache}

# Same-size unsigned views: numpy understands them whatever the float type (bf16).
_UINT_VIEW = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


class UnsupportedCacheError(ValueError):
    """The model's cache layout has a class kvstore cannot store (yet)."""


@dataclass(frozen=True)
class LayerLayout:
    """What one layer's KV looks like: enough to validate files and allocate arrays."""

    cls: str
    heads: int
    k_dim: int
    v_dim: int
    dtype: str  # mlx dtype name, e.g. "float16"

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def check_supported(cache: Sequence[Any]) -> None:
    for i, layer in enumerate(cache):
        name = type(layer).__name__
        if type(layer) is not SUPPORTED_CACHES.get(name):
            raise UnsupportedCacheError(
                f"layer {i} uses {name}; this kvstore stores only "
                f"{', '.join(SUPPORTED_CACHES)} layers"
            )


def probe_layout(model) -> List[LayerLayout]:
    """Run the model on one token to learn each layer's cache class, heads, dims, dtype.

    Raises:
        UnsupportedCacheError: a layer's cache class is not supported.
    """
    cache = make_prompt_cache(model)
    check_supported(cache)
    model(mx.array([[0]]), cache=cache)
    mx.eval([c.state for c in cache])
    return [
        LayerLayout(
            cls=type(c).__name__,
            heads=c.keys.shape[1],
            k_dim=c.keys.shape[3],
            v_dim=c.values.shape[3],
            dtype=dtype_name(c.keys.dtype),
        )
        for c in cache
    ]


def tensor_names(i: int) -> Tuple[str, str]:
    return f"{i}.keys", f"{i}.values"


def expected_tensors(
    layout: Sequence[LayerLayout], ntokens: int
) -> Dict[str, Tuple[str, Tuple]]:
    """``name -> (dtype, shape)`` of a node file holding ``ntokens`` tokens."""
    out = {}
    for i, lay in enumerate(layout):
        k, v = tensor_names(i)
        out[k] = (lay.dtype, (1, lay.heads, ntokens, lay.k_dim))
        out[v] = (lay.dtype, (1, lay.heads, ntokens, lay.v_dim))
    return out


def check_cache(
    layout: Sequence[LayerLayout],
    cache: Sequence[Any],
    ntokens: int,
    *,
    exact: bool = True,
) -> None:
    """Raise ValueError unless ``cache`` matches the layout and holds ``ntokens`` tokens
    (at least ``ntokens`` when not ``exact``)."""
    if not isinstance(cache, (list, tuple)):
        raise TypeError(
            f"cache must be a list of cache objects, got {type(cache).__name__}"
        )
    if len(cache) != len(layout):
        raise ValueError(f"cache has {len(cache)} layers, the model has {len(layout)}")
    for i, (layer, lay) in enumerate(zip(cache, layout)):
        if (
            type(layer).__name__ != lay.cls
            or type(layer) is not SUPPORTED_CACHES[lay.cls]
        ):
            raise ValueError(
                f"cache layer {i} is {type(layer).__name__}, expected {lay.cls}"
            )
        held = layer.offset if layer.keys is not None else 0
        if held != ntokens if exact else held < ntokens:
            raise ValueError(
                f"cache layer {i} holds {held} tokens but {ntokens} tokens were given"
            )
        if layer.keys is None:
            continue
        k, v = layer.keys, layer.values
        if (
            k.shape[0] != 1
            or (k.shape[1], k.shape[3], v.shape[3]) != (lay.heads, lay.k_dim, lay.v_dim)
            or dtype_name(k.dtype) != lay.dtype
        ):
            raise ValueError(
                f"cache layer {i} has keys {k.shape} {dtype_name(k.dtype)}, expected "
                f"(1, {lay.heads}, *, {lay.k_dim}) {lay.dtype}"
            )


def node_slices(
    layout: Sequence[LayerLayout], cache: Sequence[Any], start: int, end: int
) -> Dict[str, mx.array]:
    """Lazy views of tokens ``[start, end)`` of every layer, as same-size unsigned ints."""
    out = {}
    for i, (layer, lay) in enumerate(zip(cache, layout)):
        view = _UINT_VIEW[layer.keys.dtype.size]
        k, v = tensor_names(i)
        out[k] = layer.keys[:, :, start:end, :].view(view)
        out[v] = layer.values[:, :, start:end, :].view(view)
    return out


def build_cache(layout: Sequence[LayerLayout], arrays, ntokens: int) -> List[Any]:
    """Fresh cache objects holding ``arrays`` (through the classes' ``state`` protocol)."""
    cache = []
    for lay, (k, v) in zip(layout, arrays):
        layer = SUPPORTED_CACHES[lay.cls]()
        # mlx-lm's KVCache.state is (keys, values, offset); older releases (keys, values).
        layer.state = (k, v, ntokens) if len(layer.state) == 3 else (k, v)
        cache.append(layer)
    return cache
