"""A restore rate measured on purpose, before any fetch needs one.

``restore="auto"`` weighs each restore by the rate restores read at on this machine,
which only restores measure: a process opening a store that it (or ``kvstore
prefill``) only wrote knows none, and restores every stored prefix until one has
run. :func:`measure_restore_rate` measures one first: the first node of a stored
prompt read alone (the fixed time), then that prompt up to :data:`CALIBRATION_BYTES`
(the byte rate), both restored as a fetch restores them, on the page cache as it is.
Nothing is counted as a fetch, no access time changes, and the arrays are dropped.

``kvstore serve`` does not call it: with the rate measured at its start, the queue
it weighs returning users against (``kvstore.serve.pacing.Backlog``) sent 4 of 16
returning users to be prefilled, 4 restores of whole prompts then ran side by side
(0.64-1.21 s each, against 2 at a time of 0.20-0.38 s with no rate known), and the
first round took 1.96 s against 1.15-1.40 s (docs/gpu.md).
"""

import logging
import time
from typing import List

from ..disk.index import CorruptRecord
from .restore import ReadPath
from .walk import Step

log = logging.getLogger("kvstore")

# The most bytes of a stored prompt read to measure the rate (a tenth of a second
# from a warm page cache on a GPU host; a few from a cold disk).
CALIBRATION_BYTES = 256 << 20


def first_stored_path(reads: ReadPath, *, max_bytes: int) -> List[Step]:
    """Nodes of one stored prompt of the unsalted tree, from its root: each the
    first child of the one before, while their files add up to ``max_bytes``."""
    index, ns = reads.index, reads.namespace
    path: List[Step] = []
    parent, nbytes = reads.root, 0
    while True:
        children = index.children(ns, parent)
        if not children or children[0] in reads.broken:
            return path
        h = children[0]
        rec = index.get_node(ns, h)
        if rec is None or (path and nbytes + rec.nbytes > max_bytes):
            return path
        path.append(Step(h, rec, rec.ntokens))
        parent, nbytes = h, nbytes + rec.nbytes


def measure_restore_rate(
    reads: ReadPath, *, max_bytes: int = CALIBRATION_BYTES
) -> bool:
    """Restore the first node of a stored prompt, then up to ``max_bytes`` of it,
    and note both in the policy's rates (kept in the store with the next write).
    Layouts with state layers are not measured (their restores need a checkpoint).

    Returns:
        Whether the store held a prompt of two nodes or more, read back whole.
    """
    if reads.layout.has_state:
        return False
    try:
        path = first_stored_path(reads, max_bytes=max_bytes)
    except CorruptRecord as e:
        log.warning("kvstore: no restore rate measured: %s", e)
        return False
    if len(path) < 2:
        return False
    if not sum(reads.read_costs(path)):
        return False  # all in the RAM tier: nothing read to measure
    for steps in (path[:1], path):
        seconds = _timed_restore(reads, steps)
        if seconds is None:
            return False
        reads.policy.rates.note_restore(sum(reads.read_costs(steps)), seconds)
    reads.accesses.keep_rates()
    rates = reads.policy.rates
    log.info(
        "kvstore: restores measured at %.2f GB/s past %.1f ms (%d tokens read)",
        (rates.restore or 0) / 1e9,
        (rates.restore_fixed or 0) * 1e3,
        sum(s.take for s in path),
    )
    return True


def _timed_restore(reads: ReadPath, steps: List[Step]):
    """Seconds that restoring ``steps`` took alone (as :meth:`ReadPath.restore`
    rates one; the read leaves the arrays evaluated), or None where a node's file
    turned out broken (reported)."""
    tic = time.perf_counter()
    failures, _, _, sharing = reads.read_reported(steps, sum(s.take for s in steps))
    if failures.first < len(steps):
        return None
    return (time.perf_counter() - tic) / max(1.0, sharing)
