"""Which mlx-lm versions kvstore supports, and ``kvstore serve``'s start-up check.

The library (``KVStore``, ``stream_generate``) uses mlx-lm's public API only: its cache
classes, ``make_prompt_cache`` and ``stream_generate``. ``kvstore serve`` goes further:
it runs ``mlx_lm.server`` with three of its module-level names replaced
(``LRUPromptCache``, ``ModelProvider``, ``_run_http_server``), subclasses its
``APIHandler`` and ``ModelProvider``, and :class:`kvstore.server.PersistentPromptCache`
stands in for ``mlx_lm.models.cache.LRUPromptCache``. Any of these can change in a
release, so :func:`server_problems` checks every name, signature and attribute that
``kvstore serve`` relies on before a model is loaded; the server refuses to start
(exit status 2) when one is missing, instead of failing in the middle of a request.

Importing this module does not import ``mlx_lm.server``.
"""

import ast
import inspect
import textwrap
import types
from dataclasses import dataclass
from typing import Any, Iterable, List, Optional, Set, Tuple


@dataclass(frozen=True)
class VersionRange:
    """mlx-lm versions kvstore declares (``lower <= v < upper``), and those tested."""

    lower: str
    upper: str
    tested: Tuple[str, ...]

    def __str__(self) -> str:
        return f">={self.lower},<{self.upper}"

    def contains(self, version: str) -> bool:
        v = _numeric(version)
        return v is not None and _numeric(self.lower) <= v < _numeric(self.upper)


# Keep in step with pyproject.toml's dependency (tests/test_compat.py checks it) and
# with the ends tools/mlx_lm_range.py tests. Before 0.32.0, ChunkedKVCache kept its
# positions outside ``state`` and trimmed by buffer length (Llama 4 restores broke)
# and ModelProvider had no ``_load`` (docs/mlx-lm-range.md).
SUPPORTED_RANGE = VersionRange("0.32.0", "0.33", ("0.32.0", "0.32.2"))


def _numeric(version: str) -> Optional[Tuple[int, ...]]:
    """``"0.32.2"`` -> ``(0, 32, 2)``; None for a version that is not plain numbers."""
    try:
        return tuple(int(x) for x in version.split("+")[0].split("."))
    except ValueError:
        return None


