"""Keeping liblmdb off damaged pages while the open store's full page check runs.

A library open checks a bounded set of pages (:func:`kvstore.disk.mdbcheck.check_roots`).
Below a large tree's root, a zeroed page met by a cursor stepping sideways ends the
process in liblmdb's assertions. So every open that did not check every page starts a
:class:`PageAudit`: :func:`~kvstore.disk.mdbcheck.check_file` in a thread of its own,
inside a read transaction (for a file of more than :data:`CHILD_PAGES` pages, in a
child process the thread waits for, so the check takes no interpreter time from the
caller's threads; a child that fails leaves writes to check for themselves). Until
it has passed:

* the read path's cursor ranges are checked first (:meth:`PageAudit.cover`:
  :func:`~kvstore.disk.mdbcheck.check_range`, each leaf once per process);
* whole-index scans and write transactions wait for it (:meth:`PageAudit.wait`):
  a write reads the free list (which must name no page in use) and a deletion
  moves records between neighbouring pages.

An open that finds the clean mark the last close left (:mod:`kvstore.disk.cleanmark`:
that process's check passed and nothing else changed the file since) passes at once.

Once it has passed, every page this process can reach is one it checked or one LMDB
wrote since (LMDB copies a page before changing it and writes every page it hands
out), and nothing is checked or waited for any more. Damage written into the file
afterwards is met by liblmdb itself (:meth:`kvstore.disk.index.Index.read`).
"""

import json
import logging
import os
import subprocess
import sys
import threading
from typing import Callable, Dict, Optional, Set, Tuple

from ..platform import fsutil
from . import cleanmark, mdbcheck

log = logging.getLogger("kvstore")

# After every key that starts with a given prefix (LMDB's keys: at most 511 bytes).
_KEY_END = b"\xff" * 512
# A pause every so many pages, for the process's other threads (see _tick).
_PACE_PAGES, _PACE_SECONDS = 16, 0.0002
_RETRY_SECONDS = 0.001
# Files of more pages are checked by a child process (~30 us of Python per page:
# ~6 s of CPU at a million nodes, which in a thread of its own would take the
# interpreter from the caller's threads: lookups 10-20x slower meanwhile).
CHILD_PAGES = 8192
# The child: mdbcheck and mdbfile alone (no kvstore, MLX or site packages to import),
# at a lower priority, on the descriptor and the meta page its parent's snapshot has.
_CHILD = r"""
import json, os, sys, types
package = types.ModuleType("_kvstore_disk")
package.__path__ = [sys.argv[1]]
sys.modules[package.__name__] = package
from _kvstore_disk import mdbcheck
fd, meta, size = int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
free, main, body = mdbcheck.DbRecord(*meta[4]), mdbcheck.DbRecord(*meta[5]), meta[6]
meta = mdbcheck.MetaPage(*meta[:4], free, main, bytes.fromhex(body))
try:
    os.nice(10)
except (AttributeError, OSError):
    pass
try:
    print(json.dumps({"pages": mdbcheck.check_file(fd, meta, size)}))
except mdbcheck.Damage as e:
    print(json.dumps({"damage": str(e)}))
"""


