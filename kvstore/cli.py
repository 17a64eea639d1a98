"""The ``kvstore`` command line: prefill prompts offline and manage a store."""

import argparse
import json
import os
import sys
import time
from typing import List, Optional

from .options import (
    add_disk_budget_option,
    add_remote_options,
    add_size_options,
    default_store,
    int_at_least,
    parse_size,
    remote_options,
    store_disk_budget,
)

EXIT_OK, EXIT_FAILED_LINES, EXIT_ERROR = 0, 1, 2
EXIT_BROKEN_PIPE = 128 + 13  # as a command killed by SIGPIPE


class CLIError(Exception):
    """A problem that ends the command with one clear message."""


def _salt(text: str) -> str:
    """An argparse type: a cache salt (non-empty, at most 256 bytes)."""
    from .disk.salts import check_salt

    try:
        check_salt(text, what="the salt")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


_positive = int_at_least(1)
_chunk = int_at_least(1, 1 << 20)  # tokens per node: past any context length
_bits = int_at_least(1, 32)


# -- model and store ---------------------------------------------------------


def load_model(name: Optional[str]):
    """Load an mlx-lm model; None means the bundled default (converted on first use)."""
    from mlx_lm import load

    local = name is not None and name.startswith(("/", "./", "../", "~"))
    if local and not os.path.isdir(os.path.expanduser(name)):
        raise CLIError(f"cannot load model {name!r}: no such directory")
    if name is None:
        from .platform.default_model import ensure_default_model

        try:
            name = ensure_default_model()
        except Exception as e:
            raise CLIError(f"cannot prepare the default model: {e}") from None
    try:
        return load(name)
    except Exception as e:
        raise CLIError(f"cannot load model {name!r}: {type(e).__name__}: {e}") from None


def open_store(path: str, model, tokenizer, args, *, remote=None):
    """The store for ``args``' --chunk-tokens, --kv-bits / --kv-group-size and (where
    the command has them) --disk-bytes / --ram-bytes / --restore-room."""
    from .disk.adapters import UnsupportedCacheError
    from .disk.index import StoreError
    from .store import KVStore

    sizes = {}
    if getattr(args, "ram_bytes", None) is not None:
        sizes["ram_bytes"] = args.ram_bytes
    if getattr(args, "restore_room", None) is not None:
        sizes["restore_room"] = args.restore_room
    if getattr(args, "salt_disk_bytes", None) is not None:
        sizes["salt_disk_bytes"] = args.salt_disk_bytes
    if getattr(args, "restore", None) is not None:
        sizes["restore"] = args.restore
    if hasattr(args, "disk_bytes"):
        sizes["disk_bytes"] = store_disk_budget(path, args.disk_bytes)
    try:
        return KVStore(
            path,
            model,
            tokenizer,
            chunk_tokens=args.chunk_tokens,
            kv_bits=args.kv_bits,
            kv_group_size=args.kv_group_size,
            remote=remote,
            **sizes,
        )
    except (StoreError, UnsupportedCacheError) as e:
        raise CLIError(str(e)) from None
    except ValueError as e:  # e.g. a group size the model's head dimension rejects
        raise CLIError(f"cannot use --kv-bits/--kv-group-size here: {e}") from None


def check_store(path: str) -> None:
    """What opening the store will check, before a model is loaded for it (an
    existing store only: a new one is created with the model's namespace)."""
    if os.path.lexists(path):
        from .store import check_store as check

        check(path)


def remote_tier(args, **options):
    """The RemoteTier of ``--remote URL`` and its ``--remote-*`` waits (None without
    one); a CLIError naming the option for a bad URL or a missing boto3. No request
    is made here."""
    if args.remote is None:
        return None
    from .remote import RemoteTier

    try:
        return RemoteTier(args.remote, **remote_options(args), **options)
    except (TypeError, ValueError, ImportError) as e:
        raise CLIError(f"--remote: {e}") from None