def mlx_lm_version() -> str:
    """The installed mlx-lm's version, or ``"unknown"``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mlx-lm")
    except PackageNotFoundError:
        return "unknown"


# -- what a class or function looks like, read without running it ------------------


def _assigned_attributes(cls: type) -> Set[str]:
    """Names ``X`` assigned as ``self.X = ...`` anywhere in ``cls``'s own source
    (and its bases'), plus its class attributes."""
    names: Set[str] = set()
    for klass in inspect.getmro(cls):
        if klass is object:
            continue
        names.update(vars(klass))
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                names.add(node.attr)
    return names


def _global_names(fn: Any) -> Set[str]:
    """Global names a function looks up when it runs (nested code included)."""
    names: Set[str] = set()
    code = getattr(fn, "__code__", None)
    todo = [code] if code is not None else []
    while todo:
        c = todo.pop()
        names.update(c.co_names)
        todo.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return names


def _params(fn: Any) -> Optional[List[inspect.Parameter]]:
    try:
        return list(inspect.signature(fn).parameters.values())[1:]  # without self
    except (TypeError, ValueError):
        return None


def _public(cls: type) -> Set[str]:
    """Public methods and properties of ``cls`` (nested classes and data excluded)."""
    return {
        name
        for name, value in inspect.getmembers(cls)
        if not name.startswith("_")
        and (inspect.isfunction(value) or isinstance(value, property))
    }


# -- the checks -----------------------------------------------------------------------

# Names kvstore.server reads from mlx_lm.server, and what each must be.
_SERVER_NAMES = (
    ("LRUPromptCache", "replaced by PersistentPromptCache's factory"),
    ("ModelProvider", "subclassed and replaced"),
    ("_run_http_server", "replaced to pass kvstore's server class and handler"),
    ("APIHandler", "subclassed (GET /kvstore/stats, --strip-pattern)"),
    ("ResponseGenerator", "holds the prompt cache read by GET /kvstore/stats"),
    ("run", "must look the replaced names up when it runs"),
    ("main", "runs the server"),
)
# Replacing a module-level name only takes effect if these functions look it up.
_LOOKUPS = (
    ("run", ("LRUPromptCache", "_run_http_server")),
    ("main", ("ModelProvider", "run")),
)
_PROVIDER_ATTRS = ("cli_args", "model_key", "model", "tokenizer", "draft_model")
_HANDLER_METHODS = (
    "handle_chat_completions",
    "handle_text_completions",
    "do_GET",
    "_set_completion_headers",
)
_HANDLER_ATTRS = ("body", "response_generator")
_LRU_ATTRS = ("max_size", "max_bytes")


def _server_module_problems(mls) -> List[str]:
    problems = []
    for name, why in _SERVER_NAMES:
        if not hasattr(mls, name):
            problems.append(f"mlx_lm.server.{name} is missing ({why})")
    if problems:
        return problems
    for fn, names in _LOOKUPS:
        missing = [n for n in names if n not in _global_names(getattr(mls, fn))]
        if missing:
            problems.append(
                f"mlx_lm.server.{fn} no longer uses {', '.join(missing)} "
                "(kvstore serve replaces them there)"
            )
    params = _params_all(mls._run_http_server)
    wanted = ("server_class", "handler_class")
    if params is None or any(p not in params for p in wanted) or len(params) < 4:
        problems.append(
            "mlx_lm.server._run_http_server(host, port, response_generator, *, "
            "server_class, handler_class) has another signature: "
            f"{_sig(mls._run_http_server)}"
        )
    provider = mls.ModelProvider
    if not callable(getattr(provider, "_load", None)):
        problems.append("mlx_lm.server.ModelProvider._load is missing")
    missing = [a for a in _PROVIDER_ATTRS if a not in _assigned_attributes(provider)]
    if missing:
        problems.append(
            f"mlx_lm.server.ModelProvider no longer sets {', '.join(missing)}"
        )
    handler = mls.APIHandler
    missing = [m for m in _HANDLER_METHODS if not callable(getattr(handler, m, None))]
    missing += [a for a in _HANDLER_ATTRS if a not in _assigned_attributes(handler)]
    if missing:
        problems.append(f"mlx_lm.server.APIHandler lacks {', '.join(missing)}")
    if "prompt_cache" not in _assigned_attributes(mls.ResponseGenerator):
        problems.append("mlx_lm.server.ResponseGenerator no longer sets prompt_cache")
    return problems


def _params_all(fn) -> Optional[List[str]]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def _sig(fn) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(unknown)"


def _prompt_cache_problems(lru: type, ours: type) -> List[str]:
    """``ours`` must offer everything public ``lru`` has, with the same parameters."""
    problems = []
    init = _params_all(lru.__init__)
    if init is None or not {"max_size", "max_bytes"} >= set(init[1:]):
        problems.append(
            f"LRUPromptCache{_sig(lru)} takes other arguments than "
            "(max_size, max_bytes)"
        )
    missing = sorted(_public(lru) - _public(ours))
    if missing:
        problems.append(
            f"LRUPromptCache has {', '.join(missing)}, which kvstore's "
            "PersistentPromptCache does not provide"
        )
    for name in sorted((_public(lru) & _public(ours)) | {"__len__"}):
        theirs, mine = getattr(lru, name, None), getattr(ours, name, None)
        if isinstance(theirs, property) or isinstance(mine, property):
            if type(theirs) is not type(mine):
                problems.append(f"LRUPromptCache.{name}: property vs method differs")
            continue
        if theirs is None or mine is None:
            problems.append(f"LRUPromptCache.{name} is missing")
            continue
        want = [(p.name, p.kind) for p in _params(theirs) or ()]
        # Keyword-only parameters of ours with a default (the cache salt) are never
        # passed by mlx-lm: compatible.
        have = [
            (p.name, p.kind)
            for p in _params(mine) or ()
            if p.kind is not p.KEYWORD_ONLY
            or p.default is p.empty
            or (p.name, p.kind) in want
        ]
        if want != have:
            problems.append(
                f"LRUPromptCache.{name}{_sig(theirs)} differs from kvstore's "
                f"{name}{_sig(mine)}"
            )
    missing = [a for a in _LRU_ATTRS if a not in _assigned_attributes(lru)]
    if missing:
        problems.append(f"LRUPromptCache no longer sets {', '.join(missing)}")
    return problems


def server_problems(
    mls=None, lru: Optional[type] = None, *, cache_class: type
) -> List[str]:
    """Every mlx-lm name or signature ``kvstore serve`` relies on that is missing or
    changed in the installed mlx-lm (empty when all is there).

    Args:
        mls: The ``mlx_lm.server`` module (default: imported).
        lru: ``mlx_lm.models.cache.LRUPromptCache`` (default: imported).
        cache_class: What stands in for ``lru``
            (:class:`kvstore.server.PersistentPromptCache`).
    """
    problems = []
    if mls is None:
        try:
            import mlx_lm.server as mls
        except Exception as e:  # an ImportError, or a broken module
            return [f"mlx_lm.server cannot be imported ({type(e).__name__}: {e})"]
    if lru is None:
        try:
            from mlx_lm.models.cache import LRUPromptCache as lru
        except ImportError:
            problems.append("mlx_lm.models.cache.LRUPromptCache is missing")
    problems += _server_module_problems(mls)
    if lru is not None:
        problems += _prompt_cache_problems(lru, cache_class)
    return problems


def server_refusal(problems: Iterable[str], version: Optional[str] = None) -> str:
    """The message ``kvstore serve`` prints before it exits with status 2."""
    version = version or mlx_lm_version()
    lines = [
        f"kvstore serve: the installed mlx-lm {version} lacks what kvstore serve "
        f"relies on; supported: mlx-lm {SUPPORTED_RANGE} (tested "
        f"{' and '.join(SUPPORTED_RANGE.tested)}).",
        *(f"  - {p}" for p in problems),
        f"Install a supported version: pip install 'mlx-lm{SUPPORTED_RANGE}'",
    ]
    return "\n".join(lines)


def check_server(*, cache_class: type, out=None) -> bool:
    """Run :func:`server_problems`; print the refusal (to ``out``, default stderr) and
    return False when something is missing. A version outside the declared range that
    passes every check gets a one-line warning and True."""
    import sys

    out = out or sys.stderr
    problems = server_problems(cache_class=cache_class)
    version = mlx_lm_version()
    if problems:
        print(server_refusal(problems, version), file=out)
        return False
    if not SUPPORTED_RANGE.contains(version):
        print(
            f"kvstore serve: warning: mlx-lm {version} is outside the tested range "
            f"{SUPPORTED_RANGE}; every name kvstore serve uses is present",
            file=out,
        )
    return True
