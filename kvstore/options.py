"""Options shared by the ``kvstore`` commands and ``kvstore serve``: argparse types for
sizes and bounded integers, the default store directory, and the size options."""

import argparse
import math
import os
from typing import Optional


def default_store() -> str:
    """``$KVSTORE_DIR``, else ``<user cache>/kvstore/store``."""
    env = os.environ.get("KVSTORE_DIR")
    if env:
        return env
    from .platform.paths import cache_root

    return os.path.join(cache_root(), "store")


MAX_SIZE = 1 << 60  # 1 EiB: no disk (or RAM) holds more; larger sizes are typos


def parse_size(text: str) -> int:
    """Parse ``123``, ``10K``, ``512M``, ``2G`` (binary units) into bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
    t = text.strip().upper().rstrip("B").rstrip("I")
    try:
        if t and t[-1] in units:
            number, scale = float(t[:-1]), units[t[-1]]
        else:
            number, scale = int(t), 1
    except ValueError:
        number = math.nan
    if not math.isfinite(number):  # also inf and nan
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 500M, 2G)")
    if number < 0:
        raise argparse.ArgumentTypeError(f"size must not be negative: {text!r}")
    if number * scale > MAX_SIZE:
        raise argparse.ArgumentTypeError(
            f"size {text!r} is larger than any disk (at most 1024P)"
        )
    return int(number * scale)


def parse_budget(text: str) -> int:
    """A disk budget: a size above 0 (a budget of 0 would keep nothing)."""
    value = parse_size(text)
    if value == 0:
        raise argparse.ArgumentTypeError(
            "a budget of 0 would keep nothing: give a size, or leave the option out "
            "to keep the store's budget"
        )
    return value


def int_at_least(minimum: int, maximum: int = 1 << 30):
    """An argparse type: an integer from ``minimum`` to ``maximum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum}, got {value}")
        return value

    return parse


def store_disk_budget(path: str, given: Optional[int]) -> Optional[int]:
    """``--disk-bytes`` if given, else the budget the store recorded when one was last
    given (a store keeps its budget across runs, as ``kvstore gc`` does)."""
    if given is not None:
        return given
    from . import maintenance
    from .disk.index import StoreError

    try:
        return maintenance.disk_budget(path)
    except StoreError:  # not a store yet: no budget recorded
        return None


def add_disk_budget_option(p: argparse.ArgumentParser) -> None:
    """``--disk-bytes`` (prefill, serve and pull)."""
    p.add_argument(
        "--disk-bytes",
        type=parse_budget,
        default=None,
        metavar="SIZE",
        help="disk budget of the store, e.g. 20G: least recently used unpinned "
        "prefixes are evicted (default: the budget last given to this store, if any)",
    )


def add_size_options(p: argparse.ArgumentParser) -> None:
    """``--disk-bytes``, ``--ram-bytes``, ``--salt-disk-bytes``, ``--restore-room``
    and ``--restore`` (shared by prefill and serve)."""
    add_disk_budget_option(p)
    p.add_argument(
        "--ram-bytes",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="budget of the in-memory tier, e.g. 2G (default: 512M)",
    )
    p.add_argument(
        "--salt-disk-bytes",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="quota of each cache salt, e.g. 2G: a salted save evicts that salt's "
        "least recently used prefixes, never another's; a tenant's quota covers "
        "all its cache_salt trees (default: none)",
    )
    p.add_argument(
        "--restore-room",
        type=int_at_least(0),
        default=None,
        metavar="TOKENS",
        help="room left in a restored cache for the prompt's rest, so the next "
        "forward pass writes in place instead of copying every layer (default: "
        "2048; 0 allocates exactly the restored tokens)",
    )
    p.add_argument(
        "--restore",
        choices=("auto", "always", "never"),
        default=None,
        help="auto: restore a stored prefix only when reading it is faster than "
        "prefilling it, by rates measured on this machine; always / never force "
        "either way (default: $KVSTORE_RESTORE, else auto)",
    )


def seconds(text: str) -> float:
    """An argparse type: a finite number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value < 1e9):
        raise argparse.ArgumentTypeError(
            f"not a number of seconds above 0: {text!r} (e.g. 2 or 0.5)"
        )
    return value


# --remote-* option -> RemoteTier argument (defaults: RemoteTier's own).
REMOTE_TIMEOUTS = {
    "remote_timeout": "lookup_timeout",
    "remote_connect_timeout": "connect_timeout",
    "remote_read_timeout": "read_timeout",
    "remote_retry_after": "open_seconds",
}


def add_remote_options(p: argparse.ArgumentParser, *, required: bool, help: str):
    """``--remote URL`` and the remote tier's waits (prefill, push, pull, serve)."""
    p.add_argument("--remote", metavar="URL", required=required, help=help)
    p.add_argument(
        "--remote-timeout",
        type=seconds,
        metavar="S",
        help="longest a fetch waits for the remote before going on without it "
        "(the download continues in the background; default 10)",
    )
    p.add_argument(
        "--remote-connect-timeout",
        type=seconds,
        metavar="S",
        help="connect timeout of each S3 request (default 2)",
    )
    p.add_argument(
        "--remote-read-timeout",
        type=seconds,
        metavar="S",
        help="read timeout of each S3 request (default 10)",
    )
    p.add_argument(
        "--remote-retry-after",
        type=seconds,
        metavar="S",
        help="how long the remote is skipped after repeated failures (default 30)",
    )


def remote_options(args: argparse.Namespace) -> dict:
    """The RemoteTier keyword arguments that ``args`` sets (the rest keep defaults)."""
    out = {}
    for option, name in REMOTE_TIMEOUTS.items():
        value = getattr(args, option, None)
        if value is not None:
            out[name] = value
    return out
