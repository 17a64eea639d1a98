"""Turning mlx-lm cache objects into per-node tensors and back.

Every cache class kvstore handles is on the allow-list below, with a codec that
says how it is stored; a class name read from disk is only ever compared with it.

Two ways of storing a layer (see docs/cache-types.md):

* **delta** (``KVCache``, ``QuantizedKVCache``): a node file holds the layer's KV
  for the node's own tokens; a restore concatenates the nodes along the path and
  can stop at any token.
* **state** (``RotatingKVCache``, ``ArraysCache``, ``ChunkedKVCache``): the layer's
  whole state cannot be cut at an arbitrary token (a sliding window has forgotten
  old tokens, recurrent state cannot be "trimmed"), so a node may carry a
  checkpoint of it, taken at the node's end; a restore stops only at such a node.

``CacheList`` layers are walked recursively; their leaves are named ``"3.0"``,
``"3.1"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .blobs import DTYPES, CorruptBlob, TensorEntry

if TYPE_CHECKING:
    import mlx.core as mx
_NP_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_CODE_TO_NAME = {code: name for name, (code, _) in DTYPES.items()}

DELTA, STATE = "delta", "state"


def _uint_view(size: int) -> mx.Dtype:
    """The unsigned dtype of ``size`` bytes: numpy understands such views whatever the
    float type (bf16). MLX is imported where arrays are made: reading a layout
    (``kvstore stats``, ``verify``, ``gc``) loads neither MLX nor mlx-lm."""
    import mlx.core as mx

    return {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[size]


def mlx_caches():
    """``mlx_lm.models.cache``, imported on first use: loading mlx-lm takes seconds
    (it loads transformers), and the commands that only read a store's files
    (``stats``, ``verify``, ``gc``) never build a cache object."""
    import mlx_lm.models.cache

    return mlx_lm.models.cache


class UnsupportedCacheError(ValueError):
    """The model's cache layout has a class kvstore cannot store."""


class LayoutMismatch(ValueError):
    """A cache handed to ``save`` differs from the layout probed at open (another
    class, tensor shape or setting in some layer): not storable, never an error in
    the caller's loop (the store logs and counts it, and skips the save)."""


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


