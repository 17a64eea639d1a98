"""The supported mlx-lm range and ``kvstore serve``'s start-up check of the mlx-lm
internals it relies on (each found missing by taking it away here)."""

import os
import re
import subprocess
import sys

import mlx_lm.server as mls
import pytest
from mlx_lm.models.cache import LRUPromptCache

from kvstore import server
from kvstore.platform import compat
from kvstore.platform.compat import SUPPORTED_RANGE
from kvstore.server import PersistentPromptCache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def server_problems(**kw):
    return compat.server_problems(cache_class=PersistentPromptCache, **kw)


def test_installed_mlx_lm_has_everything():
    assert server_problems() == []
    assert SUPPORTED_RANGE.contains(compat.mlx_lm_version())


def test_pyproject_declares_the_range():
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        deps = re.findall(r'"mlx-lm([^"]*)"', f.read())
    assert deps == [str(SUPPORTED_RANGE)]
    lower, upper = compat._numeric(SUPPORTED_RANGE.lower), SUPPORTED_RANGE.upper
    assert [compat._numeric(v) for v in SUPPORTED_RANGE.tested] == sorted(
        compat._numeric(v) for v in SUPPORTED_RANGE.tested
    )
    assert compat._numeric(SUPPORTED_RANGE.tested[0]) == lower
    assert all(SUPPORTED_RANGE.contains(v) for v in SUPPORTED_RANGE.tested)
    assert not SUPPORTED_RANGE.contains(upper)


@pytest.mark.parametrize(
    "version, inside",
    [
        ("0.31.3", False),
        ("0.32.0", True),
        ("0.32.9", True),
        ("0.33.0", False),
        ("1.0", False),
        ("0.32.0.dev1", False),
        ("garbage", False),
    ],
)
def test_range_contains(version, inside):
    assert SUPPORTED_RANGE.contains(version) is inside


@pytest.fixture
def no_model_load(monkeypatch):
    """Any model load fails the test: the check must come first."""

    def refuse(*a, **kw):
        raise AssertionError("a model was loaded before the start-up check")

    monkeypatch.setattr(mls, "load", refuse)
    monkeypatch.setattr("mlx_lm.utils.load", refuse)


@pytest.mark.parametrize(
    "name", ["LRUPromptCache", "ModelProvider", "_run_http_server", "APIHandler"]
)
def test_serve_refuses_when_a_name_is_gone(
    name, monkeypatch, capsys, no_model_load, tiny_model_dir, tmp_path
):
    monkeypatch.delattr(mls, name)
    status = server.main(
        ["--model", tiny_model_dir, "--store", str(tmp_path / "s"), "--port", "0"],
        hard_exit=False,
    )
    err = capsys.readouterr().err
    assert status == 2
    assert f"mlx_lm.server.{name} is missing" in err
    assert f"mlx-lm {compat.mlx_lm_version()}" in err
    assert str(SUPPORTED_RANGE) in err
    assert not (tmp_path / "s").exists()  # nothing was set up either
    assert hasattr(mls, "main")  # nothing of mlx_lm.server was replaced for good


def test_serve_cli_exit_status_when_a_name_is_gone(monkeypatch, capsys, no_model_load):
    from kvstore import cli

    monkeypatch.delattr(mls, "_run_http_server")
    assert cli.main(["serve", "--model", "x", "--port", "0"]) == 2
    assert "_run_http_server" in capsys.readouterr().err


def test_changed_signature_of_run_http_server(monkeypatch):
    def _run_http_server(host, port, response_generator):  # no handler_class
        pass

    monkeypatch.setattr(mls, "_run_http_server", _run_http_server)
    (problem,) = server_problems()
    assert "_run_http_server" in problem and "handler_class" in problem


def test_run_http_server_without_server_class(monkeypatch):
    def _run_http_server(host, port, response_generator, handler_class=None):
        pass

    monkeypatch.setattr(mls, "_run_http_server", _run_http_server)
    (problem,) = server_problems()
    assert "_run_http_server" in problem and "server_class" in problem


def test_run_no_longer_looks_up_the_replaced_names(monkeypatch):
    def run(host, port, model_provider):
        return mls.ResponseGenerator  # builds its cache some other way

    monkeypatch.setattr(mls, "run", run)
    (problem,) = server_problems()
    assert "mlx_lm.server.run no longer uses LRUPromptCache, _run_http_server" in (
        problem
    )