def _context_length(model) -> Optional[int]:
    args = getattr(model, "args", None)
    for key in ("max_position_embeddings", "context_length", "max_seq_len"):
        value = getattr(args, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


# -- prefill -----------------------------------------------------------------


def cmd_prefill(args) -> int:
    from tqdm import tqdm

    from .prompts import PromptError, parse_line

    lines = _read_prompts(args.prompts)
    name = "<stdin>" if args.prompts == "-" else args.prompts
    remote = remote_tier(args)  # a bad URL fails before the model loads
    check_store(args.store)  # so does a store that is not one, or read-only
    model, tokenizer = load_model(args.model)
    limit = _context_length(model)
    if args.max_tokens_per_prompt:
        limit = min(limit or args.max_tokens_per_prompt, args.max_tokens_per_prompt)
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)

    summary = {"prompts": len(lines), "prefilled": 0, "skipped": 0, "failed": 0}
    summary.update({"tokens_computed": 0, "tokens_reused": 0})
    tic = time.perf_counter()
    store = open_store(args.store, model, tokenizer, args, remote=remote)
    with (
        store,
        tqdm(total=len(lines), unit="prompt", disable=args.quiet or None) as bar,
    ):
        for lineno, text in lines:
            where = f"{name}:{lineno}"
            try:
                line = parse_line(
                    lineno,
                    text,
                    tokenizer,
                    default_kind=args.kind,
                    default_pin=args.pin,
                    default_salt=args.salt,
                    default_tenant=args.tenant,
                    vocab_size=vocab,
                    max_tokens=limit,
                )
                if limit is not None and len(line.tokens) > limit:
                    raise PromptError(
                        f"prompt has {len(line.tokens)} tokens, more than the limit of {limit}"
                    )
            except PromptError as e:
                summary["failed"] += 1
                bar.write(f"{where}: {e}", file=sys.stderr)
                if args.strict:
                    break
                bar.update(1)
                continue
            failed_writes = store.stats()["writes_failed"]
            computed = _prefill_line(store, line)
            if store.stats()["writes_failed"] > failed_writes:
                summary["failed"] += 1  # computed, but not stored: say so
                bar.write(
                    f"{where}: not stored: writing to the store failed (see the log)",
                    file=sys.stderr,
                )
                bar.update(1)
                if args.strict:
                    break
                continue
            summary["tokens_computed"] += computed
            summary["tokens_reused"] += len(line.tokens) - computed
            summary["prefilled" if computed else "skipped"] += 1
            bar.set_postfix(
                computed=summary["tokens_computed"], reused=summary["tokens_reused"]
            )
            bar.update(1)
        if remote is not None:
            store.flush()
            remote.wait_uploads(remote.close_timeout)
        stats = store.stats()
    summary["bytes_written"] = stats["bytes_written"]
    if remote is not None:
        for key in _REMOTE_SUMMARY:
            summary[key] = stats[key]
    summary["writes_dropped"] = stats["writes_dropped"]
    summary["writes_failed"] = stats["writes_failed"]
    if stats["store_problem"]:
        print(f"kvstore prefill: {stats['store_problem']}", file=sys.stderr)
    summary["seconds"] = round(time.perf_counter() - tic, 3)
    summary["store"] = store.path
    _print_summary(summary, args.json)
    return EXIT_FAILED_LINES if summary["failed"] else EXIT_OK


def _read_prompts(path: str) -> list:
    """``(line number, text)`` of a prompts file; a CLIError naming the file if it
    cannot be read."""
    from .prompts import read_lines

    if path != "-" and os.path.isdir(path):
        raise CLIError(f"{path}: is a directory, not a prompts file")
    if path != "-" and not os.path.exists(path):
        raise CLIError(f"{path}: no such file")
    try:
        return list(read_lines(path))
    except OSError as e:
        raise CLIError(f"{path}: cannot read: {e}") from None


def _prefill_line(store, line) -> int:
    """Prefill one prompt; the system prompt is its own node, of kind "system".

    Each step is flushed before the next, so a crash loses at most this prompt and
    the next step reuses what the previous one wrote.
    """
    computed = 0
    if 0 < line.system_end < len(line.tokens):
        done = store.prefill(
            line.tokens[: line.system_end], kind="system", pin=line.pin, salt=line.salt
        )
        computed += done["computed"]
        store.flush()
    done = store.prefill(
        line.tokens,
        kind=line.kind,
        pin=line.pin,
        boundaries=line.boundaries,
        salt=line.salt,
    )
    store.flush()
    return computed + done["computed"]


