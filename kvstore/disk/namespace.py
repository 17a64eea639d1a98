"""The namespace fingerprint: everything that makes stored KV bytes valid, and the
quick way back to it for a model the store has seen before.

Two models never share a namespace: the fingerprint covers the model config,
weight names/shapes/dtypes and content, the tokenizer vocabulary, the cache
layout, the chunk size and the store's format version.

Two of those cost more than a store should take to open: the layout is learned by
running the model on one token (:func:`kvstore.disk.adapters.probe_layout`, 0.2-0.5 s),
and the vocabulary digest builds every token's string (50-150 ms for 49K tokens).
So a store looks the namespace up by a *model key* first (:func:`model_key`): the
same config, weight headers and weight content digest as the namespace, plus
everything the layout depends on that is cheap to see without running the model
(the model's code, mlx and mlx-lm versions, the empty cache ``make_cache`` builds:
classes, window sizes, bits) and an identity of the tokenizer's files in place of
its vocabulary. A key seen before names the namespace, whose record holds the
probed layout; only a model never seen is probed (:func:`open_namespace`).
"""

import dataclasses
import json
import logging
import os
import sys
from typing import Any, Callable, Dict, Optional, Tuple

import mlx.core as mx
import mlx_lm
import xxhash
from mlx.utils import tree_flatten
from mlx_lm.models.cache import CacheList

from ..platform import devices
from .adapters import (
    Layout,
    UnsupportedCacheError,
    cache_leaves,
    cache_tree,
    layer_codec,
    probe_layout,
)
from .index import Index

log = logging.getLogger("kvstore")

# Above this many weight bytes only samples of each tensor are hashed, so that
# opening a store over a large model stays fast.
FULL_HASH_LIMIT = 2 << 30
_SAMPLE = 1 << 20
# Where reading weights on the host would move them out of device memory (CUDA),
# smaller samples are gathered on the device and only they are read: 64 KiB at
# three places of every tensor, ~40 MB for an 8B model.
DEVICE_SAMPLE = 64 << 10
MODEL_KEY_VERSION = 1  # of what model_key() hashes
# "format_version" in namespace descriptions and model keys: what a node's hash and
# KV mean. The store's file layout (kvstore.disk.index.FORMAT_VERSION) is not part
# of it; raising it would orphan every stored prefix.
NAMESPACE_FORMAT = 1


def _config(model) -> Any:
    args = getattr(model, "args", None)
    if args is None:
        return None
    if dataclasses.is_dataclass(args):
        args = dataclasses.asdict(args)
    elif not isinstance(args, dict):
        args = vars(args)
    return json.loads(json.dumps(args, sort_keys=True, default=str))


