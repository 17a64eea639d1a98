"""``stream_generate`` with persistence: a one-line change for mlx-lm generate loops."""

import math
from typing import Generator, List, Union

import mlx.core as mx
from mlx_lm import stream_generate as _mlx_stream_generate
from mlx_lm.generate import GenerationResponse
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .disk.salts import Salt


def encode_prompt(tokenizer, prompt: Union[str, mx.array, List[int]]) -> List[int]:
    """Token ids for ``prompt``, encoded exactly as ``mlx_lm.stream_generate`` does."""
    if isinstance(prompt, str):
        if not isinstance(tokenizer, TokenizerWrapper):
            tokenizer = TokenizerWrapper(tokenizer)
        add_special_tokens = tokenizer.bos_token is None or not prompt.startswith(
            tokenizer.bos_token
        )
        return tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    if isinstance(prompt, mx.array):
        return prompt.tolist()
    return list(prompt)


def stream_generate(
    model,
    tokenizer,
    prompt: Union[str, mx.array, List[int]],
    *,
    store,
    kind: str = "user",
    pin: bool = False,
    salt: Salt = None,
    **kwargs,
) -> Generator[GenerationResponse, None, None]:
    """``mlx_lm.stream_generate`` that reuses and persists the prompt's KV.

    The longest stored prefix of the prompt is restored from ``store`` and only
    the rest is computed; once the first token is out, the prompt's KV is saved
    (in the background). With state layers the prompt is computed up to its last
    token but one and saved there first (a checkpoint), then generation goes on. Yields exactly what ``mlx_lm.stream_generate`` yields;
    ``prompt_tokens`` counts the tokens computed, not those restored.

    Args:
        store: An open :class:`kvstore.KVStore` for this model.
        kind: Eviction class of the saved prompt ("system", "user", "assistant").
        pin: Pin the saved prompt.
        salt: Reuse and save only in this salt's tree (see ``KVStore.fetch``).
        kwargs: Passed to ``mlx_lm.stream_generate`` (not ``prompt_cache``).
    """
    if "prompt_cache" in kwargs:
        raise ValueError(
            "kvstore.stream_generate manages prompt_cache itself; do not pass one"
        )
    if kwargs.get("draft_model") is not None:
        raise ValueError("kvstore.stream_generate does not support draft_model yet")
    tokens = encode_prompt(tokenizer, prompt)
    cache, n = store.fetch(tokens, salt=salt)
    saved = False
    if store.layout.has_state:
        # State layers (windows, recurrent state) cannot be cut back after generation:
        # checkpoint them at the prompt's last token but one, which this prompt and
        # every continuation of it can restore.
        end = len(tokens) - 1
        if end > n:
            step = kwargs.get("prefill_step_size", 2048)
            store.extend(cache, tokens, n, end, step_tokens=step)
            store.save(tokens[:end], cache, kind=kind, pin=pin, salt=salt)
            n = end
        saved = True
    measured = False
    for response in _mlx_stream_generate(
        model, tokenizer, mx.array(tokens[n:]), prompt_cache=cache, **kwargs
    ):
        if not measured:
            # mlx-lm's own prefill timing: what the store weighs restores against.
            measured = True
            tps = response.prompt_tps
            if tps > 0 and math.isfinite(tps) and response.prompt_tokens / tps > 0:
                seconds = response.prompt_tokens / tps
                store.note_prefill(response.prompt_tokens, seconds)
        if not saved:
            # The cache now holds the whole prompt (and maybe the first new token).
            store.save_prefix(tokens, cache, kind=kind, pin=pin, salt=salt)
            saved = True
        yield response
