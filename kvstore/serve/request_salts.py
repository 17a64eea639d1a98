"""Cache salts in ``kvstore serve``: from the request to the prompt cache.

mlx-lm's server tokenizes, looks up and inserts prompt caches on one generation
thread, and its ``LRUPromptCache`` interface carries no request: the salt travels
beside it.

* :class:`SaltPolicy` reads a request's salt (the ``cache_salt`` body field,
  ``--salt-header``, ``--require-salt``) in the HTTP handler; a bad one is a 400.
* The handler puts it on mlx-lm's ``CompletionRequest`` (``kvstore_salt``).
* :func:`response_generator_class` wraps ``ResponseGenerator._tokenize`` (which runs
  just before each lookup of a request) and ``_serve_single`` (a whole sequential
  request) to tell the :class:`SaltRouter` whose request it is.
* :func:`batch_generator_class` remembers each batch sequence's salt and tags the
  caches that mlx-lm's batch loop hands to ``insert_cache`` with it
  (:class:`SaltedCache`).

A cache insert whose salt cannot be told is not stored anywhere (counted), so a
change in mlx-lm's loop costs reuse, never a leak between salts.
"""

import threading
import unicodedata
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Tuple

from ..disk.salts import Salt, Tenant, check_salt

UNKNOWN = object()  # a cache whose request cannot be told: never stored

# The mlx_lm.server internals these hooks wrap (checked at start-up).
HOOKED = {
    "ResponseGenerator": ("_tokenize", "_serve_single"),
    "BatchGenerator": ("insert_segments", "extract_cache", "next", "remove"),
    "APIHandler": (
        "validate_model_parameters",
        "handle_chat_completions",
        "handle_text_completions",
    ),
}


class SaltPolicy:
    """Where a request's salt comes from.

    Args:
        header: ``--salt-header``: the header's value is the request's tenant
            (:class:`~kvstore.disk.salts.Tenant`, set by a gateway), whose trees are apart
            from every ``cache_salt``'s. A ``cache_salt`` in the body then narrows the
            tenant's tree (``Tenant(header, cache_salt)``, within the tenant's
            quota); without the header it is a plain salt, as on a server without
            ``--salt-header``, and never reaches a tenant's tree.
        required: ``--require-salt``: a request without a salt (without the header,
            when one is configured) is refused.
    """

    def __init__(self, *, header: Optional[str] = None, required: bool = False):
        self.header = header
        self.required = required

    def salt_of(self, body: dict, headers) -> Salt:
        """The salt of a request: None, a ``cache_salt`` string, or a Tenant.

        Raises:
            ValueError: a message naming the field or header (sent back as a 400).
        """
        body_salt = body.get("cache_salt")  # null: not given, as in vLLM's server
        try:
            check_salt(body_salt, what="cache_salt")
        except TypeError as e:
            raise ValueError(str(e)) from None
        if self.header is None:
            if self.required and body_salt is None:
                raise ValueError(
                    "cache_salt is required by this server (--require-salt): send a "
                    "non-empty string"
                )
            return body_salt
        values = headers.get_all(self.header) or []
        if len(values) > 1:
            raise ValueError(
                f"header {self.header} was sent {len(values)} times; send it once"
            )
        if not values:
            if self.required:
                raise ValueError(
                    f"header {self.header} is required by this server (--require-salt)"
                )
            return body_salt
        return Tenant(header_text(values[0], what=f"header {self.header}"), body_salt)


def header_text(value: str, *, what: str) -> str:
    """A tenant header's value as the client sent it: the UTF-8 text of its bytes,
    without HTTP's optional whitespace (space, tab) around it.

    ``http.server`` hands header values over decoded as ISO-8859-1, one character
    per byte: encoding them back gives the bytes sent.

    Raises:
        ValueError: empty, longer than 256 bytes, not UTF-8, or holding a control
            character.
    """
    value = value.strip(" \t")
    try:
        value = value.encode("latin-1").decode("utf-8")
    except UnicodeEncodeError:
        pass  # not from http.server's parser: already text
    except UnicodeDecodeError:
        raise ValueError(f"{what} is not valid UTF-8") from None
    bad = next((c for c in value if unicodedata.category(c) == "Cc"), None)
    if bad is not None:
        raise ValueError(f"{what} holds a control character (U+{ord(bad):04X})")
    check_salt(value, what=what)
    return value


