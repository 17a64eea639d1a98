"""The documentation says what is true, where a test can tell.

The README's command-line table against the real argparse parsers (both ways), every
relative link in README.md and docs/*.md, every ``kvstore ...`` command in their code
blocks parsed by the real parsers, every test/tool/module file they name, and no issue
numbers or history wording in the docs, comments or help text. Fast: no model.
"""

import argparse
import importlib
import re
import shlex
import tokenize
from pathlib import Path

import pytest

from kvstore import cli

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MARKDOWN = [README] + DOCS
TEST_COMMAND = 'pip install -e ".[cpu,test]" && python -m pytest -q'

# Subcommands whose options live in their own module's parser (cli.main hands the rest
# of the command line over to it).
DELEGATED = {"serve": "kvstore.server", "bench": "kvstore.bench"}

HISTORY = [
    r"\bissues?\s*#?\d+",
    r"\bthis (round|session|time)\b",
    r"\b(was|were|got|been) fixed\b",
    r"\b(earlier|previous|last|this) rounds?\b",
    r"\bmain before\b",
    r"\bbefore this (work|round|change|session|issue|fix)\b",
    r"\bused to (be|cost|take|serialize|reuse|replace|copy|hash|run|read|write)\b",
    r"\b(a|the) first version\b",
    r"\b(the )?(old|previous) code\b",
]
HISTORY_RE = re.compile("|".join(f"(?:{p})" for p in HISTORY), re.IGNORECASE)


# -- parsers ------------------------------------------------------------------------


def _subcommands(parser: argparse.ArgumentParser) -> dict:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("kvstore's parser has no subcommands")


def _options(parser: argparse.ArgumentParser) -> set:
    return {
        s
        for a in parser._actions
        if not isinstance(a, argparse._HelpAction)
        for s in a.option_strings
        if s.startswith("--")
    }


def _parsers() -> dict:
    """Every subcommand's parser, the delegated ones from their own modules."""
    parsers = _subcommands(cli.build_parser())
    for name, module in DELEGATED.items():
        assert name in parsers, f"`kvstore {name}` is no longer a subcommand"
        parsers[name] = importlib.import_module(module).build_parser()
    return parsers


class _Grabbed(Exception):
    pass


@pytest.fixture(scope="module")
def mlx_server_parser():
    """mlx_lm.server's own parser (it builds it inside main()): the one `kvstore serve`
    passes every option it does not know to."""
    import mlx_lm.server as mls

    original = argparse.ArgumentParser.parse_args

    def grab(self, *args, **kwargs):
        raise _Grabbed(self)

    argparse.ArgumentParser.parse_args = grab
    try:
        mls.main()
    except _Grabbed as e:
        return e.args[0]
    finally:
        argparse.ArgumentParser.parse_args = original
    raise AssertionError("mlx_lm.server.main() never parsed its arguments")


# -- markdown -------------------------------------------------------------------------


def _section(text: str, heading: str) -> str:
    m = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"README.md has no '## {heading}' section"
    return m.group(1)


def _cli_table() -> list:
    """The README's command-line table: (subcommands, options cell, whole row)."""
    rows = []
    for line in _section(README.read_text(), "Command line").splitlines():
        if not line.startswith("|") or set(line) <= set("|- "):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        names = re.findall(r"`kvstore ([a-z]+)", cells[0])
        if names:
            rows.append((names, cells[1], line))
    assert rows, "README.md's command-line table has no rows"
    return rows


def _mentioned_options(text: str) -> set:
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))


