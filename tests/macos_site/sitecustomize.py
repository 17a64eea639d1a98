"""On ``PYTHONPATH`` for the tests' child processes: in macOS mode
(``KVSTORE_TEST_PLATFORM=macos``) apply :mod:`macos_shim` before anything else runs,
then run the ``sitecustomize`` this one shadows, if any."""

import os
import sys

if os.environ.get("KVSTORE_TEST_PLATFORM") == "macos":
    import macos_shim

    macos_shim.apply()


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        path = os.path.join(entry or ".", "sitecustomize.py")
        if os.path.abspath(entry or ".") != here and os.path.isfile(path):
            with open(path) as f:
                code = compile(f.read(), path, "exec")
            exec(code, {"__name__": "sitecustomize", "__file__": path})
            return


_chain()
