"""What a node file of one namespace must look like, before it is read."""

import math
from typing import Dict, Tuple

import mlx.core as mx

from ..disk.adapters import Layout
from ..disk.blobs import DTYPES, MAX_HEADER_BYTES, CorruptBlob, metadata_matches
from ..disk.index import CorruptRecord, NodeRecord


class NodeShapes:
    """The tensors and sizes of a namespace's node files, by token count (cached),
    and the checks of a record and a file's metadata against them.

    Args:
        layout: The namespace's cache layout.
        namespace: The namespace's id.
        chunk_tokens: Tokens per node at most.
    """

    def __init__(self, layout: Layout, namespace: bytes, chunk_tokens: int):
        self.layout = layout
        self.namespace = namespace
        self.chunk_tokens = chunk_tokens
        self._node_files: Dict[int, Tuple[Dict, int]] = {}  # by tokens: _node_file
        #: KV bytes per token of the delta layers.
        self.token_bytes = sum(
            heads * width * getattr(mx, dtype).size
            for dtype, heads, width in layout.rows.values()
        )

    def check_sizes(self, rec: NodeRecord) -> None:
        """Refuse a record whose sizes no node file of this store has, before anything
        is allocated for it: a corrupt record must not cost gigabytes of memory."""
        if rec.ntokens > self.chunk_tokens:
            raise CorruptRecord(
                f"record holds {rec.ntokens} tokens, nodes hold at most "
                f"{self.chunk_tokens}"
            )
        _, data = self._node_file(rec.ntokens)
        if not data + 8 < rec.nbytes <= data + 8 + MAX_HEADER_BYTES:
            raise CorruptRecord(
                f"record says the file has {rec.nbytes} bytes; a node of "
                f"{rec.ntokens} tokens has {data} bytes of data and a header"
            )

    def expected(self, ntokens: int) -> Dict[str, Tuple[str, Tuple]]:
        """The tensors of a node file of ``ntokens`` tokens (one shared dict per size)."""
        return self._node_file(ntokens)[0]

    def _node_file(self, ntokens: int) -> Tuple[Dict[str, Tuple[str, Tuple]], int]:
        """``(tensors, data bytes)`` of a node file of ``ntokens`` tokens, cached."""
        known = self._node_files.get(ntokens)
        if known is None:
            expected = self.layout.delta_tensors(ntokens)
            data = sum(
                math.prod(shape) * DTYPES[dtype][1]
                for dtype, shape in expected.values()
            )
            known = self._node_files[ntokens] = (expected, data)
        return known

    def check_meta(self, meta: dict) -> None:
        """Refuse a file whose metadata names another namespace."""
        if not metadata_matches(meta, self.namespace):
            raise CorruptBlob("file belongs to another namespace")
