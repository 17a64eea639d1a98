"""Reading prompt files: one JSON object per line, turned into tokens and node boundaries.

Each line is one of ``{"messages": [...]}`` (rendered with the tokenizer's chat
template), ``{"prompt": "text"}`` or ``{"tokens": [ints]}``, with optional ``"id"``,
``"kind"``, ``"pin"``, ``"salt"`` (the tenant's cache salt, as a server request's
``cache_salt``) and ``"tenant"`` (as ``kvstore serve --salt-header``'s header). Every problem is a :class:`PromptError` naming the field,
and concerns that line only (invalid UTF-8, JSON that Python's parser rejects in any
way, a line too long to read), so the lines after it are still processed.
"""

import json
import sys
import weakref
from dataclasses import dataclass, field
from typing import BinaryIO, Iterator, List, Optional, Sequence, Tuple, Union

from .disk.chunking import as_token_array
from .disk.index import KINDS
from .disk.salts import Salt, Tenant, check_salt
from .generate import encode_prompt

SHAPES = ("messages", "prompt", "tokens")
OPTIONAL = ("id", "kind", "pin", "salt", "tenant")
MAX_LINE_BYTES = 64 << 20  # longer lines are refused unread (bounded memory)


class PromptError(ValueError):
    """A prompt line that cannot be used; the message says which field and why."""


@dataclass
class PromptLine:
    """A parsed line: the tokens to prefill and where nodes must end."""

    lineno: int
    tokens: List[int]
    id: Optional[str] = None
    kind: str = "user"
    pin: bool = False
    salt: Salt = None  # stored in this salt's tree (kvstore.disk.salts)
    system_end: int = 0  # tokens of the system prompt (stored with kind "system")
    boundaries: List[int] = field(default_factory=list)


def read_lines(path: str) -> Iterator[Tuple[int, bytes]]:
    """``(line number, bytes)`` of the non-blank lines of a file (1-based numbers;
    ``-``: standard input). Bytes, so that invalid UTF-8 fails its line only
    (:func:`parse_line` decodes); a line past :data:`MAX_LINE_BYTES` is cut to one
    byte more, which :func:`parse_line` refuses, and the rest of it skipped."""
    if path == "-":
        yield from _lines(sys.stdin.buffer)
        return
    with open(path, "rb") as f:
        yield from _lines(f)


def _lines(f: BinaryIO) -> Iterator[Tuple[int, bytes]]:
    lineno = 0
    while True:
        line = f.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        lineno += 1
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            while True:  # skip the rest of an overlong line
                rest = f.readline(1 << 20)
                if not rest or rest.endswith(b"\n"):
                    break
        if line.strip():
            yield lineno, line