@dataclass(frozen=True)
class Leaf:
    """How one (non-``CacheList``) cache layer is stored.

    ``tensors`` lists ``(suffix, dtype, shape)``; for delta leaves the shape is
    ``(heads, width)`` of the ``(1, heads, tokens, width)`` arrays, for state leaves
    the full shape with ``-1`` where the length varies (a window's rows; an
    ``ArraysCache`` entry that grows with the tokens seen, found by the probe).
    ``params`` are the class's fixed settings (bits, window size...): part of the
    namespace and checked on load.
    """

    name: str
    cls: str
    mode: str
    tensors: Tuple[Tuple[str, str, Tuple[int, ...]], ...]
    params: Tuple[Tuple[str, int], ...] = ()

    def param(self, key: str) -> int:
        return dict(self.params)[key]

    def to_json(self) -> Dict[str, Any]:
        return {
            "name": self.name,
            "cls": self.cls,
            "mode": self.mode,
            "tensors": [[s, d, list(shape)] for s, d, shape in self.tensors],
            "params": dict(self.params),
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "Leaf":
        if obj["cls"] not in CODECS:
            raise UnsupportedCacheError(f"unknown cache class {obj['cls']!r}")
        return cls(
            name=str(obj["name"]),
            cls=obj["cls"],
            mode=CODECS[obj["cls"]].mode,
            tensors=tuple((s, d, tuple(shape)) for s, d, shape in obj["tensors"]),
            params=tuple(sorted((k, int(v)) for k, v in obj["params"].items())),
        )


# -- codecs: one per allow-listed class ------------------------------------------------


def _kv_shape(a: mx.array) -> Tuple[int, int]:
    return a.shape[1], a.shape[3]


def _window_tensors(c) -> tuple:
    """Keys and values of a state layer whose length varies: ``(1, heads, -1, dim)``."""
    d = dtype_name(c.keys.dtype)
    h, dk, dv = c.keys.shape[1], c.keys.shape[3], c.values.shape[3]
    return (("keys", d, (1, h, -1, dk)), ("values", d, (1, h, -1, dv)))


class _Codec:
    """One allow-listed class by ``name``; ``cls`` is mlx-lm's class (imported then)."""

    name = ""

    @property
    def cls(self) -> type:
        return getattr(mlx_caches(), self.name)


class _Counted(_Codec):
    """A layer that counts its tokens in ``offset`` (every class but ArraysCache)."""

    def held(self, c) -> int:
        return c.offset if c.keys is not None else 0


class _KV(_Counted):
    """``KVCache``: keys and values, concatenated along the token axis."""

    name, mode = "KVCache", DELTA

    def describe(self, c) -> Tuple[tuple, tuple]:
        d = dtype_name(c.keys.dtype)
        return (("keys", d, _kv_shape(c.keys)), ("values", d, _kv_shape(c.values))), ()

    def arrays(self, c) -> List[mx.array]:
        return [c.keys, c.values]

    def build(self, leaf: Leaf, arrays: List[mx.array], ntokens: int):
        c = self.cls()
        c.keys, c.values, c.offset = arrays[0], arrays[1], ntokens
        return c


class _QuantizedKV(_KV):
    """``QuantizedKVCache``: the packed weights, scales and biases, kept quantized."""

    name, mode = "QuantizedKVCache", DELTA

    def describe(self, c) -> Tuple[tuple, tuple]:
        tensors = []
        for which, parts in (("keys", c.keys), ("values", c.values)):
            for j, a in enumerate(parts):
                tensors.append((f"{which}.{j}", dtype_name(a.dtype), _kv_shape(a)))
        params = (
            ("bits", c.bits),
            ("group_size", c.group_size),
            ("parts", len(c.keys)),
        )
        return tuple(tensors), params

    def arrays(self, c) -> List[mx.array]:
        return [*c.keys, *c.values]

    def build(self, leaf: Leaf, arrays: List[mx.array], ntokens: int):
        c = self.cls(group_size=leaf.param("group_size"), bits=leaf.param("bits"))
        n = leaf.param("parts")
        c.keys, c.values, c.offset = tuple(arrays[:n]), tuple(arrays[n:]), ntokens
        return c


class _Rotating(_Counted):
    """``RotatingKVCache``: the window buffers as they are, with their positions."""

    name, mode = "RotatingKVCache", STATE
    INTS = ("offset", "keep", "max_size", "idx")

    def describe(self, c) -> Tuple[tuple, tuple]:
        return _window_tensors(c), (("keep", c.keep), ("max_size", c.max_size))

    def state(self, c) -> Tuple[List[mx.array], List[int]]:
        return [c.keys, c.values], [c.offset, c.keep, c.max_size, c._idx]

    def check(self, leaf: Leaf, arrays, ints, end: int) -> None:
        offset, keep, max_size, idx = ints
        length = arrays[0].shape[2]
        if (keep, max_size) != (leaf.param("keep"), leaf.param("max_size")):
            raise CorruptBlob(f"{leaf.name}: window settings {keep}/{max_size} differ")
        # Filled in place the buffer is at most the window; concatenated, at most
        # every token seen.
        if offset != end or length > max(end, max_size) or not 0 <= idx <= length:
            raise CorruptBlob(f"{leaf.name}: window state {ints} of {length} rows")

    def build(self, leaf: Leaf, arrays, ints):
        c = self.cls(max_size=leaf.param("max_size"), keep=leaf.param("keep"))
        c.keys, c.values = arrays
        c.offset, c._idx = ints[0], ints[3]
        return c


class _Chunked(_Counted):
    """``ChunkedKVCache``: the keys kept since the current attention chunk began."""

    name, mode = "ChunkedKVCache", STATE
    INTS = ("offset", "chunk_size", "start_position")

    def describe(self, c) -> Tuple[tuple, tuple]:
        return _window_tensors(c), (("chunk_size", c.chunk_size),)

    def state(self, c) -> Tuple[List[mx.array], List[int]]:
        n = c.offset - c.start_position
        kept = [c.keys[..., :n, :], c.values[..., :n, :]]
        return kept, [c.offset, c.chunk_size, c.start_position]

    def check(self, leaf: Leaf, arrays, ints, end: int) -> None:
        offset, chunk_size, start = ints
        if chunk_size != leaf.param("chunk_size"):
            raise CorruptBlob(f"{leaf.name}: chunk size {chunk_size} differs")
        if offset != end or not 0 <= start <= offset:
            raise CorruptBlob(f"{leaf.name}: chunk state {ints} at position {end}")
        if arrays[0].shape[2] != offset - start:
            raise CorruptBlob(
                f"{leaf.name}: {arrays[0].shape[2]} rows, not {offset - start}"
            )

    def build(self, leaf: Leaf, arrays, ints):
        c = self.cls(leaf.param("chunk_size"))
        c.keys, c.values = arrays
        c.offset, c.start_position = ints[0], ints[2]
        return c


class _Arrays(_Codec):
    """``ArraysCache`` (recurrent state: convolution window, SSM state...)."""

    name, mode = "ArraysCache", STATE
    INTS = ()

    def describe(self, c) -> Tuple[tuple, tuple]:
        if any(a is None for a in c.cache):
            raise UnsupportedCacheError("an ArraysCache entry stays empty after a step")
        if c.left_padding is not None or c.lengths is not None:
            raise LayoutMismatch("a batched ArraysCache (padding or lengths)")
        tensors = tuple(
            (str(j), dtype_name(a.dtype), tuple(a.shape)) for j, a in enumerate(c.cache)
        )
        return tensors, (("size", len(c.cache)),)

    def held(self, c) -> Optional[int]:
        return None  # recurrent state does not know how many tokens it has seen

    def state(self, c) -> Tuple[List[mx.array], List[int]]:
        if c.left_padding is not None or c.lengths is not None:
            raise LayoutMismatch("a batched ArraysCache (padding or lengths)")
        if any(a is None for a in c.cache):
            raise LayoutMismatch("an ArraysCache holds no state yet")
        return list(c.cache), []

    def check(self, leaf: Leaf, arrays, ints, end: int) -> None:
        pass  # the tensor table check covered shapes (-1: length grows with tokens)

    def build(self, leaf: Leaf, arrays, ints):
        c = self.cls(leaf.param("size"))
        c.cache = list(arrays)
        return c


CODECS = {
    codec.name: codec
    for codec in (_KV(), _QuantizedKV(), _Rotating(), _Chunked(), _Arrays())
}
# The allow-list: every class a store can hold, CacheList being a container.
SUPPORTED_CACHES = (*CODECS, "CacheList")


def layer_codec(layer, where: str):
    """The codec of ``layer`` (named ``where`` in errors); UnsupportedCacheError for a
    class outside the allow-list, subclasses included."""
    name = type(layer).__name__
    codec = CODECS.get(name)
    if codec is None or type(layer) is not codec.cls:
        raise UnsupportedCacheError(
            f"layer {where} uses {name}; kvstore stores "
            f"{', '.join(SUPPORTED_CACHES)} layers"
        )
    return codec


def cache_leaves(cache: Sequence[Any], prefix: str = "") -> List[Tuple[str, Any]]:
    """``(name, layer)`` of every non-CacheList layer, depth first."""
    out = []
    for i, layer in enumerate(cache):
        name = f"{prefix}{i}"
        if type(layer) is mlx_caches().CacheList:
            out += cache_leaves(layer.caches, name + ".")
        else:
            out.append((name, layer))
    return out


def cache_tree(cache: Sequence[Any]) -> list:
    """The nesting of ``cache``: None for a leaf, a list for a CacheList."""
    lists = mlx_caches().CacheList
    return [cache_tree(c.caches) if type(c) is lists else None for c in cache]


# -- the layout of a whole model ------------------------------------------------------


class Layout:
    """The cache layout of one model: its leaves and how ``CacheList``s nest them.

    Args:
        leaves: One :class:`Leaf` per non-CacheList layer, depth first.
        tree: The nesting (see :func:`cache_tree`).
        make_cache: Builds the model's empty cache (the classes the store returns).
    """

    def __init__(self, leaves: Sequence[Leaf], tree: list, make_cache=None):
        self.leaves = list(leaves)
        self.tree = tree
        self.make_cache = make_cache
        self.has_state = any(leaf.mode == STATE for leaf in self.leaves)
        # State tensors: name -> (leaf, suffix, dtype, shape), with each leaf's ints.
        self.state_tensors: Dict[str, Tuple[Leaf, str, str, Tuple[int, ...]]] = {}
        for leaf in self.leaves:
            if leaf.mode != STATE:
                continue
            for suffix, dtype, shape in leaf.tensors:
                self.state_tensors[f"{leaf.name}.{suffix}"] = (
                    leaf,
                    suffix,
                    dtype,
                    shape,
                )
            ints = CODECS[leaf.cls].INTS
            if ints:
                self.state_tensors[f"{leaf.name}.ints"] = (
                    leaf,
                    "ints",
                    "int32",
                    (len(ints),),
                )
        # Delta tensors: name -> (dtype, heads, width) of a (1, heads, T, width) array.
        self.rows = {
            f"{leaf.name}.{suffix}": (dtype, shape[0], shape[1])
            for leaf in self.leaves
            if leaf.mode == DELTA
            for suffix, dtype, shape in leaf.tensors
        }

    def to_json(self) -> Dict[str, Any]:
        return {"leaves": [leaf.to_json() for leaf in self.leaves], "tree": self.tree}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], make_cache=None) -> "Layout":
        return cls([Leaf.from_json(x) for x in obj["leaves"]], obj["tree"], make_cache)

    # -- files ----------------------------------------------------------------------

    def delta_tensors(self, ntokens: int) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
        """``name -> (dtype, shape)`` of a node file holding ``ntokens`` tokens."""
        return {
            name: (dtype, (1, heads, ntokens, width))
            for name, (dtype, heads, width) in self.rows.items()
        }

    def decode_state(
        self, data: memoryview, tensors: Mapping[str, TensorEntry], end: int
    ) -> Dict[str, Tuple[List[np.ndarray], List[int]]]:
        """Check a state file's tensors against the layout and the node's end.

        Returns ``leaf name -> (arrays as same-size unsigned numpy views, ints)``.

        Raises:
            CorruptBlob: a missing, extra or misshapen tensor, or positions that do not
                fit the node.
        """
        want = self.state_tensors
        if set(tensors) != set(want):
            raise CorruptBlob(
                f"state tensors differ (missing {sorted(set(want) - set(tensors))[:3]}, "
                f"unexpected {sorted(set(tensors) - set(want))[:3]})"
            )
        out: Dict[str, Tuple[List[np.ndarray], List[int]]] = {}
        for name, (leaf, suffix, dtype, shape) in want.items():
            t = tensors[name]
            if (
                _CODE_TO_NAME.get(t.dtype) != dtype
                or len(t.shape) != len(shape)
                or any(w not in (-1, d) for w, d in zip(shape, t.shape))
            ):
                raise CorruptBlob(f"state tensor {name!r} is {t.dtype}{list(t.shape)}")
            size = DTYPES[dtype][1]
            raw = np.frombuffer(
                data,
                dtype=_NP_UINT[size],
                count=(t.end - t.start) // size,
                offset=t.start,
            ).reshape(t.shape)
            arrays, ints = out.setdefault(leaf.name, ([], []))
            if suffix == "ints":
                ints.extend(int(x) for x in raw.view(np.int32))
            else:
                arrays.append(raw)
        for leaf in self.leaves:
            if leaf.mode == STATE:
                arrays, ints = out[leaf.name]
                CODECS[leaf.cls].check(leaf, arrays, ints, end)
        return out

    # -- caches -----------------------------------------------------------------------

    def held_tokens(self, cache: Sequence[Any]) -> Optional[int]:
        """Tokens ``cache`` holds, as far as its layers count them (None: no layer
        does; recurrent state does not know how many tokens it has seen)."""
        known = [
            CODECS[leaf.cls].held(layer)
            for (_, layer), leaf in zip(cache_leaves(cache), self.leaves)
            if type(layer).__name__ == leaf.cls
        ]
        known = [n for n in known if n is not None]
        return min(known) if known else None

    def check_cache(self, cache: Sequence[Any], ntokens: int, *, exact: bool = True):
        """Raise unless ``cache`` has this layout and holds ``ntokens`` tokens.

        With ``exact`` false, delta layers may hold more (only the prefix is stored);
        state layers must still hold exactly ``ntokens``, and some layer must count
        its tokens so that this can be checked.
        """
        if not isinstance(cache, (list, tuple)):
            raise TypeError(
                f"cache must be a list of cache objects, got {type(cache).__name__}"
            )
        if len(cache) != len(self.tree):
            raise ValueError(
                f"cache has {len(cache)} layers, the model has {len(self.tree)}"
            )
        if cache_tree(cache) != self.tree:
            raise ValueError("cache nesting (CacheList) differs from the model's")
        counted = False
        for (name, layer), leaf in zip(cache_leaves(cache), self.leaves):
            codec = CODECS[leaf.cls]
            if type(layer) is not codec.cls:
                raise LayoutMismatch(
                    f"cache layer {name} is {type(layer).__name__}, expected {leaf.cls}"
                )
            held = codec.held(layer)
            if held is not None:
                counted = True
                ok = held == ntokens if exact or leaf.mode == STATE else held >= ntokens
                if not ok:
                    raise ValueError(
                        f"cache layer {name} holds {held} tokens but {ntokens} tokens "
                        "were given"
                    )
                if held == 0:
                    continue
            elif any(a is None for a in layer.cache):
                raise ValueError(f"cache layer {name} ({leaf.cls}) holds no state")
            try:
                tensors, params = codec.describe(layer)
            except LayoutMismatch as e:
                raise LayoutMismatch(f"cache layer {name}: {e}") from None
            if not _fits(tensors, leaf.tensors) or params != leaf.params:
                raise LayoutMismatch(
                    f"cache layer {name} has tensors {_brief(tensors)} {dict(params)}, "
                    f"expected {_brief(leaf.tensors)} {dict(leaf.params)}"
                )
        if not exact and not counted:
            raise ValueError(
                "this cache's layers do not count their tokens (recurrent state): "
                "save it with save() and exactly the tokens it holds"
            )

    def node_slices(
        self, cache: Sequence[Any], start: int, end: int
    ) -> Dict[str, mx.array]:
        """Lazy views of tokens ``[start, end)`` of every delta tensor, as unsigned ints
        (evaluated, they share the cache's buffers)."""
        out = {}
        for (name, layer), leaf in zip(cache_leaves(cache), self.leaves):
            if leaf.mode != DELTA:
                continue
            for (suffix, _, _), a in zip(leaf.tensors, CODECS[leaf.cls].arrays(layer)):
                out[f"{name}.{suffix}"] = a[:, :, start:end, :].view(
                    _uint_view(a.dtype.size)
                )
        return out

    def state_arrays(self, cache: Sequence[Any]) -> Dict[str, Tuple[str, mx.array]]:
        """``name -> (dtype, array)`` of every state tensor (unsigned views, ints as int32)."""
        import mlx.core as mx

        out = {}
        for (name, layer), leaf in zip(cache_leaves(cache), self.leaves):
            if leaf.mode != STATE:
                continue
            arrays, ints = CODECS[leaf.cls].state(layer)
            for (suffix, dtype, _), a in zip(leaf.tensors, arrays):
                out[f"{name}.{suffix}"] = (dtype, a.view(_uint_view(a.dtype.size)))
            if ints:
                out[f"{name}.ints"] = ("int32", mx.array(ints, dtype=mx.int32))
        return out

    def build(
        self,
        delta: Mapping[str, mx.array],
        state: Mapping[str, Tuple[List[np.ndarray], List[int]]],
        ntokens: int,
    ) -> List[Any]:
        """Fresh cache objects: delta leaves from ``delta`` (name -> array), state
        leaves from :meth:`decode_state`'s output (copied into new arrays)."""
        import mlx.core as mx

        built = []
        for leaf in self.leaves:
            codec = CODECS[leaf.cls]
            if leaf.mode == DELTA:
                arrays = [delta[f"{leaf.name}.{s}"] for s, _, _ in leaf.tensors]
                built.append(codec.build(leaf, arrays, ntokens))
            else:
                raw, ints = state[leaf.name]
                arrays = [
                    mx.array(np.ascontiguousarray(r)).view(getattr(mx, dtype))
                    for r, (_, dtype, _) in zip(raw, leaf.tensors)
                ]
                built.append(codec.build(leaf, arrays, ints))
        it = iter(built)
        return _nest(self.tree, it)


