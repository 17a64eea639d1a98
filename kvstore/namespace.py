"""The namespace fingerprint: everything that makes stored KV bytes valid.

Two models never share a namespace: the fingerprint covers the model config,
weight names/shapes/dtypes and content, the tokenizer vocabulary, the cache
layout, the chunk size and the store's format version.
"""

import dataclasses
import json
from typing import Any, Dict, Optional, Tuple

import mlx.core as mx
import xxhash
from mlx.utils import tree_flatten

from .adapters import Layout
from .index import FORMAT_VERSION

# Above this many weight bytes only samples of each tensor are hashed, so that
# opening a store over a large model stays fast.
FULL_HASH_LIMIT = 2 << 30
_SAMPLE = 1 << 20


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
    """``(digest of names/shapes/dtypes, digest of the weight bytes)``."""
    params = tree_flatten(model.parameters())
    headers = xxhash.xxh3_128()
    content = xxhash.xxh3_128()
    total = sum(p.nbytes for _, p in params)
    for name, p in params:
        headers.update(f"{name}:{p.dtype}:{tuple(p.shape)};".encode())
        if p.size == 0:
            continue
        p = mx.contiguous(p) if not _contiguous(p) else p
        raw = memoryview(p).cast("B")
        if total <= FULL_HASH_LIMIT or len(raw) <= 3 * _SAMPLE:
            content.update(raw)
        else:
            mid = len(raw) // 2
            for s in (0, mid - _SAMPLE // 2, len(raw) - _SAMPLE):
                content.update(raw[s : s + _SAMPLE])
    return headers.hexdigest(), content.hexdigest()


def _contiguous(p: mx.array) -> bool:
    try:
        return memoryview(p).c_contiguous
    except (TypeError, ValueError):
        return False


def vocab_digest(tokenizer) -> Optional[str]:
    if tokenizer is None:
        return None
    vocab = tokenizer.get_vocab()
    h = xxhash.xxh3_128()
    for tok, i in sorted(vocab.items(), key=lambda kv: kv[1]):
        h.update(f"{i}\x00{tok}\x01".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def fingerprint(
    model,
    tokenizer,
    layout: Layout,
    *,
    chunk_tokens: int,
) -> Tuple[bytes, Dict[str, Any]]:
    """Return ``(16-byte namespace id, readable description)``."""
    weight_headers, weight_content = weights_digest(model)
    config = _config(model)
    description = {
        "format_version": FORMAT_VERSION,
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
    canonical = json.dumps(description, sort_keys=True).encode()
    return xxhash.xxh3_128_digest(canonical), description