def weights_digest(model) -> Tuple[str, str]:
    """``(digest of names/shapes/dtypes, digest of the weight bytes)``.

    Every byte up to ``FULL_HASH_LIMIT`` bytes of weights; above that, 1 MiB at the
    start, middle and end of every tensor of more than 3 MiB (and all of smaller
    ones): at most 3 MiB per tensor. With MLX's CUDA backend, :data:`DEVICE_SAMPLE`
    bytes at those places, copied on the device, whatever the model's size (see
    :mod:`kvstore.platform.devices`): the weights stay in device memory.
    """
    params = tree_flatten(model.parameters())
    headers = "".join(f"{name}:{p.dtype}:{tuple(p.shape)};" for name, p in params)
    headers_digest = xxhash.xxh3_128_hexdigest(headers.encode())
    content = xxhash.xxh3_128()
    if devices.host_access_moves_arrays():
        pieces = [
            s
            for _, p in params
            if p.size
            for s in devices.sample_slices(p, DEVICE_SAMPLE)
        ]
        if pieces:
            # A buffer of its own: only the samples are read on the host.
            joined = (
                mx.concatenate(pieces)
                if len(pieces) > 1
                else devices.device_copy(pieces[0])
            )
            mx.eval(joined)
            content.update(memoryview(joined))
        return headers_digest, content.hexdigest()
    full = sum(p.nbytes for _, p in params) <= FULL_HASH_LIMIT
    for _, p in params:
        if p.size == 0:
            continue
        try:
            raw = memoryview(p)
        except (TypeError, ValueError):
            raw = memoryview(mx.contiguous(p))
        if not raw.c_contiguous:
            raw = memoryview(mx.contiguous(p))
        if full or raw.nbytes <= 3 * _SAMPLE:
            content.update(raw)  # the raw bytes, whatever the item format
        else:
            raw = raw.cast("B")
            mid = len(raw) // 2
            for s in (0, mid - _SAMPLE // 2, len(raw) - _SAMPLE):
                content.update(raw[s : s + _SAMPLE])
    return headers_digest, content.hexdigest()


def vocab_digest(tokenizer) -> Optional[str]:
    """xxh3-128 of every ``id \\0 token \\1`` in id order (None without a tokenizer)."""
    if tokenizer is None:
        return None
    vocab = tokenizer.get_vocab()
    items = sorted(vocab.items(), key=lambda kv: kv[1])
    # One string, encoded and hashed once: the digest of the concatenation is the
    # digest of the pieces hashed one after the other.
    text = "".join([f"{i}\x00{tok}\x01" for tok, i in items])
    return xxhash.xxh3_128_hexdigest(text.encode("utf-8", "surrogatepass"))


def fingerprint(
    model,
    tokenizer,
    layout: Layout,
    *,
    chunk_tokens: int,
    weights: Optional[Tuple[str, str]] = None,
) -> Tuple[bytes, Dict[str, Any]]:
    """Return ``(16-byte namespace id, readable description)``.

    ``weights``: :func:`weights_digest` of ``model`` when the caller has it already.
    """
    weight_headers, weight_content = weights or weights_digest(model)
    config = _config(model)
    description = {
        "format_version": NAMESPACE_FORMAT,
        "model_type": (
            (config or {}).get("model_type") if isinstance(config, dict) else None
        ),
        "config": config,
        "weight_headers": weight_headers,
        "weights": weight_content,
        "vocab": vocab_digest(tokenizer),
        "layout": layout.to_json(),
        "chunk_tokens": chunk_tokens,
    }
    return namespace_id(description), description


def namespace_id(description: Dict[str, Any]) -> bytes:
    """The 16-byte namespace of a description (the xxh3-128 of its canonical JSON)."""
    return xxhash.xxh3_128_digest(json.dumps(description, sort_keys=True).encode())


# -- the model key: a known model's namespace without probing ---------------------------


def _source_digest(module_names) -> Optional[str]:
    """Digest of the source files of these modules; None when one has no readable file
    (a class defined in ``__main__`` or a notebook: its code cannot be told apart)."""
    h = xxhash.xxh3_128()
    for name in sorted(module_names):
        path = getattr(sys.modules.get(name), "__file__", None)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except (OSError, TypeError):
            return None
        h.update(f"{name}\x00{len(data)}\x00".encode())
        h.update(data)
    return h.hexdigest()


def _code_modules(model) -> set:
    """Modules whose code decides the model's cache and KV: its classes (every
    submodule's, and their bases) and mlx-lm's cache and attention helpers."""
    classes = {type(m) for _, m in model.named_modules()} | {type(model)}
    names = {"mlx_lm.models.cache", "mlx_lm.models.base"}
    for cls in classes:
        for base in cls.__mro__:
            if base.__module__ not in ("builtins",):
                names.add(base.__module__)
    return names


def _plain(value) -> Any:
    """A JSON-able description of an attribute of an empty cache object."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, [_plain(v) for v in value]]
    if isinstance(value, mx.array):
        return ["array", str(value.dtype), list(value.shape)]
    return ["object", f"{type(value).__module__}.{type(value).__qualname__}"]


def describe_empty_cache(cache) -> list:
    """Classes, settings (every attribute: window size, keep, bits, group size, chunk
    size, number of state arrays...) and nesting of an empty cache, as JSON."""
    out = []
    for layer in cache:
        cls = type(layer)
        name = f"{cls.__module__}.{cls.__qualname__}"
        if cls is CacheList:
            out.append([name, describe_empty_cache(layer.caches)])
        else:
            attrs = sorted((k, _plain(v)) for k, v in vars(layer).items())
            out.append([name, attrs])
    return out


_TOKENIZER_FILES = (
    "added_tokens.json",
    "merges.txt",
    "special_tokens_map.json",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
)


def tokenizer_identity(tokenizer) -> Any:
    """What tells this tokenizer's vocabulary apart, cheaply: its class, size and the
    files it was loaded from (name, size, mtime, inode: any change is another
    tokenizer), else (no directory of tokenizer files) its full vocabulary digest."""
    if tokenizer is None:
        return None
    # mlx-lm's TokenizerWrapper hands name_or_path and len() to the HF tokenizer.
    where = getattr(tokenizer, "name_or_path", None)
    files = []
    if isinstance(where, str) and where and os.path.isdir(where):
        for name in sorted(os.listdir(where)):
            if name.startswith("tokenizer") or name in _TOKENIZER_FILES:
                try:
                    st = os.stat(os.path.join(where, name))
                except OSError:
                    continue
                files.append([name, st.st_size, st.st_mtime_ns, st.st_ino])
    try:
        size = len(tokenizer)
    except TypeError:
        size = None
    if not files or size is None:
        return ["vocab", vocab_digest(tokenizer)]
    cls = type(tokenizer)
    where = os.path.realpath(where)
    return ["files", f"{cls.__module__}.{cls.__qualname__}", size, where, files]


def model_key(
    model,
    tokenizer,
    empty_cache: list,
    *,
    chunk_tokens: int,
    weights: Tuple[str, str],
) -> Optional[bytes]:
    """The key a known model's namespace is found by (16 bytes), or None when the
    model's code cannot be identified (then the layout is always probed).

    It covers all the namespace covers but the probed layout and the vocabulary,
    and for those what determines them: the model's code (the source of its
    classes' modules), mlx and mlx-lm versions, config, weight names/shapes/dtypes
    (the KV dtype follows them), the empty cache ``make_cache`` returns (classes,
    window and chunk sizes, bits, group size, nesting), and the tokenizer's identity.
    """
    code = _source_digest(_code_modules(model))
    if code is None:
        return None
    key = {
        "key_version": MODEL_KEY_VERSION,
        "format_version": NAMESPACE_FORMAT,
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "code": code,
        "config": _config(model),
        "weight_headers": weights[0],
        "weights": weights[1],
        "cache": describe_empty_cache(empty_cache),
        "tokenizer": tokenizer_identity(tokenizer),
        "chunk_tokens": chunk_tokens,
    }
    return xxhash.xxh3_128_digest(json.dumps(key, sort_keys=True).encode())


@dataclasses.dataclass
class Opened:
    """A store's namespace for one model: id, description and layout."""

    namespace: bytes
    description: Dict[str, Any]
    layout: Layout
    probed: bool  # False: the layout came from the namespace record


def open_namespace(
    index: Index, model, tokenizer, make_cache: Callable[[], list], *, chunk_tokens: int
) -> Opened:
    """The namespace of ``model`` in ``index``: found by its :func:`model_key` when the
    store has seen the model (no forward pass), else probed, fingerprinted and
    registered with its key.

    Raises:
        UnsupportedCacheError: a layer's cache class is not supported.
    """
    empty = make_cache()
    for name, layer in cache_leaves(empty):
        layer_codec(layer, name)  # unsupported classes fail here, as in the probe
    weights = weights_digest(model)
    key = model_key(model, tokenizer, empty, chunk_tokens=chunk_tokens, weights=weights)
    if key is not None:
        known = _known(index, key, empty, make_cache)
        if known is not None:
            return known
    layout = probe_layout(model, make_cache)
    ns, description = fingerprint(
        model, tokenizer, layout, chunk_tokens=chunk_tokens, weights=weights
    )
    # ``ns`` is the digest of ``description``: a record there that differs is broken.
    index.register_namespace(ns, description, model_key=key, replace=True)
    return Opened(ns, description, layout, True)


def _known(index: Index, key: bytes, empty: list, make_cache) -> Optional[Opened]:
    """The namespace ``key`` names, if its record is whole and its layout fits the
    empty cache (same classes and nesting); else None (the caller probes)."""
    found = index.namespace_for_model(key)
    if found is None:
        return None
    ns, description = found
    try:
        if namespace_id(description) != ns:
            raise ValueError("the record does not hash to its namespace")
        layout = Layout.from_json(description["layout"], make_cache=make_cache)
        if layout.tree != cache_tree(empty) or [leaf.cls for leaf in layout.leaves] != [
            type(layer).__name__ for _, layer in cache_leaves(empty)
        ]:
            raise ValueError("its layout has other cache classes")
    except (UnsupportedCacheError, KeyError, TypeError, ValueError) as e:
        log.warning(
            "kvstore: the namespace record %s cannot be reused (%s); probing the model",
            ns.hex(),
            e,
        )
        return None
    return Opened(ns, description, layout, False)