def _nest(tree: list, it) -> List[Any]:
    lists = mlx_caches().CacheList
    return [next(it) if sub is None else lists(*_nest(sub, it)) for sub in tree]


def _fits(tensors, want) -> bool:
    """Whether described ``tensors`` have the layout's names, dtypes and shapes
    (``-1`` in ``want``: any length on that axis)."""
    return len(tensors) == len(want) and all(
        (s, d, len(shape)) == (ws, wd, len(wshape))
        and all(w in (-1, x) for w, x in zip(wshape, shape))
        for (s, d, shape), (ws, wd, wshape) in zip(tensors, want)
    )


def _brief(tensors) -> str:
    return ", ".join(f"{s}:{d}{list(shape)}" for s, d, shape in tensors)


def _describe_all(cache) -> List[Tuple[str, Any, tuple, tuple]]:
    """``(name, codec, tensors, params)`` of every leaf of ``cache``."""
    out = []
    for name, layer in cache_leaves(cache):
        codec = layer_codec(layer, name)
        try:
            tensors, params = codec.describe(layer)
        except (UnsupportedCacheError, LayoutMismatch) as e:
            raise UnsupportedCacheError(
                f"layer {name} ({type(layer).__name__}): {e}"
            ) from None
        for suffix, dtype, _ in tensors:
            if dtype not in DTYPES:
                raise UnsupportedCacheError(
                    f"layer {name} ({type(layer).__name__}): tensor {suffix} is "
                    f"{dtype}; kvstore stores {', '.join(DTYPES)}"
                )
        out.append((name, codec, tensors, params))
    return out


