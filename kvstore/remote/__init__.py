"""The shared remote tier: node files in an S3-compatible object store, behind the disk.

AWS S3, MinIO, Ceph RGW, R2: anything speaking the S3 API through boto3 (an optional
dependency, imported on first use). Objects under the URL's prefix, per namespace::

    <ns>/namespace.json                         the namespace's description
    <ns>/nodes/<parent>/<h>.json                one manifest per node (JSON, see below)
    <ns>/blobs/<h>.<xxh3>.safetensors           its node file
    <ns>/blobs/<h>.<xxh3>.state.safetensors     its checkpoint, when it has one

Manifests sit under their parent: chunk hashes are computed locally from the prompt, so
full chunks are found by direct GETs, and a node ended by a boundary (a system prompt's
end) by one LIST of its parent's children. Blob keys carry their checksum: two machines
that computed one node with KV differing in the last bits upload two objects, and each
manifest names its own, so a race between writers cannot pair a manifest with another
writer's bytes.

Nothing from the remote is trusted: manifests are parsed strictly (exact keys, types,
bounded sizes, tokens matching the node's span, the hash recomputed from the parent and
the tokens), node files are checked like local ones (size, xxh3, header, shapes and
dtypes against the local layout, namespace) before they are written and committed
through the store's own commit. A broken object is a miss and a report; a dead or slow
remote costs one bounded wait, then a circuit breaker skips it for a while.

Modules: ``manifest`` (the format, pure), ``client`` (S3 requests, circuit breaker),
``reader`` (manifests and listings, cached), ``tier`` (``RemoteTier``: the fetch and
commit hooks, ``pull``), ``uploads`` (the upload queue), ``sync`` (``push``, the
remote's listing), ``errors``.
"""

from .client import S3Client, parse_url
from .errors import RemoteCorrupt, RemoteError, RemoteUnavailable
from .manifest import (
    MANIFEST_FORMAT,
    MANIFEST_VERSION,
    check_node_file,
    decode_manifest,
    encode_manifest,
    manifest_limit,
)
from .sync import push
from .tier import RemoteTier

__all__ = [
    "MANIFEST_FORMAT",
    "MANIFEST_VERSION",
    "RemoteCorrupt",
    "RemoteError",
    "RemoteTier",
    "RemoteUnavailable",
    "S3Client",
    "check_node_file",
    "decode_manifest",
    "encode_manifest",
    "manifest_limit",
    "parse_url",
    "push",
]