class SaltedCache(list):
    """A list of layer caches tagged with the salt of the request it came from."""

    def __init__(self, layers, salt):
        super().__init__(layers)
        self.kvstore_salt = salt


class SaltRouter:
    """The salt of the request mlx-lm's generation thread is working on.

    ``set_request`` is called before each request's lookup (``_tokenize``);
    ``sequential`` spans a whole sequential request (lookup and insert).
    """

    def __init__(self):
        self._local = threading.local()

    def set_request(self, salt: Salt) -> None:
        self._local.request = salt

    def request(self):
        """The salt of the request being looked up, or :data:`UNKNOWN`."""
        return getattr(self._local, "request", UNKNOWN)

    @contextmanager
    def sequential(self, salt: Salt) -> Iterator[None]:
        self._local.sequential = salt
        try:
            yield
        finally:
            self._local.sequential = UNKNOWN

    def sequential_salt(self):
        """The salt of the sequential request running, or :data:`UNKNOWN`."""
        return getattr(self._local, "sequential", UNKNOWN)


def response_generator_class(base, router: SaltRouter):
    """mlx-lm's ``ResponseGenerator`` telling ``router`` whose request it serves."""

    class SaltedResponseGenerator(base):
        def _tokenize(self, tokenizer, request, args):
            router.set_request(getattr(request, "kvstore_salt", None))
            out = super()._tokenize(tokenizer, request, args)
            if not out[0]:
                # mlx-lm's generation thread dies on an empty prompt; this error
                # goes back to the request instead (both paths catch it).
                raise ValueError("the prompt is empty: nothing to generate from")
            return out

        def _serve_single(self, request, *args, **kwargs):
            with router.sequential(getattr(request[1], "kvstore_salt", None)):
                return super()._serve_single(request, *args, **kwargs)

    return SaltedResponseGenerator


def batch_generator_class(base, router: SaltRouter):
    """mlx-lm's ``BatchGenerator`` that tags the caches it hands out with their
    sequence's salt (the salt of the request looked up just before it was inserted)."""

    class SaltedBatchGenerator(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._kvstore_salts = {}

        def insert_segments(self, *args, **kwargs):
            uids = super().insert_segments(*args, **kwargs)
            salt = router.request() if len(uids) == 1 else UNKNOWN
            for uid in uids:
                self._kvstore_salts[uid] = salt
            return uids

        def extract_cache(self, uids):
            out = super().extract_cache(uids)
            return {
                uid: (SaltedCache(cache, self._kvstore_salts.get(uid, UNKNOWN)), key)
                for uid, (cache, key) in out.items()
            }

        def next(self, *args, **kwargs):
            prompt_responses, gen_responses = super().next(*args, **kwargs)
            for r in gen_responses:
                if r.finish_reason is not None:
                    salt = self._kvstore_salts.pop(r.uid, UNKNOWN)
                    if r.prompt_cache is not None:
                        r.prompt_cache = SaltedCache(r.prompt_cache, salt)
            return prompt_responses, gen_responses

        def remove(self, uids, *args, **kwargs):
            out = super().remove(uids, *args, **kwargs)
            for uid in uids:
                self._kvstore_salts.pop(uid, None)
            return out

    return SaltedBatchGenerator


def missing_hooks(mls, hooked: Dict[str, Tuple[str, ...]] = HOOKED) -> List[str]:
    """The ``mlx_lm.server`` names of ``hooked`` that this mlx-lm lacks."""
    out = []
    for cls_name, methods in hooked.items():
        cls = getattr(mls, cls_name, None)
        if cls is None:
            out.append(f"mlx_lm.server.{cls_name}")
            continue
        out += [f"mlx_lm.server.{cls_name}.{m}" for m in methods if not hasattr(cls, m)]
    return out