def _print_summary(summary: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary, sort_keys=True))
        return
    s = summary
    print(
        f"{s['prompts']} prompts: {s['prefilled']} prefilled, {s['skipped']} already stored, "
        f"{s['failed']} failed\n"
        f"tokens: {s['tokens_computed']} computed, {s['tokens_reused']} reused from the store\n"
        f"{_human(s['bytes_written'])} written to {s['store']} in {s['seconds']:.1f} s"
    )
    if "remote" in s:
        print(
            f"remote {s['remote']}: {s['remote_nodes_down']} nodes downloaded, "
            f"{s['uploads']} uploaded, {s['remote_errors']} errors, "
            f"{s['remote_corrupt']} invalid objects"
        )


_REMOTE_SUMMARY = (
    "remote",
    "remote_hits",
    "remote_nodes_down",
    "bytes_down",
    "uploads",
    "bytes_up",
    "upload_errors",
    "remote_errors",
    "remote_corrupt",
    "remote_last_error",
)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# -- management ----------------------------------------------------------------


def _maintenance():
    from . import maintenance

    return maintenance


def _guard_store(path: str) -> None:
    if os.path.islink(path) and not os.path.exists(path):
        raise CLIError(f"{path} is a dangling symbolic link (to {os.readlink(path)!r})")
    if not os.path.isdir(os.path.join(path, "index")):
        raise CLIError(f"{path}: no kvstore here (set --store or $KVSTORE_DIR)")


def cmd_stats(args) -> int:
    _guard_store(args.store)
    stats = _maintenance().store_stats(args.store, full=args.full)
    if args.json:
        print(json.dumps(stats, sort_keys=True, default=str))
        return EXIT_OK
    print(
        f"store {args.store}: {_human(stats.get('bytes_on_disk', 0))} on disk", end=""
    )
    budget = stats.get("disk_budget")
    print(f", budget {_human(budget)}" if budget is not None else ", no disk budget")
    for ns in stats.get("namespaces", []):
        prompts = f"prompts {ns['prompts']:>5}  " if ns["prompts"] is not None else ""
        print(
            f"  {ns['id'][:12]} {ns.get('model_type') or '?':<12} nodes {ns['nodes']:>6}  "
            f"{prompts}tokens {ns['tokens']:>8}  {_human(ns['bytes']):>10}  "
            f"pinned {_human(ns['pinned_bytes'])}"
        )
        trees = ns.get("salted_trees") or []
        for tree in trees[:_SHOWN_TREES]:  # by root hash: the store has no salt
            print(
                f"    salted tree {tree['root'][:12]}  nodes {tree['nodes']:>6}  "
                f"tokens {tree['tokens']:>8}  {_human(tree['bytes']):>10}"
            )
        if len(trees) > _SHOWN_TREES:
            print(f"    ... {len(trees) - _SHOWN_TREES} more salted trees (--json)")
    return EXIT_OK


_SHOWN_TREES = 20


def cmd_ls(args) -> int:
    _guard_store(args.store)
    trees = _maintenance().list_tree(args.store, max_depth=args.depth)
    if args.json:
        print(json.dumps(trees, sort_keys=True, default=str))
        return EXIT_OK
    decoders = {} if args.no_decode else _decoders(args.store, args.model)
    for ns in trees:
        decode = decoders.get(ns["namespace"])
        print(f"namespace {ns['namespace'][:12]} ({ns.get('model_type') or '?'})")
        for node in ns["children"]:
            _print_node(node, decode, "  ")
        if ns.get("more"):
            print(f"  ... {ns['more']} more")
    return EXIT_OK