def test_model_provider_attributes(monkeypatch):
    class ModelProvider:
        def __init__(self, cli_args):
            self.cli_args = cli_args
            self.current = None  # renamed from model_key, model, ...

        def _load(self, path):
            pass

    monkeypatch.setattr(mls, "ModelProvider", ModelProvider)
    (problem,) = server_problems()
    assert "ModelProvider no longer sets model_key, model, tokenizer, draft_model" in (
        problem
    )


def test_handler_method_renamed(monkeypatch):
    monkeypatch.delattr(mls.APIHandler, "handle_text_completions")
    (problem,) = server_problems()
    assert "APIHandler lacks handle_text_completions" in problem


def test_prompt_cache_interface_grows():
    class Newer(LRUPromptCache):
        def fetch_batch(self, model, prompts):
            pass

    (problem,) = server_problems(lru=Newer)
    assert "LRUPromptCache has fetch_batch" in problem


def test_prompt_cache_signature_changes():
    class Newer(LRUPromptCache):
        def insert_cache(self, model, tokens, prompt_cache, *, cache_type="a", ttl=0):
            pass

        def trim_to(self, n_sequences=None, n_bytes=None):  # no longer keyword-only
            pass

    problems = server_problems(lru=Newer)
    assert len(problems) == 2
    assert "LRUPromptCache.insert_cache(" in problems[0] and "ttl" in problems[0]
    assert "LRUPromptCache.trim_to(" in problems[1]


def test_prompt_cache_constructor_changes():
    class Newer(LRUPromptCache):
        def __init__(self, max_size=10, max_bytes=1 << 63, *, policy="lru"):
            super().__init__(max_size, max_bytes)

    (problem,) = server_problems(lru=Newer)
    assert "takes other arguments than (max_size, max_bytes)" in problem


def test_outside_the_range_but_complete_warns(monkeypatch, capsys):
    monkeypatch.setattr(compat, "mlx_lm_version", lambda: "0.40.0")
    assert compat.check_server(cache_class=PersistentPromptCache) is True
    assert "outside the tested range" in capsys.readouterr().err


def test_library_does_not_import_the_server(tmp_path):
    """KVStore and stream_generate work without mlx_lm.server ever being imported."""
    code = f"""
import sys
sys.path.insert(0, {os.path.join(ROOT, 'tests')!r})
import kvstore
from conftest import tiny_llama, tiny_tokenizer, random_tokens
assert "mlx_lm.server" not in sys.modules, "import kvstore"
model, tok = tiny_llama(0), tiny_tokenizer()
with kvstore.KVStore({str(tmp_path / 's')!r}, model, tok, chunk_tokens=16) as s:
    for _ in range(2):
        out = list(kvstore.stream_generate(
            model, tok, random_tokens(40, 1), store=s, max_tokens=3))
        s.flush()
    assert s.stats()["tokens_reused"] > 0
bad = sorted(m for m in sys.modules if m == "mlx_lm.server" or m == "kvstore.server")
assert not bad, bad
print("ok")
"""
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().endswith("ok")


@pytest.mark.parametrize(
    "cls, method", [("ResponseGenerator", "_tokenize"), ("BatchGenerator", "next")]
)
def test_serve_refuses_when_a_salt_hook_is_gone(
    cls, method, monkeypatch, capsys, no_model_load, tiny_model_dir, tmp_path
):
    """What carries a request's cache salt to the prompt cache is checked too."""
    monkeypatch.delattr(getattr(mls, cls), method)
    status = server.main(
        ["--model", tiny_model_dir, "--store", str(tmp_path / "s"), "--port", "0"],
        hard_exit=False,
    )
    assert status == 2
    assert f"mlx_lm.server.{cls}.{method} is missing" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_our_extra_keyword_parameters():
    """A keyword-only parameter with a default (the salt) is one mlx-lm never passes;
    one without a default would break its calls."""

    class Optional(PersistentPromptCache):
        def trim_to(self, *, n_sequences=None, n_bytes=None, salt=None):
            pass

    class Required(PersistentPromptCache):
        def trim_to(self, *, n_sequences=None, n_bytes=None, salt):
            pass

    assert compat.server_problems(cache_class=Optional) == []
    (problem,) = compat.server_problems(cache_class=Required)
    assert "LRUPromptCache.trim_to(" in problem and "salt" in problem
