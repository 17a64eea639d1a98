"""Where kvstore keeps its files by default (no MLX needed: the commands that run no
model import this, not the model code)."""

import os
from pathlib import Path


def cache_root() -> Path:
    """The directory kvstore keeps downloaded and converted models in.

    Returns:
        ``$KVSTORE_HOME`` if set, else ``$XDG_CACHE_HOME/kvstore``, else ``~/.cache/kvstore``.
    """
    if os.environ.get("KVSTORE_HOME"):
        return Path(os.environ["KVSTORE_HOME"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "kvstore"
    return Path.home() / ".cache" / "kvstore"
