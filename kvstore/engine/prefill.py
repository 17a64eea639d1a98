"""Prefill: the model run over what the store lacks of a prompt, and the result saved."""

import time
from typing import Any, Callable, Dict, List, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..disk import salts
from ..disk.adapters import Layout
from ..disk.chunking import as_token_array
from ..maintenance.common import check_int
from .accesses import Accesses
from .payoff import RestorePolicy
from .restore import ReadPath
from .saving import WritePath


class Prefill:
    """Computing what is missing of a prompt (after its longest stored prefix) and
    saving it; with state layers, a checkpoint at every boundary.

    Args:
        model: The mlx-lm model.
        layout: The namespace's cache layout.
        reads: The read path (what is stored already, read back whole).
        writes: The write path.
        policy: Whose rates learn the model's prefill speed.
        accesses: Where a new rate is kept for other processes.
        tree_of: ``(tree root, quota root)`` of a parsed salt (``Parts.tree_of``).
    """

    def __init__(
        self,
        *,
        model,
        layout: Layout,
        reads: ReadPath,
        writes: WritePath,
        policy: RestorePolicy,
        accesses: Accesses,
        tree_of: Callable[[Any], Tuple[bytes, bytes]],
    ):
        self.model = model
        self.layout = layout
        self.reads = reads
        self.writes = writes
        self.policy = policy
        self.accesses = accesses
        self.tree_of = tree_of

    def run(
        self,
        arr: np.ndarray,
        fetch: Callable[..., Tuple[List[Any], int]],
        *,
        salt,
        kind: str,
        pin: bool,
        boundaries: Sequence[int],
        step_tokens: int,
    ) -> Dict[str, int]:
        """``KVStore.prefill`` of ``arr`` (tokens and options checked) in ``salt``'s
        tree; ``fetch`` is ``KVStore.fetch``, which restores the stored prefix."""
        check_int("step_tokens", step_tokens, minimum=1)
        tree = self.tree_of(salts.parse_salt(salt))
        vocab = getattr(getattr(self.model, "args", None), "vocab_size", None)
        if isinstance(vocab, int) and arr.max() >= vocab:
            bad = int(np.flatnonzero(arr >= vocab)[0])
            raise ValueError(
                f"tokens[{bad}] = {arr[bad]} is not below the model's vocab_size {vocab}"
            )
        stored = self.reads.all_stored(arr, root=tree[0])
        if stored is not None:
            if pin:
                self.writes.pin_stored([s.h for s in stored], kind=kind)
            return {"tokens": len(arr), "computed": 0, "reused": len(arr)}
        cache, n = fetch(arr, salt=salt)
        stops = sorted({b for b in boundaries if n < b < len(arr)} | {len(arr)})
        if not self.layout.has_state:
            stops = [len(arr)]  # deltas can be cut anywhere: one save at the end
        for start, stop in zip([n] + stops, stops):
            self.extend(cache, arr, start, stop, step_tokens=step_tokens)
            bounds = [b for b in boundaries if b < stop]
            self.writes.save(
                arr[:stop], cache, kind=kind, pin=pin, boundaries=bounds, tree=tree
            )
        return {"tokens": len(arr), "computed": len(arr) - n, "reused": n}

    def extend(
        self, cache: List[Any], tokens, start: int, end: int, *, step_tokens: int
    ) -> None:
        """Run the model over ``tokens[start:end]`` into ``cache`` (which holds
        ``tokens[:start]``), ``step_tokens`` at a time, and note the rate."""
        arr = as_token_array(tokens)
        tic = time.perf_counter()
        for s in range(start, end, step_tokens):
            self.model(mx.array(arr[s : min(s + step_tokens, end)])[None], cache=cache)
            mx.eval([c.state for c in cache])
        self.note_prefill(end - start, time.perf_counter() - tic)

    def note_prefill(self, tokens: int, seconds: float) -> None:
        """The model prefilled ``tokens`` tokens in ``seconds``: a new rate is kept
        in the store with the next accesses."""
        if self.policy.rates.note_prefill(tokens, seconds):
            self.accesses.keep_rates()