def _decoders(store: str, model: Optional[str]) -> dict:
    """Token decoders for the namespaces whose vocabulary is the model's tokenizer's."""
    from mlx_lm.utils import load_tokenizer

    from .disk.index import Index
    from .disk.namespace import vocab_digest

    try:
        if model is None:
            from .platform.default_model import ensure_default_model

            model = ensure_default_model()
        tokenizer = load_tokenizer(model)
    except Exception as e:  # listing still works, with token ids
        print(
            f"kvstore ls: not decoding tokens ({type(e).__name__}: {e})",
            file=sys.stderr,
        )
        return {}
    digest = vocab_digest(tokenizer)
    index = Index(os.path.join(store, "index"), create=False)
    try:
        return {
            ns.hex(): tokenizer.decode
            for ns, desc in index.namespaces().items()
            if desc.get("vocab") == digest
        }
    finally:
        index.close()


def _print_node(node: dict, decode, indent: str) -> None:
    text = (
        decode(node["first_tokens"])
        if decode
        else " ".join(map(str, node["first_tokens"][:8]))
    )
    text = text.replace("\n", "\\n")[:48]
    flags = node["kind"] + (", pinned" if node["pinned"] else "")
    print(f"{indent}{node['id'][:12]} {node['tokens']:>5} tok  [{flags}]  {text!r}")
    for child in node.get("children", []):
        _print_node(child, decode, indent + "  ")
    if node.get("more"):
        print(f"{indent}  ... {node['more']} more")


def _print_salvage(done: dict) -> None:
    """What ``verify --fix`` salvaged from a damaged index, and what was lost."""
    for why in done["damage"]:
        print(f"damage: {why}")
    for lost in done["lost"]:
        print(f"lost: node {lost['node']}: {lost['why']}")
    print(
        f"salvaged {done['nodes_kept']} of {done['nodes_found']} node records found "
        f"({done['records_from_scan']} from pages the index no longer reached) into a "
        f"new index; {done['orphan_files']} node files lost their record (orphans: "
        f"`kvstore gc` removes them); the damaged index is at {done['moved_to']}"
    )


def cmd_verify(args) -> int:
    _guard_store(args.store)
    report = _maintenance().verify(args.store, fix=args.fix)
    if args.json:
        print(json.dumps(report, sort_keys=True, default=str))
    else:
        for p in report["problems"]:
            print(
                f"{p['kind']}: {p.get('file') or p.get('node')}: {p.get('detail', '')}"
            )
        if report.get("salvaged"):
            _print_salvage(report["salvaged"])
        if not report["clean"]:
            print("problems found" + (" (fixed)" if args.fix else ""))
        elif report["orphans"]:
            print(
                f"index clean, but {report['orphans']} orphan chunk files: files no index "
                "record names, left by a crash before their commit or by commits the "
                "index lost (e.g. index/lock.mdb deleted while the store was in use); "
                "`kvstore gc` removes them"
            )
        elif report["dead_writer_temp_files"]:
            print(
                f"index clean, but {report['dead_writer_temp_files']} temp files of "
                "writer processes that are gone (killed mid-write); `kvstore gc` "
                "removes them"
            )
        else:
            print("clean")
    return EXIT_OK if report["clean"] else EXIT_FAILED_LINES


def cmd_gc(args) -> int:
    _guard_store(args.store)
    try:
        report = _maintenance().gc(
            args.store, max_bytes=args.max_bytes, drop_namespaces=args.drop_model or ()
        )
    except ValueError as e:  # a --drop-model that names no namespace
        raise CLIError(f"--drop-model: {e}" if args.drop_model else str(e)) from None
    print(
        json.dumps(report, sort_keys=True, default=str)
        if args.json
        else _gc_text(report)
    )
    return EXIT_OK


def _gc_text(report: dict) -> str:
    return ", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in sorted(report.items()))


