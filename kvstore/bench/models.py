"""Models for the benchmark: the one measured, a tiny one for the scale case, and the
prefill / first-token steps every TTFT case shares."""

from typing import Optional, Sequence

import mlx.core as mx
from mlx_lm.models import llama

# Tokens per model call when prefilling: KVStore.prefill's default step.
PREFILL_STEP = 512


def model_path(name: Optional[str]) -> str:
    """An mlx-lm path or hub id as given; None is the default model (SmolLM2-135M,
    converted locally on first use)."""
    if name is not None:
        return name
    from ..platform.default_model import ensure_default_model

    return ensure_default_model()


def load(name: Optional[str]):
    """``(model, tokenizer)`` from an mlx-lm path or hub id; None is SmolLM2-135M."""
    from mlx_lm import load as mlx_load

    return mlx_load(model_path(name))


def prefill(model, cache, tokens: Sequence[int], *, step: int = PREFILL_STEP) -> None:
    """Run ``tokens`` into ``cache`` the way ``KVStore.prefill`` does (no logits)."""
    for s in range(0, len(tokens), step):
        model(mx.array(tokens[s : s + step])[None], cache=cache)
        mx.eval([c.state for c in cache])


def first_token(model, cache, rest: Sequence[int]) -> int:
    """The greedy first generated token after ``rest`` is run into ``cache``.

    Like mlx-lm's generate loop: all but the last token prefilled in steps, then the
    last one run for the logits the first token is sampled from.
    """
    prefill(model, cache, rest[:-1])
    logits = model(mx.array(rest[-1:])[None], cache=cache)
    token = mx.argmax(logits[0, -1])
    mx.eval(token)
    return int(token.item())


def vocab_size(model) -> int:
    return int(getattr(getattr(model, "args", None), "vocab_size", 0) or 32000)


def tiny_model(
    *,
    layers: int = 1,
    heads: int = 1,
    head_dim: int = 8,
    vocab: int = 64,
    dtype: mx.Dtype = mx.float16,
):
    """A random-weight llama whose KV cache has the given layout, cheap to run.

    The defaults make a minimal cache, to fill an index fast.
    """
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=heads * head_dim,
        num_hidden_layers=layers,
        intermediate_size=64,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
    )
    mx.random.seed(0)
    model = llama.Model(args)
    if dtype != mx.float32:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def word_tokenizer(vocab: int):
    """A word-level tokenizer built offline for tiny random models: word ``w<i>`` is
    token ``i`` (3 <= i < ``vocab``); roles are words w5 (system), w6 (user), w7
    (assistant) in its chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": 2}
    words.update({f"w{i}": i for i in range(3, vocab)})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    out.chat_template = (
        "{% for m in messages %}<s> {{ {'system': 'w5', 'user': 'w6', 'assistant': 'w7'}"
        "[m['role']] }} {{ m['content'] }} </s> {% endfor %}"
        "{% if add_generation_prompt %}<s> w7 {% endif %}"
    )
    return out
