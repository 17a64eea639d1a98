"""The remote's manifest format: one JSON object per node, parsed strictly.

Pure functions, no S3: what another machine needs to rebuild a node's record, and the
checks a downloaded (or about to be uploaded) node file must pass.
"""

import json
import re
import time
from typing import List, Tuple

import numpy as np
import xxhash

from ..disk.blobs import (
    DELTA_PART,
    STATE_PART,
    CorruptBlob,
    check_layout,
    metadata_matches,
    parse_header,
)
from ..disk.chunking import MAX_TOKEN, chain_hash
from ..disk.index import KINDS, NodeRecord
from .errors import RemoteCorrupt

MANIFEST_FORMAT = "kvstore-node"
MANIFEST_VERSION = 1
_MANIFEST_KEYS = {
    "format",
    "version",
    "namespace",
    "hash",
    "parent",
    "start",
    "tokens",
    "kind",
    "file",
    "state",
}
_FILE_KEYS = {"nbytes", "xxh3"}
HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX16 = re.compile(r"[0-9a-f]{16}")
CHILD_KEY = re.compile(r"([0-9a-f]{32})\.json")  # a manifest's name under its parent


def encode_manifest(ns: bytes, h: bytes, rec: NodeRecord) -> bytes:
    """The JSON manifest of node ``h`` (what another machine needs to rebuild its record)."""

    def file(nbytes, checksum):
        return {"nbytes": int(nbytes), "xxh3": f"{checksum:016x}"}

    obj = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "namespace": ns.hex(),
        "hash": h.hex(),
        "parent": rec.parent.hex(),
        "start": int(rec.start),
        "tokens": [int(t) for t in rec.tokens],
        "kind": rec.kind,
        "file": file(rec.nbytes, rec.checksum),
        "state": (
            file(rec.state_nbytes, rec.state_checksum) if rec.has_state else None
        ),
    }
    return json.dumps(obj, separators=(",", ":")).encode()


def manifest_limit(chunk_tokens: int) -> int:
    """The largest manifest a node of ``chunk_tokens`` tokens can have, in bytes."""
    return 2048 + 12 * chunk_tokens


def decode_manifest(
    raw: bytes,
    *,
    ns: bytes,
    h: bytes,
    chunk_tokens: int,
    max_object_bytes: int,
) -> NodeRecord:
    """Parse a manifest strictly into a :class:`NodeRecord` (not pinned, created now).

    Raises:
        RemoteCorrupt: anything malformed, out of bounds, of another namespace or
            node, or whose hash is not the chain hash of its parent and tokens.
    """
    if len(raw) > manifest_limit(chunk_tokens):
        raise RemoteCorrupt(f"manifest of {len(raw)} bytes is too large")

    def no_duplicates(pairs):
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            raise RemoteCorrupt("manifest has duplicate keys")
        return dict(pairs)

    def no_constant(name):
        raise RemoteCorrupt(f"manifest holds {name}")

    try:
        obj = json.loads(
            raw, object_pairs_hook=no_duplicates, parse_constant=no_constant
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise RemoteCorrupt(f"manifest is not JSON: {str(e)[:80]}") from None
    if not isinstance(obj, dict) or set(obj) != _MANIFEST_KEYS:
        got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise RemoteCorrupt(
            f"manifest fields are {got}, expected {sorted(_MANIFEST_KEYS)}"
        )
    if obj["format"] != MANIFEST_FORMAT or obj["version"] != MANIFEST_VERSION:
        raise RemoteCorrupt(
            f"manifest format {obj['format']!r} version {obj['version']!r}"
        )
    if obj["namespace"] != ns.hex():
        raise RemoteCorrupt("manifest names another namespace")
    if obj["hash"] != h.hex():
        raise RemoteCorrupt("manifest names another node")
    parent = obj["parent"]
    if not isinstance(parent, str) or not HEX32.fullmatch(parent):
        raise RemoteCorrupt("manifest parent is not a 32-digit hex hash")
    start, tokens = obj["start"], obj["tokens"]
    if not is_int(start) or not 0 <= start <= MAX_TOKEN:
        raise RemoteCorrupt(f"manifest start {start!r} is not a position")
    if not isinstance(tokens, list) or not 1 <= len(tokens) <= chunk_tokens:
        raise RemoteCorrupt(
            f"manifest tokens must be a list of 1 to {chunk_tokens} token ids"
        )
    if not all(is_int(t) and 0 <= t <= MAX_TOKEN for t in tokens):
        raise RemoteCorrupt("manifest tokens are not all token ids")
    if obj["kind"] not in KINDS:
        raise RemoteCorrupt(f"manifest kind {obj['kind']!r} is not one of {KINDS}")
    nbytes, checksum = _file_entry(obj["file"], "file", max_object_bytes)
    state_nbytes = state_checksum = 0
    if obj["state"] is not None:
        state_nbytes, state_checksum = _file_entry(
            obj["state"], "state", max_object_bytes
        )
    arr = np.array(tokens, dtype="<i4")
    parent = bytes.fromhex(parent)
    # Never the remote's word for it: the node's address is recomputed from its content.
    if chain_hash(parent, arr) != h:
        raise RemoteCorrupt("hash is not the chain hash of the parent and tokens")
    return NodeRecord(
        parent,
        start,
        arr,
        nbytes,
        checksum,
        obj["kind"],
        False,
        time.time(),
        state_nbytes,
        state_checksum,
    )


def is_int(x) -> bool:
    """An int and not a bool (JSON's true is not a size)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _file_entry(entry, what: str, max_bytes: int) -> Tuple[int, int]:
    if not isinstance(entry, dict) or set(entry) != _FILE_KEYS:
        raise RemoteCorrupt(f"manifest {what} entry must be {sorted(_FILE_KEYS)}")
    nbytes, digest = entry["nbytes"], entry["xxh3"]
    if not is_int(nbytes) or not 8 < nbytes <= max_bytes:
        raise RemoteCorrupt(f"manifest {what} size {nbytes!r} is out of bounds")
    if not isinstance(digest, str) or not _HEX16.fullmatch(digest):
        raise RemoteCorrupt(f"manifest {what} checksum is not 16 hex digits")
    return nbytes, int(digest, 16)


def check_node_file(data, rec: NodeRecord, part: str, *, ns: bytes, layout) -> None:
    """Validate one downloaded (or about to be uploaded) node file exactly as a local
    read does: size, checksum, header, tensors against ``layout``, namespace.

    Raises:
        CorruptBlob: the file is not what ``rec`` describes.
    """
    nbytes, checksum = (
        (rec.state_nbytes, rec.state_checksum)
        if part == STATE_PART
        else (rec.nbytes, rec.checksum)
    )
    if len(data) != nbytes:
        raise CorruptBlob(f"{len(data)} bytes, the manifest says {nbytes}")
    if xxhash.xxh3_64_intdigest(data) != checksum:
        raise CorruptBlob("checksum mismatch")
    _, tensors, meta = parse_header(data, len(data))
    if part == STATE_PART:
        layout.decode_state(memoryview(data), tensors, rec.end)
    else:
        check_layout(tensors, layout.delta_tensors(rec.ntokens))
    if not metadata_matches(meta, ns):
        raise CorruptBlob("file belongs to another namespace")


def node_parts(rec: NodeRecord) -> List[Tuple[str, int, int]]:
    """``(part, nbytes, checksum)`` of a node's files."""
    out = [(DELTA_PART, rec.nbytes, rec.checksum)]
    if rec.has_state:
        out.append((STATE_PART, rec.state_nbytes, rec.state_checksum))
    return out