def cmd_pin(args, pinned: bool = True) -> int:
    _guard_store(args.store)
    from .prompts import PromptError, parse_line

    if args.node:
        if not args.namespace:
            raise CLIError("--node needs --namespace (see `kvstore stats`)")
        try:
            n = _maintenance().pin_path(args.store, args.namespace, args.node, pinned)
        except ValueError as e:  # an id that is malformed or names nothing
            raise CLIError(f"--namespace/--node: {e}") from None
        print(f"{'pinned' if pinned else 'unpinned'} {n} nodes")
        return EXIT_OK
    check_store(args.store)
    model, tokenizer = load_model(args.model)
    if args.file:
        texts = [(f"{args.file}:{no}", t) for no, t in _read_prompts(args.file)]
    elif args.text is not None:
        texts = [("text", json.dumps({"prompt": args.text}))]
    else:
        raise CLIError("give a prompt text, --file PROMPTS.jsonl or --node ID")
    total, failed = 0, 0
    with open_store(args.store, model, tokenizer, args) as store:
        for where, text in texts:
            try:
                line = parse_line(0, text, tokenizer)
            except PromptError as e:
                print(f"{where}: {e}", file=sys.stderr)
                failed += 1
                continue
            total += store.pin(line.tokens, pinned=pinned)
    print(f"{'pinned' if pinned else 'unpinned'} {total} nodes")
    return EXIT_FAILED_LINES if failed else EXIT_OK


# -- remote tier -----------------------------------------------------------------


def cmd_push(args) -> int:
    tier = remote_tier(args, upload=False)
    _guard_store(args.store)
    from .remote import RemoteError, push

    try:
        namespaces = _push_namespaces(args)
        report = push(args.store, tier, namespaces=namespaces)
    except RemoteError as e:
        raise CLIError(f"--remote {args.remote}: {e}") from None
    finally:
        tier.close()
    if args.json:
        print(json.dumps(report, sort_keys=True))
    else:
        for problem in report["problems"]:
            print(f"kvstore push: {problem}", file=sys.stderr)
        print(
            f"{report['nodes']} nodes in {report['namespaces']} namespaces: "
            f"{report['uploaded']} uploaded ({_human(report['bytes_up'])}), "
            f"{report['present']} already there, {report['skipped']} skipped"
        )
    return EXIT_FAILED_LINES if report["problems"] else EXIT_OK


def _push_namespaces(args) -> Optional[List[bytes]]:
    """The namespaces ``--namespace`` and ``--model`` name; None (all) without them."""
    if not args.namespace and args.model is None:
        return None
    from .disk.index import Index
    from .maintenance.common import known_namespaces, resolve_namespace

    out = []
    if args.namespace:
        index = Index(os.path.join(args.store, "index"), create=False)
        try:
            known = index.read(lambda txn: known_namespaces(index, txn))
            for spec in args.namespace:
                try:
                    out.append(resolve_namespace(known, spec))
                except ValueError as e:
                    raise CLIError(f"--namespace: {e}") from None
        finally:
            index.close()
    if args.model is not None:
        model, tokenizer = load_model(args.model)
        with open_store(args.store, model, tokenizer, args) as store:
            out.append(store.namespace)
    return out


def cmd_pull(args) -> int:
    tier = remote_tier(args, upload=False)
    from .remote import RemoteError

    model, tokenizer = load_model(args.model)
    with open_store(args.store, model, tokenizer, args, remote=tier) as store:
        try:
            report = tier.pull()
        except RemoteError as e:
            raise CLIError(f"--remote {args.remote}: {e}") from None
        report["namespace"] = store.namespace.hex()
    if args.json:
        print(json.dumps(report, sort_keys=True))
    else:
        for problem in report["problems"]:
            print(f"kvstore pull: {problem}", file=sys.stderr)
        if not report["remote_nodes"]:
            print(
                f"kvstore pull: the remote has no nodes of namespace "
                f"{report['namespace'][:12]} (same model, tokenizer, --chunk-tokens "
                f"and --kv-bits as the machines that uploaded?)",
                file=sys.stderr,
            )
        print(
            f"{report['remote_nodes']} nodes on the remote: {report['pulled']} pulled "
            f"({_human(report['bytes_down'])}), {report['present']} already here, "
            f"{report['invalid']} invalid, {report['unreachable']} unreachable"
        )
    return EXIT_FAILED_LINES if report["invalid"] else EXIT_OK


