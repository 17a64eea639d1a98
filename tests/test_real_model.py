"""Integration: the real SmolLM2-135M-Instruct (float32 KV here), short prompts.

MLX prefills ~8 tokens/s on these CPUs, so prompts stay at a few dozen tokens.
"""

import mlx.core as mx
import pytest
from conftest import compute_cache, greedy, next_logits

import kvstore
from kvstore import KVStore

pytestmark = pytest.mark.model

SYSTEM = "You are a terse assistant. Answer in one short sentence."


def chat_tokens(tokenizer, user: str):
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": user},
    ]
    full = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    system = tokenizer.apply_chat_template(messages[:1])
    assert full[: len(system)] == system
    return list(full), len(system)


def test_system_prompt_restored_equals_cold(tmp_path, smollm2):
    model, tokenizer = smollm2
    tokens, system_end = chat_tokens(tokenizer, "What is the capital of France?")
    with KVStore(tmp_path / "s", model, tokenizer, chunk_tokens=16) as store:
        leaf = store.layout.leaves[0]
        assert leaf.cls == "KVCache" and leaf.tensors[0][2][0] == 3  # 3 KV heads
        # Prefill the system prompt only, as `kvstore prefill` would.
        done = store.prefill(tokens[:system_end], kind="system")
        assert done["computed"] == system_end
        store.flush()
        cache, n = store.fetch(tokens)
        assert n == system_end
        warm = next_logits(model, cache, tokens[n:])
        cold = next_logits(model, compute_cache(model, []), tokens)
        assert mx.allclose(warm, cold, atol=1e-3, rtol=1e-3).item()
        assert greedy(model, store.fetch(tokens)[0], tokens[n:], 8) == greedy(
            model, compute_cache(model, []), tokens, 8
        )


def test_stream_generate_reuses_across_stores(tmp_path, smollm2):
    model, tokenizer = smollm2
    tokens, _ = chat_tokens(tokenizer, "Name a primary colour.")
    from mlx_lm import stream_generate

    want = "".join(
        r.text for r in stream_generate(model, tokenizer, tokens, max_tokens=8)
    )
    path = tmp_path / "s"
    with KVStore(path, model, tokenizer) as store:
        first = "".join(
            r.text
            for r in kvstore.stream_generate(
                model, tokenizer, tokens, store=store, max_tokens=8
            )
        )
    with KVStore(path, model, tokenizer) as store:  # a "restart"
        second = "".join(
            r.text
            for r in kvstore.stream_generate(
                model, tokenizer, tokens, store=store, max_tokens=8
            )
        )
        assert store.stats()["tokens_reused"] == len(tokens) - 1
    assert first == want and second == want
