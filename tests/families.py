"""Tiny random-weight models of every cache family kvstore supports (for tests).

Each builder returns an mlx-lm model whose cache is: plain ``KVCache`` (llama),
sliding window + global (Gemma 3: ``RotatingKVCache`` and ``KVCache``), recurrent +
attention (Qwen3-Next: ``ArraysCache`` and ``KVCache``), recurrent only (Mamba 2),
chunked attention (Llama 4: ``ChunkedKVCache`` and ``KVCache``), nested
(Falcon-H1: ``CacheList(ArraysCache, KVCache)``) and token-shaped state (LongCat
Flash n-gram: an ``ArraysCache`` of the last token ids, then ``CacheList``s of
``KVCache``). Quantized KV is llama with
``KVStore(kv_bits=...)``.
"""

import importlib

import mlx.core as mx

VOCAB = 512
WINDOW = 16  # Gemma 3's sliding window: prompts in the tests are longer
ATTENTION_CHUNK = 16  # Llama 4's attention chunk

CONFIGS = {
    "gemma3_text": dict(
        hidden_size=64,
        num_hidden_layers=4,
        intermediate_size=128,
        num_attention_heads=4,
        head_dim=16,
        num_key_value_heads=2,
        sliding_window=WINDOW,
        sliding_window_pattern=2,
    ),
    "qwen3_next": dict(
        hidden_size=64,
        num_hidden_layers=4,
        intermediate_size=128,
        num_attention_heads=4,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=64,
        mlp_only_layers=[],
        moe_intermediate_size=32,
        rms_norm_eps=1e-6,
        num_key_value_heads=2,
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        max_position_embeddings=4096,
        head_dim=16,
        full_attention_interval=2,
    ),
    "mamba2": dict(
        num_heads=4,
        head_dim=16,
        hidden_size=32,
        intermediate_size=64,
        state_size=16,
        num_hidden_layers=2,
        layer_norm_epsilon=1e-5,
        conv_kernel=4,
        n_groups=1,
        use_bias=False,
        use_conv_bias=True,
        tie_word_embeddings=True,
        time_step_limit=(0.0, float("inf")),
        time_step_rank="auto",
    ),
    "llama4": dict(
        text_config=dict(
            attention_bias=False,
            attention_chunk_size=ATTENTION_CHUNK,
            head_dim=16,
            hidden_size=64,
            interleave_moe_layer_step=2,
            intermediate_size=64,
            intermediate_size_mlp=128,
            max_position_embeddings=4096,
            model_type="llama4_text",
            num_attention_heads=4,
            num_experts_per_tok=1,
            num_hidden_layers=4,
            num_key_value_heads=2,
            num_local_experts=2,
            rms_norm_eps=1e-5,
            rope_scaling=None,
            rope_theta=10000.0,
            use_qk_norm=True,
            vocab_size=VOCAB,
        )
    ),
    "falcon_h1": dict(
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        mamba_d_ssm=64,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=16,
        mamba_chunk_size=16,
    ),
    # From mlx-lm 0.32.2's tests/test_models.py: its n-gram embedding keeps the last
    # n - 1 token ids in an ArraysCache entry whose length grows with the tokens seen.
    "longcat_flash_ngram": dict(
        attention_method="MLA",
        zero_expert_type="identity",
        hidden_size=128,
        ffn_hidden_size=128,
        moe_topk=2,
        expert_ffn_hidden_size=128,
        n_routed_experts=2,
        zero_expert_num=2,
        num_layers=2,
        num_hidden_layers=2,
        max_position_embeddings=1000,
        num_attention_heads=4,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        routed_scaling_factor=1.0,
        rms_norm_eps=1e-5,
        rope_theta=1000,
        mla_scale_q_lora=True,
        mla_scale_kv_lora=True,
        attention_bias=False,
    ),
}


def build(model_type: str, seed: int = 0):
    """A tiny random model of ``model_type`` (a key of :data:`CONFIGS`), evaluated."""
    mod = importlib.import_module(f"mlx_lm.models.{model_type}")
    config = dict(CONFIGS[model_type], model_type=model_type)
    if "text_config" not in config:
        config["vocab_size"] = VOCAB
    mx.random.seed(seed)
    model = mod.Model(mod.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model
