"""Make this Linux Python look like macOS's to kvstore: the tests' macOS mode.

With ``KVSTORE_TEST_PLATFORM=macos`` the tests run kvstore through the fallbacks it
takes where Linux-only calls are missing (see docs/macos.md):

* ``os`` functions macOS's Python does not have are removed (``preadv``,
  ``pwritev``, ``posix_fadvise``, ``posix_fallocate``, ``fdatasync``,
  ``sched_getaffinity``, ``O_DIRECT``...; not the xattr calls, which the standard
  library's ``shutil`` binds at its import);
* ``/proc`` does not exist: opening anything under it fails with
  ``FileNotFoundError``, as on macOS;
* libc calls kvstore binds through ctypes on Linux only are unbound as soon as their
  module is imported (``fsutil.sync_file_range``; ``memutil``'s ``madvise``
  prefaulting and page release);
* ``fcntl.F_FULLFSYNC`` exists (macOS's value, 51) and is carried out as an
  ``fsync``; :data:`FULLFSYNC_CALLS` counts the calls.

What cannot be faked is not: ``sys.platform`` stays ``"linux"`` (MLX and mlx-lm
look at it), the kernel and file system are Linux's, and the libc calls kvstore
reaches through ctypes on macOS (``sysctl``, ``renamex_np``) are not made here.
:func:`apply` is idempotent; ``tests/conftest.py`` calls it in the test process and
``sitecustomize`` (this directory, on ``PYTHONPATH``) in every child process.
"""

import builtins
import importlib.abc
import io
import os
import sys

ENV = "KVSTORE_TEST_PLATFORM"
F_FULLFSYNC = 51
FULLFSYNC_CALLS = [0]

HIDDEN_OS = (
    "preadv",
    "pwritev",
    "posix_fadvise",
    "posix_fallocate",
    "fdatasync",
    "sched_getaffinity",
    "sched_setaffinity",
    "memfd_create",
    "copy_file_range",
    "splice",
    "eventfd",
    "pidfd_open",
    "O_DIRECT",
    "O_NOATIME",
    "O_PATH",
    "O_TMPFILE",
    "RWF_NOWAIT",
    "RWF_HIPRI",
    "RWF_DSYNC",
    "RWF_SYNC",
    "RWF_APPEND",
)


def active() -> bool:
    return os.environ.get(ENV) == "macos"


def _is_proc(path) -> bool:
    try:
        p = os.fsdecode(path) if not isinstance(path, int) else ""
    except TypeError:
        return False
    return p == "/proc" or p.startswith("/proc/")


def _no_proc(real):
    def call(file, *args, **kwargs):
        if _is_proc(file):
            raise FileNotFoundError(2, "No such file or directory (macOS mode)", file)
        return real(file, *args, **kwargs)

    call.__wrapped__ = real
    call._macos_shim = True
    return call


def _unbind_sync_file_range(fsutil) -> None:
    fsutil.sync_file_range = None


def _no_madvise(memutil) -> None:
    memutil.disable_prefault()
    memutil.disable_release()


# Modules binding Linux-only libc calls through ctypes, and how each is made to take
# its macOS path right after it is imported.
LINUX_LIBC_CALLS = {
    "kvstore.platform.fsutil": _unbind_sync_file_range,
    "kvstore.platform.memutil": _no_madvise,
}


class _HideLibcCalls(importlib.abc.MetaPathFinder):
    """Unbind a module's Linux-only libc calls right after it is imported."""

    def find_spec(self, name, path, target=None):
        if name not in LINUX_LIBC_CALLS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_hide(module):
            exec_module(module)
            LINUX_LIBC_CALLS[name](module)

        spec.loader.exec_module = exec_and_hide
        return spec


def _hide_libc_calls() -> None:
    for name, hide in LINUX_LIBC_CALLS.items():
        if name in sys.modules:
            hide(sys.modules[name])
    sys.meta_path.insert(0, _HideLibcCalls())


def apply() -> None:
    """Hide the Linux-only calls and fake ``F_FULLFSYNC`` (once per process)."""
    if getattr(os, "_kvstore_macos_shim", False):
        return
    os._kvstore_macos_shim = True
    _hide_libc_calls()
    for name in HIDDEN_OS:
        if hasattr(os, name):
            delattr(os, name)
    for name in [n for n in dir(os) if n.startswith("POSIX_FADV_")]:
        delattr(os, name)
    builtins.open = _no_proc(builtins.open)
    io.open = _no_proc(io.open)
    os.open = _no_proc(os.open)
    os.listdir = _no_proc(os.listdir)
    os.stat = _no_proc(os.stat)

    import fcntl

    real_fcntl = fcntl.fcntl

    def fake_fcntl(fd, cmd, arg=0):
        if cmd == F_FULLFSYNC:  # macOS: flush the drive's cache; here: an fsync
            FULLFSYNC_CALLS[0] += 1
            os.fsync(fd)
            return 0
        return real_fcntl(fd, cmd, arg)

    fcntl.F_FULLFSYNC = F_FULLFSYNC
    fcntl.fcntl = fake_fcntl