def parse_line(
    lineno: int,
    text: Union[str, bytes],
    tokenizer,
    *,
    default_kind: str = "user",
    default_pin: bool = False,
    default_salt: Optional[str] = None,
    default_tenant: Optional[str] = None,
    vocab_size: Optional[int] = None,
    max_tokens: Optional[int] = None,
) -> PromptLine:
    """Parse one JSONL line into tokens; raises PromptError with the reason.

    The line's ``"salt"`` and ``"tenant"`` win over ``default_salt`` and
    ``default_tenant``; with a tenant the line's salt is ``Tenant(tenant, salt)``
    (the tree ``kvstore serve --salt-header`` serves that tenant's requests with
    that ``cache_salt`` from).

    ``max_tokens``: a text that cannot fit is refused after tokenizing a bounded
    prefix of it (see :func:`_check_length`); the caller checks the token count.
    """
    if isinstance(text, bytes):
        if len(text) > MAX_LINE_BYTES:
            raise PromptError(f"line longer than {MAX_LINE_BYTES} bytes")
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise PromptError(f"invalid UTF-8 at byte {e.start + 1}") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise PromptError(f"invalid JSON: {e.msg} at column {e.colno}") from None
    except RecursionError:
        raise PromptError("invalid JSON: nested too deeply") from None
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        raise PromptError(f"invalid JSON: {str(e)[:100]}") from None
    if not isinstance(obj, dict):
        raise PromptError(f"expected a JSON object, got {type(obj).__name__}")
    shapes = [k for k in SHAPES if k in obj]
    if len(shapes) != 1:
        found = ", ".join(shapes) or "none of them"
        raise PromptError(f"expected exactly one of {', '.join(SHAPES)}; found {found}")
    unknown = sorted(set(obj) - set(SHAPES) - set(OPTIONAL))
    if unknown:
        raise PromptError(f"unknown field {unknown[0]!r}")
    line = PromptLine(lineno, [], kind=default_kind, pin=default_pin)
    salt, tenant = default_salt, default_tenant
    if "id" in obj:
        if not isinstance(obj["id"], (str, int)) or isinstance(obj["id"], bool):
            raise PromptError(
                f"field 'id' must be a string or int, got {_type(obj['id'])}"
            )
        line.id = str(obj["id"])
    if "kind" in obj:
        if obj["kind"] not in KINDS:
            raise PromptError(
                f"field 'kind' must be one of {', '.join(KINDS)}, got {obj['kind']!r}"
            )
        line.kind = obj["kind"]
    if "pin" in obj:
        if not isinstance(obj["pin"], bool):
            raise PromptError(
                f"field 'pin' must be true or false, got {_type(obj['pin'])}"
            )
        line.pin = obj["pin"]
    for name in ("salt", "tenant"):
        if name in obj:
            try:
                check_salt(obj[name], what=f"field {name!r}")
            except (TypeError, ValueError) as e:
                raise PromptError(str(e)) from None
    salt = obj.get("salt", salt)
    tenant = obj.get("tenant", tenant)
    line.salt = salt if tenant is None else Tenant(tenant, salt)

    shape = shapes[0]
    if shape == "tokens":
        line.tokens = _tokens(obj["tokens"], vocab_size)
    elif shape == "prompt":
        if not isinstance(obj["prompt"], str):
            raise PromptError(
                f"field 'prompt' must be a string, got {_type(obj['prompt'])}"
            )
        if not obj["prompt"].strip():
            raise PromptError("field 'prompt' is empty")
        _check_length(tokenizer, obj["prompt"], max_tokens, "field 'prompt'")
        line.tokens = list(encode_prompt(tokenizer, obj["prompt"]))
    else:
        line.tokens, line.system_end, line.boundaries = render_messages(
            tokenizer, obj["messages"], max_tokens=max_tokens
        )
    if not line.tokens:
        raise PromptError(f"field {shape!r} gives no tokens")
    return line


def _tokens(value, vocab_size: Optional[int]) -> List[int]:
    if not isinstance(value, list):
        raise PromptError(f"field 'tokens' must be a list of ints, got {_type(value)}")
    if not value:
        raise PromptError("field 'tokens' is empty")
    for i, t in enumerate(value):
        if isinstance(t, bool):  # JSON true/false: Python ints, but not token ids
            raise PromptError(f"field tokens[{i}] is {str(t).lower()}, not a token id")
    try:
        arr = as_token_array(value, what="tokens")
    except (TypeError, ValueError) as e:
        raise PromptError(f"field {e}") from None
    if vocab_size is not None and int(arr.max()) >= vocab_size:
        bad = int((arr >= vocab_size).argmax())
        raise PromptError(
            f"field tokens[{bad}] = {arr[bad]} is outside the vocabulary ({vocab_size})"
        )
    return arr.tolist()


def _chat(tokenizer, messages: Sequence[dict], *, generation_prompt: bool) -> List[int]:
    out = tokenizer.apply_chat_template(
        list(messages), tokenize=True, add_generation_prompt=generation_prompt
    )
    if isinstance(out, dict) or hasattr(
        out, "keys"
    ):  # some tokenizers return an encoding
        out = out["input_ids"]
    return list(out)