def _strip_code(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def _code_lines(text: str):
    # Shell blocks only: untagged blocks hold output.
    for block in re.findall(
        r"^```(?:bash|sh|shell|console)\n(.*?)^```", text, re.M | re.S
    ):
        yield from block.replace("\\\n", " ").splitlines()


def _kvstore_commands(text: str) -> list:
    """Every ``kvstore ...`` command in the code blocks (env assignments, pipes, ``&&``
    and comments stripped), as argv lists without the ``kvstore``."""
    commands = []
    for line in _code_lines(text):
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # Python, not shell
            continue
        segment = []
        for word in words + [";"]:
            if word in (";", "&&", "||", "|"):
                while segment and re.match(r"^[A-Z_][A-Z0-9_]*=", segment[0]):
                    segment.pop(0)
                if segment and segment[0] == "kvstore":
                    commands.append(segment[1:])
                segment = []
            else:
                segment.append(word)
    return commands


def _slug(heading: str) -> str:
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def _anchors(path: Path) -> set:
    seen, anchors = {}, set()
    for heading in re.findall(r"^#{1,6} (.+)$", _strip_code(path.read_text()), re.M):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


# -- the tests ------------------------------------------------------------------------


def test_every_option_of_every_subcommand_is_in_the_readme_table():
    listed = {}
    for names, options, _ in _cli_table():
        for name in names:
            listed.setdefault(name, set()).update(_mentioned_options(options))
    missing = []
    for name, parser in _parsers().items():
        if name not in listed:
            missing.append(f"`kvstore {name}` has no row")
            continue
        for option in sorted(_options(parser) - listed[name]):
            missing.append(f"`kvstore {name} {option}` is not listed")
    assert not missing, "README.md's command-line table: " + "; ".join(missing)


def test_every_option_in_the_readme_table_exists(mlx_server_parser):
    parsers = _parsers()
    wrong = []
    for names, _, row in _cli_table():
        for name in names:
            if name not in parsers:
                wrong.append(f"`kvstore {name}` is not a subcommand")
                continue
            known = _options(parsers[name])
            if name == "serve":
                known |= _options(mlx_server_parser)
            wrong += [
                f"`kvstore {name} {o}` does not exist"
                for o in sorted(_mentioned_options(row) - known)
            ]
    assert not wrong, "README.md's command-line table: " + "; ".join(wrong)


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: p.name)
def test_relative_links_point_at_files_and_headings(path):
    text = _strip_code(path.read_text())
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{path.relative_to(ROOT)}: broken links: {broken}"


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: p.name)
def test_files_the_docs_name_exist(path):
    named = re.findall(
        r"`((?:tests|tools|kvstore|examples)/[\w./-]+\.\w+)", path.read_text()
    )
    missing = sorted({n for n in named if not (ROOT / n).exists()})
    assert not missing, f"{path.relative_to(ROOT)} names missing files: {missing}"


def test_readme_has_kvstore_commands():
    commands = _kvstore_commands(README.read_text())
    assert {c[0] for c in commands} >= {"prefill", "serve"}, commands


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: p.name)
def test_kvstore_commands_in_the_docs_parse(path, mlx_server_parser):
    parsers = _parsers()
    for argv in _kvstore_commands(path.read_text()):
        line = "kvstore " + shlex.join(argv)
        try:
            if argv and argv[0] == "serve":
                _, rest = parsers["serve"].parse_known_args(argv[1:])
                mlx_server_parser.parse_args(rest)
            elif argv and argv[0] in DELEGATED:
                parsers[argv[0]].parse_args(argv[1:])
            else:
                cli.build_parser().parse_args(argv)
        except SystemExit as e:
            pytest.fail(f"{path.relative_to(ROOT)}: `{line}` does not parse ({e})")


def test_every_test_file_is_in_the_design_docs_test_table():
    design = (ROOT / "docs" / "design.md").read_text()
    missing = [
        p.name
        for p in sorted((ROOT / "tests").glob("test_*.py"))
        if p.name not in design
    ]
    assert not missing, f"docs/design.md's test table does not name {missing}"


def test_readme_test_command_is_what_ci_runs():
    assert TEST_COMMAND in README.read_text()
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text()


def test_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines <= 250, f"README.md has {lines} lines; put the detail under docs/"


def test_history_pattern_catches_history():
    for text in ["see issue 12", "what was fixed this round", "main before 0.27x"]:
        assert HISTORY_RE.search(text), text
    assert not HISTORY_RE.search("a restore is used to compare; the first chunk")


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: p.name)
def test_no_history_wording_in_the_docs(path):
    hits = [
        f"{path.name}:{n}: {line.strip()}"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if HISTORY_RE.search(line)
    ]
    assert not hits, "issue numbers or history wording:\n" + "\n".join(hits)


def _comments_and_strings(path: Path):
    with open(path, "rb") as f:
        for tok in tokenize.tokenize(f.readline):
            if tok.type in (tokenize.COMMENT, tokenize.STRING):
                yield tok.start[0], tok.string


def test_no_history_wording_in_comments_and_help():
    files = sorted((ROOT / "kvstore").rglob("*.py")) + sorted(
        (ROOT / "tools").glob("*.py")
    )
    hits = []
    for path in files:
        for line_no, text in _comments_and_strings(path):
            for line in text.splitlines():
                if HISTORY_RE.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{line_no}: {line.strip()}")
    assert not hits, "issue numbers or history wording:\n" + "\n".join(hits)


def _tables(text: str):
    """The markdown tables of ``text``, each as one string of its ``|`` lines."""
    tables, rows = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            tables.append("\n".join(rows))
            rows = []
    return tables


@pytest.mark.parametrize("run", ["bench-restart.json", "bench-calls.json"])
def test_benchmark_tables_are_generated_from_their_runs(run, capsys):
    """docs/benchmarks.md holds ``kvstore bench --from-json RUN --markdown``'s tables
    verbatim: numbers regenerated from the saved samples, never typed by hand."""
    from kvstore.bench import main as bench_main

    assert bench_main(["--from-json", str(ROOT / "docs" / run), "--markdown"]) == 0
    tables = _tables(capsys.readouterr().out)
    assert tables, f"{run}: no markdown table printed"
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    for table in tables:
        assert table in page, f"docs/benchmarks.md lacks this table of {run}:\n{table}"