def _varying(name: str, cls: str, first: tuple, later: tuple) -> tuple:
    """State tensors of a leaf seen after 1 and after 3 tokens: axes whose length
    changed become ``-1`` (any length). A change of name, dtype or rank cannot be
    described: refused."""
    out = []
    for (s, d, shape), (s2, d2, shape2) in zip(first, later):
        if (s, d, len(shape)) != (s2, d2, len(shape2)) or len(first) != len(later):
            raise UnsupportedCacheError(
                f"layer {name} ({cls}): state tensor {s} is {d}{list(shape)} after "
                f"one token but {d2}{list(shape2)} after three; a state whose dtype or "
                "rank depends on the tokens seen cannot be stored"
            )
        out.append((s, d, tuple(a if a == b else -1 for a, b in zip(shape, shape2))))
    return tuple(out)


def probe_layout(model, make_cache=None) -> Layout:
    """Run the model on one token to learn each layer's class, tensors and settings.

    ``ArraysCache`` layers are then fed two more tokens: an entry whose shape grows
    with the tokens seen (an n-gram model's token context) is stored with ``-1`` on
    that axis; one whose dtype or rank changes is refused here, at open, rather than
    at a save.

    Args:
        model: The mlx-lm model.
        make_cache: Builds an empty cache (default: ``make_prompt_cache(model)``).

    Raises:
        UnsupportedCacheError: a layer's cache class, dtype or state is not
            supported; the message names the layer and why.
    """
    import mlx.core as mx

    make_cache = make_cache or (lambda: mlx_caches().make_prompt_cache(model))
    cache = make_cache()
    for name, layer in cache_leaves(cache):
        layer_codec(layer, name)
    model(mx.array([[0]]), cache=cache)
    mx.eval([c.state for _, c in cache_leaves(cache)])
    described = _describe_all(cache)
    if any(codec.name == "ArraysCache" for _, codec, _, _ in described):
        model(mx.array([[0, 0]]), cache=cache)
        mx.eval([c.state for _, c in cache_leaves(cache)])
        later = _describe_all(cache)
        described = [
            (
                (n, codec, _varying(n, codec.name, t, t2), p)
                if codec.name == "ArraysCache"
                else (n, codec, t, p)
            )
            for (n, codec, t, p), (_, _, t2, _) in zip(described, later)
        ]
    leaves = [
        Leaf(name, codec.name, codec.mode, tensors, params)
        for name, codec, tensors, params in described
    ]
    return Layout(leaves, cache_tree(cache), make_cache)