class PageAudit:
    """The full page check of one open index, run once in the background.

    Args:
        data: The path of ``data.mdb``.
        passed: Every page was checked at the open already (``check="full"``).
    """

    def __init__(self, data: str, *, passed: bool):
        self._dir = os.path.dirname(data)
        self._fd = fsutil.open_regular(data)
        self.watch = cleanmark.Watch(self._fd)  # changes since the check began
        self.done = threading.Event()  # passed, failed or stopped
        self.failure: Optional[str] = None  # why it did not pass: damage, or stopped
        self.sound: Set[int] = set()  # leaves checked by cover()
        self.branches: Dict[int, tuple] = {}  # branch pages cover() parsed
        self._stop = threading.Event()
        self._paced = 0  # pages the full check read
        self._thread: Optional[threading.Thread] = None
        # "thread" or "process", once begun; "mark": the clean mark named the file
        self.checked_by: Optional[str] = None
        self._child: Optional[subprocess.Popen] = None  # the check's process, running
        # (txn id, its meta page, its named databases) of the last cover()
        self._snapshot: Optional[Tuple[int, mdbcheck.MetaPage, Dict]] = None
        if passed:
            self.watch.begin()
            self.done.set()

    @property
    def passed(self) -> bool:
        return self.done.is_set() and self.failure is None

    def trust_mark(self) -> bool:
        """Pass at once where ``index/checked`` names the file as it is now
        (:mod:`kvstore.disk.cleanmark`); returns whether the check has passed."""
        if not self.done.is_set() and cleanmark.matches(self._dir, self._fd):
            self.watch.begin()
            self.checked_by = "mark"
            self.done.set()
        return self.passed

    def leave_mark(self) -> bool:
        """At the close, with the index's data on disk: leave the clean mark if the
        check passed and nothing but this process's commits changed the file since
        it began."""
        if not (self.passed and self.watch.unchanged()):
            return False
        return cleanmark.write(self._dir, self._fd)

    def set_passed(self) -> None:
        """Every page was checked meanwhile (a full-check open of the same index)."""
        self._stop.set()
        self._join()
        self._stop.clear()
        self.failure = None
        self.done.set()

    def start(
        self,
        read: Callable[[Callable], object],
        on_damage: Callable[[str], None],
        *,
        name: str,
    ) -> None:
        """Run the check in a daemon thread: ``read(fn)`` runs ``fn(txn)`` in a read
        transaction (never waiting for this check); ``on_damage(problem)`` is called
        with the first damage found."""
        if self.done.is_set():
            return

        def run():
            try:
                self._stop.wait(_PACE_SECONDS)  # the opening thread goes on first
                # None: two commits overwrote the transaction's meta page before it
                # was read (other writers are busy): not damage; again, a bit later.
                while (pages := read(self._check_all)) is None:
                    if self._stop.wait(_RETRY_SECONDS):
                        raise mdbcheck.Stopped()
                log.debug("kvstore: %s: %d index pages checked", name, pages)
                self.sound, self.branches = set(), {}  # not needed again
            except mdbcheck.Damage as e:
                self.failure = str(e)
                on_damage(self.failure)
            except mdbcheck.Stopped:
                self.failure = "stopped"
            except Exception as e:  # the index met damage itself, closed, an lmdb error
                self.failure = f"{type(e).__name__}: {e}"  # writes check for themselves
            finally:
                self.done.set()

        self._thread = threading.Thread(
            target=run, name="kvstore-page-check", daemon=True
        )
        self._thread.start()

    def _check_all(self, txn) -> Optional[int]:
        """Pages checked, or None: ``txn``'s meta page was overwritten meanwhile.
        ``txn`` stays open meanwhile: LMDB reuses none of its snapshot's pages."""
        meta = self._meta(txn)
        if meta is None:
            return None
        self.watch.begin(txn.id())
        size = os.fstat(self._fd).st_size
        if size // meta.page_size > CHILD_PAGES:
            return self._check_in_child(meta, size)
        self.checked_by = "thread"
        return mdbcheck.check_file(self._fd, meta, size, tick=self._tick)

    def _check_in_child(self, meta: mdbcheck.MetaPage, size: int) -> int:
        """:func:`~kvstore.disk.mdbcheck.check_file` in a child process.

        Raises:
            mdbcheck.Damage: what it found.
            mdbcheck.Stopped: :meth:`close` meanwhile (the child is killed).
            RuntimeError: the child did not answer (writes then check for themselves).
        """
        self.checked_by = "process"
        fields = [*meta[:4], list(meta.free), list(meta.main), meta.body.hex()]
        here = os.path.dirname(os.path.abspath(__file__))
        argv = [sys.executable, "-I", "-S", "-c", _CHILD, here, str(self._fd)]
        child = subprocess.Popen(
            argv + [json.dumps(fields), str(size)],
            pass_fds=(self._fd,),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._child = child
        try:
            if self._stop.is_set():  # close() came first and found no child to end
                child.kill()
            out, err = child.communicate()
        finally:
            self._child = None
        if self._stop.is_set():
            raise mdbcheck.Stopped()
        try:
            answer = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            tail = err.strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(
                f"the page check process ended with status {child.returncode}: "
                f"{tail[0][:200]}"
            ) from None
        if "damage" in answer:
            raise mdbcheck.Damage(answer["damage"])
        return int(answer["pages"])

    def _tick(self) -> None:
        """Before each page: end when stopped, and every ``_PACE_PAGES`` pages let
        the process's other threads have the interpreter (Python hands it over only
        every 5 ms to a thread that waits: a caller's generate loop would wait)."""
        if self._stop.is_set():
            raise mdbcheck.Stopped()
        self._paced += 1
        if self._paced % _PACE_PAGES == 0:
            self._stop.wait(_PACE_SECONDS)  # a pause that close() cuts short

    def wait(self) -> Optional[str]:
        """Wait for the check; returns why it did not pass, or None."""
        self.done.wait()
        return self.failure

    def cover(self, txn, name: str, prefix: bytes = b"") -> bool:
        """Check the pages of database ``name`` that a cursor of ``txn`` confined to
        keys starting with ``prefix`` can step onto (nothing once the full check
        passed). False: ``txn``'s meta page is no longer in the file (two commits
        since it began), so nothing could be checked: the caller must not step.

        Raises:
            mdbcheck.Damage: a damaged page.
        """
        if self.passed:
            return True
        txnid = txn.id()
        snapshot = self._snapshot
        if snapshot is None or snapshot[0] != txnid:
            meta = self._meta(txn)
            if meta is None:
                return False
            size = os.fstat(self._fd).st_size
            snapshot = (txnid, meta, mdbcheck.named_databases(self._fd, meta, size))
            self._snapshot = snapshot  # one tuple: threads may share it
        _, meta, roots = snapshot
        db = roots.get(name)
        if db is not None:
            hi = prefix + _KEY_END if prefix else None
            size = os.fstat(self._fd).st_size
            mdbcheck.check_range(
                self._fd, meta, size, name, db, prefix, hi, self.sound, self.branches
            )
        return True

    def _meta(self, txn) -> Optional[mdbcheck.MetaPage]:
        """The meta page of ``txn``'s snapshot, or None (overwritten since)."""
        metas = mdbcheck.read_meta_pages(self._fd)
        mine = [m for m in metas if m is not None and m.txnid == txn.id()]
        return mine[0] if mine else None

    def _join(self) -> None:
        """Wait for the check's thread to end (after ``_stop``: a child is ended)."""
        child = self._child
        if child is not None:
            child.kill()  # nothing if it has ended (Popen polls first)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def close(self) -> None:
        """Stop the check (before the environment closes) and release the file."""
        self._stop.set()
        self._join()
        self.done.set()
        os.close(self._fd)
