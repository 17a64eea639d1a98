"""The trie walk of the read path: the longest stored prefix of a prompt, found node
by node (full chunks by hash, the rest among a node's children in key order), every
node's tokens compared with the prompt's."""

from dataclasses import dataclass
from typing import List, Optional

import numpy as np

from ..disk.adapters import Layout
from ..disk.chunking import chain_hash
from ..disk.index import CHILD_KEY_TOKENS, CorruptRecord, Index, NodeRecord


@dataclass
class Step:
    """One node on a walked path and how many of its tokens are used."""

    h: bytes
    rec: NodeRecord
    take: int


class TrieWalk:
    """Walks of one namespace's trie, skipping the nodes found broken.

    Args:
        index: The store's index.
        namespace: The namespace's id.
        root: The namespace's root (its unsalted tree).
        chunk_tokens: Tokens per node at most.
        layout: The namespace's cache layout (with state layers, a restore stops
            only at a node holding a checkpoint).
        broken: The broken nodes (``h in broken``; a record that does not decode is
            reported to ``broken.corrupt_record``).
    """

    def __init__(
        self,
        *,
        index: Index,
        namespace: bytes,
        root: bytes,
        chunk_tokens: int,
        layout: Layout,
        broken,
    ):
        self.index = index
        self.namespace = namespace
        self.root = root
        self.chunk_tokens = chunk_tokens
        self.layout = layout
        self.broken = broken

    def walk(
        self,
        txn,
        arr: np.ndarray,
        *,
        limit: int,
        full_only: bool = False,
        root: Optional[bytes] = None,
    ) -> List[Step]:
        """Follow stored nodes along ``arr[:limit]``, checking every node's tokens.

        With ``full_only`` the walk stops before a node that is not wholly used. A
        layout with state layers restores only at a node holding a checkpoint: its
        fetch walk returns the longest such path. ``root``: the tree's root (a
        salted one), else the namespace's.
        """
        checkpoints = self.layout.has_state and not full_only
        parent = self.root if root is None else root
        return self._walk_from(
            txn,
            arr,
            parent,
            0,
            limit=limit,
            full_only=full_only or checkpoints,
            checkpoints=checkpoints,
            look_aside=True,
        )

    def _walk_from(
        self,
        txn,
        arr: np.ndarray,
        parent: bytes,
        pos: int,
        *,
        limit: int,
        full_only: bool,
        checkpoints: bool,
        look_aside: bool,
    ) -> List[Step]:
        """:meth:`walk` from node ``parent``, which ends at ``pos``.

        The walk takes the longest match at each level. With ``look_aside`` it then
        walks below the longest whole sibling it passed over at each level (without
        looking aside again) and keeps a path that goes further: a system prompt's
        node with the prompt's rest below it, beside a sibling that shares a few more
        tokens and ends. Siblings that both match are rare (chunks are found by
        hash), so this costs nothing in the common case.
        """
        start = pos
        path: List[Step] = []
        best: List[Step] = []  # the longest path ending at a checkpoint
        best_end = 0
        passed = []  # (index in path, position, whole sibling not taken there)
        C = self.chunk_tokens
        while pos < limit:
            usable = [
                step
                for step in self._candidates(
                    txn, parent, arr[pos : pos + C], checkpoints
                )
                if step.rec.start == pos
            ]
            for step in usable:
                step.take = min(step.take, limit - pos)
            # On a tie, a node used whole first: the walk can go on below it.
            usable.sort(key=lambda step: (-step.take, step.take < step.rec.ntokens))
            if full_only:
                usable = [step for step in usable if step.take == step.rec.ntokens]
            if checkpoints:
                for step in usable:
                    if step.rec.has_state and pos + step.take > best_end:
                        best, best_end = path + [step], pos + step.take
            if not usable:
                break
            step = usable[0]
            whole = [s for s in usable[1:] if s.take == s.rec.ntokens]
            if look_aside and whole and not checkpoints:
                passed.append((len(path), pos, whole[0]))
            path.append(step)
            if step.take < step.rec.ntokens:
                break
            parent, pos = step.h, pos + step.take
        if checkpoints:
            return best
        end, greedy = start + sum(step.take for step in path), path
        for at, where, other in passed:
            below = self._walk_from(
                txn,
                arr,
                other.h,
                where + other.take,
                limit=limit,
                full_only=full_only,
                checkpoints=False,
                look_aside=False,
            )
            other_end = where + other.take + sum(step.take for step in below)
            if other_end > end:
                path, end = greedy[:at] + [other] + below, other_end
        return path

    def _candidates(
        self, txn, parent: bytes, query: np.ndarray, checkpoints: bool
    ) -> List[Step]:
        """Children of ``parent`` matching a prefix of ``query``, longest match first.

        With ``checkpoints``, every child whose tokens are a prefix of the query: a
        shorter sibling may hold the only checkpoint (a system prompt's tail stored
        after a longer prompt without that boundary).
        """
        out = []
        if len(query) == self.chunk_tokens:  # the common case: found by its hash
            h = chain_hash(parent, query)
            rec = self._get_node(txn, h)
            if rec is not None and np.array_equal(rec.tokens, query):
                out.append(Step(h, rec, len(query)))
                if not checkpoints:
                    return out
        out += [
            Step(h, rec, common)
            for h, rec, common in self.index.nearest_children(
                self.namespace,
                parent,
                query,
                txn,
                on_corrupt=self.broken.corrupt_record,
            )
            if h not in self.broken
        ]
        if checkpoints:
            out += self._shorter_children(txn, parent, query)
        elif out:
            # The best match is a sibling that goes on past the query: a child holding
            # exactly those tokens (a system prompt's end, with the rest of this prompt
            # below it) may sit away from the query in key order. Racing saves leave
            # such siblings.
            best = max(step.take for step in out)
            if best < CHILD_KEY_TOKENS and all(
                step.take < step.rec.ntokens for step in out if step.take == best
            ):
                out += self._shorter_children(txn, parent, query[: best + 1])
        unique = {step.h: step for step in reversed(out)}  # keep the first of each
        return sorted(unique.values(), key=lambda step: -step.take)

    def _shorter_children(self, txn, parent: bytes, query: np.ndarray) -> List[Step]:
        """Children whose tokens are a strict prefix of ``query`` (found by hash)."""
        out = []
        for h, rec in self.index.prefix_children(
            self.namespace, parent, query, txn, on_corrupt=self.broken.corrupt_record
        ):
            if h not in self.broken and np.array_equal(
                rec.tokens, query[: rec.ntokens]
            ):
                out.append(Step(h, rec, rec.ntokens))
        return out

    def _get_node(self, txn, h: bytes) -> Optional[NodeRecord]:
        if h in self.broken:
            return None
        try:
            return self.index.get_node(self.namespace, h, txn)
        except CorruptRecord as e:
            self.broken.corrupt_record(h, e)
            return None