def _check_length(tokenizer, text: str, max_tokens: Optional[int], what: str):
    """Refuse a text that cannot fit ``max_tokens`` without tokenizing all of it (a
    10 MB line tokenized whole peaks at GBs): only texts longer than ``max_tokens``
    of the vocabulary's longest tokens are looked at, and only that many characters
    of them are tokenized; more tokens than ``max_tokens`` there is proof enough."""
    if max_tokens is None:
        return
    bound = max_tokens * _longest_token(tokenizer)
    if len(text) <= bound:
        return
    head = encode_prompt(tokenizer, text[:bound])
    if len(head) > max_tokens:
        raise PromptError(
            f"{what} has more than {max_tokens} tokens (the limit) in its first "
            f"{bound} of {len(text)} characters"
        )


_LONGEST: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _longest_token(tokenizer) -> int:
    """Characters of the vocabulary's longest token (at least 16; 64 if unknown)."""
    try:
        return _LONGEST[tokenizer]
    except (KeyError, TypeError):
        pass
    try:
        longest = max(16, max(map(len, tokenizer.get_vocab())))
    except Exception:  # no vocabulary to look at
        longest = 64
    try:
        _LONGEST[tokenizer] = longest
    except TypeError:
        pass
    return longest


def render_messages(
    tokenizer, messages, *, max_tokens: Optional[int] = None
) -> Tuple[List[int], int, List[int]]:
    """Render a conversation; return ``(tokens, system prompt end, turn ends)``.

    The generation prompt is added when the last message is not the assistant's, as
    a server would render the request. Every message end that is a prefix of the
    whole rendering becomes a node boundary, so each turn is reusable on its own.
    """
    if not isinstance(messages, list) or not messages:
        raise PromptError("field 'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise PromptError(f"field messages[{i}] must be an object, got {_type(m)}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise PromptError(
                    f"field messages[{i}].{key} must be a string, got {_type(m.get(key))}"
                )
    if not any(m["content"].strip() for m in messages):
        raise PromptError("field 'messages' has only empty contents")
    for i, m in enumerate(messages):
        _check_length(tokenizer, m["content"], max_tokens, f"field messages[{i}]")
    if max_tokens is not None and len(messages) > 1:  # many long ones together
        joined = "\n".join(m["content"] for m in messages)
        _check_length(tokenizer, joined, max_tokens, "field 'messages'")
    if getattr(tokenizer, "chat_template", None) is None:
        raise PromptError(
            "the model's tokenizer has no chat template; use 'prompt' or 'tokens'"
        )
    try:
        tokens = _chat(
            tokenizer, messages, generation_prompt=messages[-1]["role"] != "assistant"
        )
        ends = [len(p) for p in _prefixes(tokenizer, messages, tokens)]
        system_end = _system_end(tokenizer, messages, tokens)
    except Exception as e:  # templates raise their own errors (e.g. role order)
        raise PromptError(f"chat template failed: {e}") from None
    boundaries = sorted({e for e in ends + [system_end] if 0 < e < len(tokens)})
    return tokens, system_end, boundaries


def _system_end(tokenizer, messages, tokens) -> int:
    """Where the system prompt ends, found as mlx-lm's server finds it: the common
    prefix with the system messages followed by an empty user turn."""
    n = 0
    while n < len(messages) and messages[n]["role"] == "system":
        n += 1
    if n == 0:
        return 0
    probe = _chat(
        tokenizer,
        messages[:n] + [{"role": "user", "content": ""}],
        generation_prompt=False,
    )
    end = next((i for i, (a, b) in enumerate(zip(probe, tokens)) if a != b), 0)
    return end if 0 < end < len(tokens) else 0


def _prefixes(tokenizer, messages, tokens) -> List[List[int]]:
    """Renderings of the first k messages that are prefixes of the whole (or [] if not)."""
    out = []
    for k in range(1, len(messages) + 1):
        part = _chat(tokenizer, messages[:k], generation_prompt=False)
        out.append(part if tokens[: len(part)] == part else [])
    return out


def _type(value) -> str:
    return "null" if value is None else type(value).__name__