# -- parser --------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``kvstore`` parser; ``serve`` and ``bench`` parse their own arguments."""
    parser = argparse.ArgumentParser(
        prog="kvstore",
        description="Persistent KV caches for mlx-lm: prefill once, reuse forever.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "serve",
        help="mlx-lm's OpenAI-compatible server with the persistent cache (see `kvstore serve -h`)",
        add_help=False,
    )
    sub.add_parser(
        "bench",
        help="benchmark against recomputation and mlx-lm (see `kvstore bench -h`)",
        add_help=False,
    )
    for add in (
        _add_prefill,
        _add_stats,
        _add_ls,
        _add_verify,
        _add_gc,
        _add_push,
        _add_pull,
        _add_pin,
    ):
        add(sub)
    return parser


def _common_options(p: argparse.ArgumentParser, *, model: bool = False) -> None:
    """``--store`` and ``--json``; with ``model``, the model and cache options."""
    p.add_argument(
        "--store",
        default=default_store(),
        help="store directory (default: %(default)s)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    if model:
        p.add_argument(
            "--model",
            default=None,
            help="mlx-lm model path or hub id (default: SmolLM2-135M-Instruct)",
        )
        p.add_argument(
            "--chunk-tokens",
            type=_chunk,
            default=256,
            help="tokens per node (default: 256)",
        )
        p.add_argument(
            "--kv-bits",
            type=_bits,
            default=None,
            help="store quantized KV of this many bits (as mlx_lm.server --kv-bits)",
        )
        p.add_argument(
            "--kv-group-size",
            type=_positive,
            default=64,
            help="quantization group size with --kv-bits (default: 64)",
        )


def _add_prefill(sub) -> None:
    """``kvstore prefill``."""
    p = sub.add_parser(
        "prefill", help="compute and store the KV of prompts from a JSONL file"
    )
    p.add_argument(
        "prompts",
        help="JSONL: {messages|prompt|tokens, id?, kind?, pin?} per line (- for stdin)",
    )
    _common_options(p, model=True)
    p.add_argument(
        "--kind",
        default="user",
        choices=["system", "user", "assistant"],
        help="default kind",
    )
    p.add_argument(
        "--pin", action="store_true", help="pin every prompt (default: per line)"
    )
    p.add_argument(
        "--salt",
        type=_salt,
        default=None,
        help="store in this cache salt's tree, as a server request's cache_salt "
        '(default: per line\'s "salt", else unsalted)',
    )
    p.add_argument(
        "--tenant",
        type=_salt,
        default=None,
        help="store in this tenant's tree, as kvstore serve --salt-header serves a "
        "request whose header has this value (with --salt: that request's "
        'cache_salt); default: per line\'s "tenant"',
    )
    p.add_argument("--max-tokens-per-prompt", type=_positive, default=None)
    p.add_argument("--strict", action="store_true", help="stop at the first bad line")
    add_size_options(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_remote_options(
        p,
        required=False,
        help="shared remote tier s3://bucket/prefix: download what it has, upload "
        "what is computed (endpoint and credentials from AWS_* variables)",
    )
    p.set_defaults(func=cmd_prefill)


def _add_stats(sub) -> None:
    """``kvstore stats``."""
    p = sub.add_parser("stats", help="what the store holds, per model")
    _common_options(p)
    p.add_argument(
        "--full",
        action="store_true",
        help="also read every record and walk the files (prompts, times, salted "
        "trees, files on disk): time grows with the store; without it, the totals "
        "the index keeps",
    )
    p.set_defaults(func=cmd_stats)


def _add_ls(sub) -> None:
    """``kvstore ls``."""
    p = sub.add_parser("ls", help="the stored prefixes as a tree")
    _common_options(p)
    p.add_argument("--depth", type=_positive, default=4)
    p.add_argument("--no-decode", action="store_true", help="show token ids, not text")
    p.add_argument(
        "--model", default=None, help="whose tokenizer decodes (default: SmolLM2)"
    )
    p.set_defaults(func=cmd_ls)


def _add_verify(sub) -> None:
    """``kvstore verify``."""
    p = sub.add_parser("verify", help="check every node's file; exit 0 only when clean")
    _common_options(p)
    p.add_argument(
        "--fix",
        action="store_true",
        help="quarantine what is broken; salvage a damaged index into a new one",
    )
    p.set_defaults(func=cmd_verify)


def _add_gc(sub) -> None:
    """``kvstore gc``."""
    p = sub.add_parser(
        "gc", help="remove orphans, temp files, broken nodes; evict to a budget"
    )
    _common_options(p)
    p.add_argument(
        "--max-bytes",
        type=parse_size,
        default=None,
        help="evict down to this size (e.g. 2G)",
    )
    p.add_argument(
        "--drop-model",
        action="append",
        metavar="ID",
        help="drop a namespace (repeatable)",
    )
    p.set_defaults(func=cmd_gc)


def _add_push(sub) -> None:
    """``kvstore push``."""
    p = sub.add_parser(
        "push", help="upload the store's nodes that a remote tier (s3://) lacks"
    )
    _common_options(p)
    add_remote_options(p, required=True, help="s3://bucket/prefix")
    p.add_argument(
        "--namespace",
        action="append",
        metavar="ID",
        help="only this namespace (hex id or prefix; repeatable; default: all)",
    )
    p.add_argument(
        "--model", default=None, help="only the namespace of this mlx-lm model"
    )
    p.add_argument("--chunk-tokens", type=_chunk, default=256)
    p.add_argument("--kv-bits", type=_bits, default=None)
    p.add_argument("--kv-group-size", type=_positive, default=64)
    p.set_defaults(func=cmd_push)


def _add_pull(sub) -> None:
    """``kvstore pull``."""
    p = sub.add_parser(
        "pull",
        help="download (and validate) every node of a model that a remote tier has",
    )
    _common_options(p, model=True)
    add_remote_options(p, required=True, help="s3://bucket/prefix")
    add_disk_budget_option(p)  # a pull evicts as saves do
    p.set_defaults(func=cmd_pull)


def _add_pin(sub) -> None:
    """``kvstore pin`` and ``kvstore unpin``."""
    for name, pinned in (("pin", True), ("unpin", False)):
        p = sub.add_parser(
            name, help=f"{name} a stored prefix (by text, JSONL file or node id)"
        )
        _common_options(p, model=True)
        p.add_argument("text", nargs="?", default=None, help="prompt text")
        p.add_argument("--file", help="JSONL file of prompts")
        p.add_argument("--node", help="node id (hex) with --namespace")
        p.add_argument("--namespace", help="namespace id (hex) for --node")
        p.set_defaults(func=lambda a, _p=pinned: cmd_pin(a, _p))


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "serve":
        # Everything after `serve` goes to mlx-lm's own server parser, untouched.
        from .server import main as serve_main

        return serve_main(argv[1:])
    if argv and argv[0] == "bench":
        from .bench import main as bench_main

        try:
            return bench_main(argv[1:])
        except BrokenPipeError:  # `kvstore bench --from-json RUN | head`
            _quiet_stdout()
            return EXIT_BROKEN_PIPE
    args = build_parser().parse_args(argv)
    import lmdb

    from .disk.index import StoreError

    try:
        return args.func(args)
    except (CLIError, StoreError) as e:
        print(f"kvstore {args.command}: {e}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:  # `kvstore ls | head`: the reader is gone
        _quiet_stdout()
        return EXIT_BROKEN_PIPE
    except lmdb.DiskError:
        print(
            f"kvstore {args.command}: {args.store}: the file system is full, and the "
            "index needs room for the commit that records the deletions (LMDB writes "
            "new pages before it frees old ones): free a few MiB on that file system, "
            "then run the command again",
            file=sys.stderr,
        )
        return EXIT_ERROR
    except lmdb.Error as e:  # damage the page check at open could not see
        print(
            f"kvstore {args.command}: {getattr(args, 'store', '')}: the index cannot be "
            f"read "
            f"({type(e).__name__}: {e}): `kvstore verify --fix` salvages what it can",
            file=sys.stderr,
        )
        return EXIT_ERROR
    except OSError as e:  # e.g. a file of the store that cannot be read
        print(f"kvstore {args.command}: {args.store}: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"kvstore {args.command}: interrupted", file=sys.stderr)
        return 130


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that flushing it at exit raises nothing more."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
