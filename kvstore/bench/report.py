"""The bench's output: targets with PASS/MISS, the tables, and the PNG chart."""

from typing import Dict, List, Optional, Tuple

from kvstore.bench.measure import MB, gbps, med

TTFT_AT = 2048  # the target length for disk-hot TTFT


def _m(xs) -> Optional[float]:
    xs = [x for x in xs or [] if x is not None]
    return med(xs) if xs else None


def _ms(x: Optional[float], width: int = 9) -> str:
    return f"{x * 1e3:{width}.1f}" if x is not None else f"{'-':>{width}}"


def _listed(x) -> list:
    return x if isinstance(x, list) else [x]  # JSON of older runs: one median


def ram_assemble(case: dict) -> List[float]:
    """Assemble time of RAM-hot restores: all of a fetch but its trie walk (wall)."""
    return [t - (lk or 0.0) for t, lk in zip(case["restore_s"], case["lookup_s"])]


# -- targets ---------------------------------------------------------------------------


def _adder(out: List[Dict]):
    """``add(what, value, target, ok, floor_bound=False)``: appends one target row
    to ``out``; ``floor_bound``: the floor measured in the same run misses the
    target too (no reader of those bytes meets it on this machine)."""

    def add(what, value, target, ok, floor_bound=False):
        row = {"what": what, "value": value, "target": target, "ok": ok}
        if floor_bound:
            row["floor_bound"] = True
        out.append(row)

    return add


def _status(ok: Optional[bool], floor_bound: bool = False) -> str:
    """PASS, MISS, "MISS, floor" (the floor misses it as well) or info."""
    if ok is None:
        return "info"
    return "PASS" if ok else "MISS, floor" if floor_bound else "MISS"


def _like_for_like(c: Dict) -> str:
    """The kvstore case to hold against load_prompt_cache's exactly full caches: the
    restore without room where the run has one (the room's trade is shown beside)."""
    return "kvstore_room0" if "kvstore_room0" in c else "kvstore"


def _room_trade(c: Dict) -> Optional[Tuple[float, float]]:
    """``(ms the room costs the fetch, ms it saves the first forward pass)``."""
    if "kvstore_room0" not in c or not _col(c["kvstore"], "forward_s"):
        return None
    room, exact = c["kvstore"], c["kvstore_room0"]
    return (
        (_m(_wall(room)) - _m(_wall(exact))) * 1e3,
        (_m(_col(exact, "forward_s")) - _m(_col(room, "forward_s"))) * 1e3,
    )


def _floor_bound(c: Dict, target: float) -> bool:
    """Whether even the floor's speed is below ``target`` times load_prompt_cache's:
    kvstore reads the same bytes into new buffers and verifies them besides."""
    return _speed(c, "load_prompt_cache", "floor") < target


def targets(res: Dict) -> List[Dict]:
    out: List[Dict] = []
    add = _adder(out)

    chunk = res.get("settings", {}).get("chunk_tokens", 256)
    rows = res.get("ttft") or []
    if rows:
        at = next((r for r in rows if r["tokens"] == TTFT_AT), rows[-1])
        for key, cases in at["cases"].items():
            if key.startswith(("disk_", "restart_")):
                ratio = _m(cases["ttft_s"]) / at["cold_s"]
                add(
                    f"TTFT {cases['label']} ({cases['page_cache']}) / cold, "
                    f"{at['tokens']} tokens",
                    f"{ratio:.4f}",
                    "<= 0.05",
                    ratio <= 0.05,
                )
        for r in rows:
            add(*_assemble_target(r, r["ram_assemble_s"], "model", chunk))
    for r in res.get("restore") or []:
        n, c = r["tokens"], r["cases"]
        for cond in ("warm", "dropped"):
            if f"disk_{cond}" not in c:
                continue
            k = _m(c[f"disk_{cond}"]["restore_s"])
            for base, name, goal in (
                ("load_prompt_cache", "mlx-lm load_prompt_cache", 0.9),
                ("raw", "raw read", 0.7),
            ):
                ratio = _m(c[f"{base}_{cond}"]["restore_s"]) / k
                add(
                    f"restore GB/s kvstore / {name}, {n} tokens, page cache {cond}",
                    f"{ratio:.2f}",
                    f">= {goal}" + ("" if cond == "warm" else " (info)"),
                    ratio >= goal if cond == "warm" else None,
                )
        if "ram_hot" in c:
            add(*_assemble_target(r, ram_assemble(c["ram_hot"]), "synthetic", chunk))
    scale = res.get("scale") or []
    if len(scale) >= 2:
        lo, hi = scale[0], scale[-1]
        for key, name in (
            ("open_s", "open time"),
            ("hit_lookup_s", "fetch-hit lookup"),
            ("miss_s", "fetch-miss"),
        ):
            a, b = _m(_listed(lo[key])), _m(_listed(hi[key]))
            add(
                f"{name} at {hi['chunks']:,} / at {lo['chunks']:,} chunks",
                f"{b / a:.2f} ({b * 1e3:.3f} / {a * 1e3:.3f} ms)",
                "<= 2",
                b / a <= 2,
            )
    w = res.get("write")
    if w:
        add(
            f"prefill tokens/s with saving / without, {w['tokens']} tokens",
            f"{w['ratio']:.3f}",
            ">= 0.95",
            w["ratio"] >= 0.95,
        )
    out += restart_targets(res)
    for r in res.get("restore") or []:
        d = r["disk"]["ratio"]
        add(
            f"bytes on disk (chunk files + index) / KV bytes, {r['tokens']} tokens",
            f"{d:.4f}",
            "<= 1.01",
            d <= 1.01,
        )
    return out


def _assemble_target(row: Dict, assemble: List[float], kv: str, chunk: int):
    """RAM-hot assemble vs one mx.concatenate per tensor of the same node arrays.

    With a single chunk there is nothing to join: MLX returns the one input as it is
    (0.0 ms), so the ratio says nothing and is reported as info only.
    """
    a, c = _m(assemble), _m(row["concat_s"])
    what = f"RAM-hot assemble / one mx.concatenate, {row['tokens']} tokens ({kv})"
    value = f"{a / c:.2f} ({a * 1e3:.1f} / {c * 1e3:.1f} ms)" if c else "n/a"
    if row["tokens"] <= chunk:
        return what, value, "<= 1.5 (info: one chunk, nothing to concatenate)", None
    return what, value, "<= 1.5", a <= 1.5 * c


# -- tables ------------------------------------------------------------------------------


def _resident(case) -> str:
    r = _m(case.get("resident"))
    return f"{r * 100:.0f}%" if r is not None else "?"


def print_ttft(rows: List[Dict]) -> None:
    print(
        "\nTime to first token (medians; ms). restore = lookup + read + assemble in "
        "wall time;\nread* and assemble* are summed over the store's reader threads "
        "(a whole node from disk\nis read straight into the cache arrays: read*). "
        "model = the model's work\nafter the restore (1 token, or the new suffix). "
        "resident = store files in the page cache."
    )
    hdr = (
        f"{'tokens':>6}  {'case':<32} {'page cache':<10} {'TTFT':>9} {'x cold':>7} "
        f"{'open':>7} {'lookup':>7} {'read*':>7} {'assem*':>7} {'restore':>8} "
        f"{'model':>8} {'resident':>8}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(
            f"{r['tokens']:>6}  {'cold: full prefill, no store':<32} {'-':<10} "
            f"{_ms(r['cold_s'])} {1:>7.3f}"
        )
        for case in r["cases"].values():
            ttft = _m(case["ttft_s"])
            print(
                f"{'':>6}  {case['label']:<32} {case['page_cache'] or '-':<10} "
                f"{_ms(ttft)} {ttft / r['cold_s']:>7.4f} {_ms(_m(case.get('open_s')), 7)} "
                f"{_ms(_m(case['lookup_s']), 7)} {_ms(_m(case['read_s']), 7)} "
                f"{_ms(_m(case['assemble_s']), 7)} {_ms(_m(case['restore_s']), 8)} "
                f"{_ms(_m(case['model_s']), 8)} "
                f"{_resident(case) if case['page_cache'] else '-':>8}"
            )
        print(
            f"{'':>6}  cold prefill {r['tokens'] / r['cold_s']:.1f} tokens/s; KV "
            f"{r['kv_bytes'] / MB:.1f} MB; RAM-hot assemble {_ms(_m(r['ram_assemble_s']), 0)}"
            f" ms vs one mx.concatenate {_ms(_m(r['concat_s']), 0)} ms"
        )


def print_restore(rows: List[Dict]) -> None:
    print(
        "\nRestore throughput, synthetic KV of the model's shape (medians; ms; GB = 1e9 B)."
        "\nx lpc / x raw: kvstore's GB/s over load_prompt_cache's / raw read's, same page "
        "cache state."
    )
    hdr = (
        f"{'tokens':>7} {'KV MB':>8}  {'case':<40} {'page cache':<10} {'ms':>9} "
        f"{'GB/s':>6} {'lookup':>7} {'read*':>8} {'assem*':>8} {'x lpc':>6} {'x raw':>6} "
        f"{'resident':>8}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        n, kvb, c = r["tokens"], r["kv_bytes"], r["cases"]
        print(f"{n:>7} {kvb / MB:>8.1f}")
        for key, case in c.items():
            t = _m(case["restore_s"])
            cond = case["page_cache"]
            ratios = ""
            if key.startswith(("disk_", "restart_")) and f"raw_{cond}" in c:
                lpc = _m(c[f"load_prompt_cache_{cond}"]["restore_s"])
                raw = _m(c[f"raw_{cond}"]["restore_s"])
                ratios = f"{lpc / t:>6.2f} {raw / t:>6.2f}"
            else:
                ratios = f"{'':>6} {'':>6}"
            print(
                f"{'':>7} {'':>8}  {case['label']:<40} {cond or '-':<10} {_ms(t)} "
                f"{gbps(kvb, t):>6.2f} {_ms(_m(case['lookup_s']), 7)} "
                f"{_ms(_m(case['read_s']), 8)} {_ms(_m(case['assemble_s']), 8)} {ratios} "
                f"{_resident(case) if cond else '-':>8}"
            )
        extra = f"first restore in this process {_ms(r['first_s'], 0)} ms"
        if "first_faults" in r:
            extra += f" ({r['first_faults']:,} page faults)"
        if "restored_equal" in r:
            extra += f"; restored KV equal to the saved file's: {r['restored_equal']}"
        if "concat_s" in r:
            extra += (
                f"; RAM-hot assemble {_ms(_m(ram_assemble(c['ram_hot'])), 0)} ms vs one "
                f"mx.concatenate {_ms(_m(r['concat_s']), 0)} ms"
            )
        print(f"{'':>17}{extra}")
        print(
            f"{'':>17}save: returned {_ms(r['save_return_s'], 0)} ms, flushed "
            f"{_ms(r['save_flush_s'], 0)} ms; save_prompt_cache {_ms(r['save_prompt_cache_s'], 0)} ms"
        )
        for key, case in c.items():
            if key.startswith("restart_"):
                print(
                    f"{'':>17}restart ({case['page_cache']}): model load "
                    f"{_ms(_m(case['model_load_s']), 0)} ms, open {_ms(_m(case['open_s']), 0)}"
                    f" ms, first restore {_ms(_m(case['restore_s']), 0)} ms "
                    f"({_m(case['fetch_faults']):,.0f} page faults)"
                )


def print_write(w: Dict) -> None:
    print(
        f"\nWrite cost: prefill of fresh {w['tokens']}-token prompts, without a store "
        f"{w['tokens'] / med(w['plain_s']):.2f} tokens/s, with KVStore.prefill saving "
        f"{w['tokens'] / med(w['saving_s']):.2f} tokens/s (ratio {w['ratio']:.3f}); final "
        f"flush {w['final_flush_s'] * 1e3:.0f} ms; {w['nodes_written']} nodes written, "
        f"{w['writes_dropped']} dropped, {w['writes_failed']} failed"
    )


def print_scale(rows: List[Dict]) -> None:
    print(
        "\nScale: tiny-model store (4-token chunks); medians; ms. hit = a 10-chunk prompt"
    )
    hdr = (
        f"{'chunks':>9} {'fill s':>8} {'open':>8} {'hit lookup':>10} {'hit total':>10} "
        f"{'miss':>8}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(
            f"{r['chunks']:>9,} {r['fill_s']:>8.1f} {_m(r['open_s']) * 1e3:>8.3f} "
            f"{_m(_listed(r['hit_lookup_s'])) * 1e3:>10.3f} "
            f"{_m(_listed(r['hit_total_s'])) * 1e3:>10.3f} "
            f"{_m(_listed(r['miss_s'])) * 1e3:>8.3f}"
        )


def print_disk(rows: List[Dict]) -> None:
    print("\nBytes on disk (apparent sizes)")
    for r in rows:
        d = r["disk"]
        print(
            f"  {r['tokens']:>7} tokens: KV {d['kv_bytes']:,} B; chunk files "
            f"{d['chunk_file_bytes']:,} + index {d['index_bytes']:,} = {d['ratio']:.4f}x "
            f"({d['nodes']} nodes; allocated {d['store_dir_allocated'] / d['kv_bytes']:.4f}x;"
            f" one mlx-lm file {d['one_file_bytes'] / d['kv_bytes']:.4f}x)"
        )


def print_targets(rows: List[Dict]) -> None:
    print("\nTARGETS (ratios from this run)")
    for t in rows:
        status = _status(t["ok"], t.get("floor_bound", False))
        print(f"  [{status}] {t['what']}: {t['value']} (target {t['target']})")
    if any(t.get("floor_bound") for t in rows):
        print(
            "  (MISS, floor: the floor in this run misses the target as well: no "
            "reader of these bytes meets it on this machine)"
        )


def print_report(res: Dict) -> None:
    """Every section the run has, in the order they ran, then the targets."""
    printers = (
        ("ttft", (print_ttft,)),
        ("write", (print_write,)),
        ("restore", (print_restore, print_disk)),
        ("scale", (print_scale,)),
        ("fresh", (print_fresh,)),
        ("repeat", (print_repeat,)),
        ("recycled", (print_recycled,)),
        ("open", (print_open,)),
        ("durable", (print_durable,)),
        ("miss", (print_miss,)),
        ("hash", (print_hash,)),
        ("save", (print_save,)),
    )
    for key, prints in printers:
        if res.get(key):
            for print_section in prints:
                print_section(res[key])
    print_targets(res["targets"])


# -- chart -------------------------------------------------------------------------------


def plot(res: Dict, path: str) -> None:
    """TTFT and restore throughput against prompt length, as one PNG.

    Raises:
        RuntimeError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError(
            "--plot needs matplotlib: pip install 'kvstore[plot]' (or matplotlib)"
        ) from None
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.5))
    colors = {}

    def line(ax, xs, ys, case):
        """One case: a colour per case, dashed when the page cache was dropped."""
        color = colors.setdefault(case["label"], f"C{len(colors) % 10}")
        dropped = case.get("page_cache") == "dropped"
        label = case["label"] + (
            f" ({case['page_cache']})" if case.get("page_cache") else ""
        )
        ax.plot(xs, ys, "o" + ("--" if dropped else "-"), color=color, label=label)

    rows = res.get("ttft") or []
    if rows:
        xs = [r["tokens"] for r in rows]
        line(left, xs, [r["cold_s"] for r in rows], {"label": "cold prefill"})
        for key, case in rows[0]["cases"].items():
            line(left, xs, [_m(r["cases"][key]["ttft_s"]) for r in rows], case)
        left.set_xscale("log", base=2)
        left.set_yscale("log")
        left.set_xlabel("prompt tokens")
        left.set_ylabel("time to first token (s)")
        left.set_title(f"Time to first token, {res['model']}")
    rows = res.get("restore") or []
    if rows:
        keys = dict.fromkeys(k for r in rows for k in r["cases"])  # RAM-hot: small only
        for key in keys:
            have = [r for r in rows if key in r["cases"]]
            ys = [gbps(r["kv_bytes"], _m(r["cases"][key]["restore_s"])) for r in have]
            line(right, [r["tokens"] for r in have], ys, have[0]["cases"][key])
        right.set_xscale("log", base=2)
        right.set_xlabel("tokens of KV restored")
        right.set_ylabel("restore throughput (GB/s)")
        right.set_title("Restore throughput (synthetic KV of the model's shape)")
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- after a restart, repeated restores, open time, durable saves -----------------------


def _wall(case: Dict) -> List[float]:
    """A case's restore times: child samples' wall times, or in-process samples."""
    if "samples" in case:
        return [s["wall_s"] for s in case["samples"]]
    return case["restore_s"]


def _col(case: Dict, key: str) -> List[float]:
    if "samples" in case:
        return [s.get(key) for s in case["samples"] if s.get(key) is not None]
    return case.get(key) or []


def _speed(rows_case: Dict, base: str, name: str = "kvstore") -> Optional[float]:
    """``base``'s median time over ``name``'s: above 1, ``name`` is faster."""
    if base not in rows_case or name not in rows_case:
        return None
    return _m(_wall(rows_case[base])) / _m(_wall(rows_case[name]))


def _samples_ms(xs: List[float]) -> str:
    return "[" + ", ".join(f"{x * 1e3:.1f}" for x in xs) + "]"


def _restore_rows(rows: List[Dict], title: str) -> None:
    print(title)
    hdr = (
        f"{'dtype':<9} {'tokens':>6} {'KV MB':>7}  {'case':<36} {'ms':>8} {'GB/s':>6} "
        f"{'faults':>8} {'user':>7} {'sys':>7} {'fwd':>7}  samples ms"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        c = r["cases"]
        print(f"{r['dtype']:<9} {r['tokens']:>6} {r['kv_bytes'] / MB:>7.1f}")
        for case in c.values():
            t = _m(_wall(case))
            print(
                f"{'':<9} {'':>6} {'':>7}  {case['label']:<36} {_ms(t, 8)} "
                f"{gbps(r['kv_bytes'], t):>6.2f} {_m(_col(case, 'faults')) or 0:>8,.0f} "
                f"{_ms(_m(_col(case, 'user_s')), 7)} {_ms(_m(_col(case, 'sys_s')), 7)} "
                f"{_ms(_m(_col(case, 'forward_s')), 7)}  {_samples_ms(_wall(case))}"
            )
        kv, lpc, floor = (
            _speed(c, "load_prompt_cache"),
            _speed(c, "floor"),
            _speed(c, "floor", "load_prompt_cache"),
        )
        line = (
            f"{'':<26}kvstore speed: {kv:.2f}x load_prompt_cache, {lpc:.2f}x the floor"
        )
        line += f" (load_prompt_cache {floor:.2f}x the floor)"
        print(line)
        k, f = c["kvstore"], c["floor"]
        extra = _m(_wall(k)) - _m(_wall(f))
        print(
            f"{'':<26}kvstore - floor = {extra * 1e3:.1f} ms wall; CPU beyond the "
            f"floor's: user {(_m(_col(k, 'user_s')) - _m(_col(f, 'user_s'))) * 1e3:.1f}"
            f" ms (checksum, Python), system "
            f"{(_m(_col(k, 'sys_s')) - _m(_col(f, 'sys_s'))) * 1e3:.1f} ms"
            + (
                f"; xxh3 of these bytes alone {_m(r['hash_alone_s']) * 1e3:.1f} ms"
                if "hash_alone_s" in r
                else ""
            )
        )


def print_fresh(rows: List[Dict]) -> None:
    _restore_rows(
        rows,
        "\nAfter a restart: the first restore in a fresh process, each case in its own "
        "child process, order rotated\nevery repeat; synthetic KV of SmolLM2-135M's "
        "shape (30 layers x 3 KV heads x 64); page cache warm;\nRAM tier off. ms = "
        "from fetch (or load) to evaluated arrays, median; faults, user, sys = the\n"
        "process's minor page faults and CPU ms (all threads) in that time; fwd = the "
        "first forward pass over\none more token (an exactly full cache copies every "
        "layer to grow).",
    )


def print_repeat(rows: List[Dict]) -> None:
    _restore_rows(
        rows,
        "\nRepeated restores in one process (page cache warm, RAM tier off, each "
        "restore freed before the next,\ncases alternating); same KV and columns as "
        "above.",
    )
    for r in rows:
        p = r.get("kvstore_phases")
        if p:
            print(
                f"  {r['dtype']} {r['tokens']}: kvstore phases (median ms) lookup "
                f"{_ms(_m(p['lookup_s']), 0)}, read* {_ms(_m(p['read_s']), 0)}, "
                f"assemble* {_ms(_m(p['assemble_s']), 0)} (* summed over reader threads)"
            )


def print_recycled(rows: List[Dict]) -> None:
    _restore_rows(
        rows,
        "\nRepeated restores with freed memory recycled: as above, with MLX's buffer "
        "cache raised above the KV\nsize, so freed arrays are reused and no case pays "
        "page faults for new memory (the read path alone).",
    )


def _ms3(x: float) -> str:
    return f"{x * 1e3:.3f}"


def print_miss(m: Dict) -> None:
    ts = m["fetch_s"]
    print(
        f"\nFetch that finds nothing, {m['tokens']}-token prompt sharing nothing with "
        f"the store ({m['calls']} calls;\nincludes make_prompt_cache of the empty "
        f"cache): median {_ms3(med(ts))} ms (min {_ms3(min(ts))}, max "
        f"{_ms3(max(ts))}); parts alone: as_token_array {_ms3(med(m['as_token_array_s']))}"
        f" ms, make_prompt_cache {_ms3(med(m['make_prompt_cache_s']))} ms"
    )


def print_hash(h: Dict) -> None:
    print(
        f"\nHash chain, {h['tokens']} tokens as a Python list, {h['spans']} spans of "
        f"{h['chunk_tokens']} (median of {h['calls']}): as_token_array "
        f"{_ms3(med(h['as_token_array_s']))} ms + split_spans/chain_hashes "
        f"{_ms3(med(h['chain_hashes_s']))} ms; per-call total {_ms3(med(h['total_s']))}"
        f" ms (min {_ms3(min(h['total_s']))}, max {_ms3(max(h['total_s']))})"
    )


def print_save(s: Dict) -> None:
    from kvstore.bench.calls import save_ratio

    r, f = s["save_return_s"], s["flush_s"]
    print(
        f"\nsave() of a new {s['tokens']}-token prompt ({s['kv_bytes'] / MB:.1f} MB of "
        f"{s['dtype']} KV, {s['nodes_per_save'][0]} nodes; default RAM tier; a new prompt "
        f"each repeat):\n  save() returned in {_ms3(med(r))} ms {_samples_ms(r)}; "
        f"flush() then waited {_ms3(med(f))} ms {_samples_ms(f)};\n  return / (return"
        f" + flush) = {save_ratio(s):.4f}; written at {gbps(s['kv_bytes'], med(r) + med(f)):.2f}"
        " GB/s incl. fsync"
    )


def print_open(res: Dict) -> None:
    print(
        f"\nOpening a store, KVStore(path, model, tokenizer), in fresh child processes "
        f"(model {res['model']},\nits load not timed), cases alternating; median ms "
        f"and every sample"
    )
    for case in res["cases"].values():
        xs = _wall(case)
        print(f"  {case['label']:<30} {_ms(_m(xs), 8)}  {_samples_ms(xs)}")
    known, new = (_m(_wall(res["cases"][k])) for k in ("known", "new"))
    print(f"  new / known: {new / known:.1f}x")
    if res.get("split_ms"):
        print(f"  split of a known open (this process, ms): {res['split_ms']}")
    for case in res.get("big") or []:
        print(
            f"  {case['weights_bytes'] / 1e9:.2f} GB of weights "
            f"({'all hashed' if case['all_hashed'] else 'samples of each tensor hashed'})"
            f": weights digest {_samples_ms(case['weights_digest_s'])} ms, known open "
            f"{_samples_ms(case['known_open_s'])} ms, new open "
            f"{case['new_open_s'] * 1e3:.0f} ms"
        )


def print_durable(d: Dict) -> None:
    from kvstore.bench.durable import speed_ratio

    b = d["files_bytes"]
    print(
        f"\nSaving until durable, {d['tokens']} tokens of {d['dtype']} KV "
        f"({b / MB:.1f} MB in {d['files']} files, chunk_tokens={d['chunk_tokens']}, "
        f"ram_bytes={d['ram_bytes']}), cases rotated, os.sync() before each:"
    )
    rows = [
        ("kvstore save + flush", d["kvstore_s"]),
        ("the same bytes, one file, one fsync", d["one_file_s"]),
    ]
    if d["per_node_files_s"]:
        rows.append(
            (f"the same bytes, {d['files']} files, each fsynced", d["per_node_files_s"])
        )
    for label, xs in rows:
        t = _m(xs)
        print(
            f"  {label:<44} {_ms(t, 8)} ms {gbps(b, t):>6.2f} GB/s  {_samples_ms(xs)}"
        )
    ratio, per = speed_ratio(d)
    print(
        f"  save() returned in {_ms(_m(d['save_returned_s']), 0)} ms (median); "
        f"kvstore / one file speed {ratio:.2f}x (per repeat "
        f"{[round(x, 2) for x in per]})"
    )


def restart_targets(res: Dict) -> List[Dict]:
    out: List[Dict] = []
    add = _adder(out)

    for key, what, target in (
        ("fresh", "after a restart", 1.0),
        ("repeat", "repeated restores", 1.2),
    ):
        for r in res.get(key) or []:
            c, n = r["cases"], f"{r['dtype']} {r['tokens']} tokens"
            who = _like_for_like(c) if key == "fresh" else "kvstore"
            ratio = _speed(c, "load_prompt_cache", who)
            kv = "kvstore (restore_room=0)" if who != "kvstore" else "kvstore"
            add(
                f"{what}, {kv} speed / load_prompt_cache, {n}",
                f"{ratio:.2f} ({_ms(_m(_wall(c[who])), 0)} / "
                f"{_ms(_m(_wall(c['load_prompt_cache'])), 0)} ms; the floor "
                f"{_speed(c, 'load_prompt_cache', 'floor'):.2f})",
                f">= {target}",
                ratio >= target,
                ratio < target and _floor_bound(c, target),
            )
            add(
                f"{what}, {kv} speed / {c['floor']['label']}, {n}",
                f"{_speed(c, 'floor', who):.2f}",
                "info",
                None,
            )
            trade = _room_trade(c)
            if trade is not None:
                add(
                    f"{what}, {c['kvstore']['label']} speed / load_prompt_cache, {n}",
                    f"{_speed(c, 'load_prompt_cache'):.2f}; the room costs the fetch "
                    f"{trade[0]:+.1f} ms and saves the first forward pass "
                    f"{trade[1]:.1f} ms",
                    "info",
                    None,
                )
    for r in res.get("recycled") or []:
        c, n = r["cases"], f"{r['dtype']} {r['tokens']} tokens"
        add(
            f"memory recycled, kvstore speed / load_prompt_cache; / floor, {n}",
            f"{_speed(c, 'load_prompt_cache'):.2f}; {_speed(c, 'floor'):.2f}",
            "info",
            None,
        )
    o = res.get("open")
    if o:
        from kvstore.bench.opening import TARGET_S

        known = _m(_wall(o["cases"]["known"]))
        add(
            "open a store, model seen before (model load excluded)",
            f"{known * 1e3:.1f} ms",
            f"<= {TARGET_S * 1e3:.0f} ms",
            known <= TARGET_S,
        )
        add(
            "open a store, model never seen",
            f"{_m(_wall(o['cases']['new'])) * 1e3:.1f} ms",
            "info",
            None,
        )
    d = res.get("durable")
    if d:
        from kvstore.bench.durable import TARGET, speed_ratio

        ratio = speed_ratio(d)[0]
        add(
            f"save until durable GB/s / one file with one fsync, {d['tokens']} tokens "
            f"of {d['dtype']}",
            f"{ratio:.2f}",
            f">= {TARGET}",
            ratio >= TARGET,
        )
    out += call_targets(res)
    return out


def call_targets(res: Dict) -> List[Dict]:
    """The miss, hash and save sections' targets."""
    from kvstore.bench.calls import (
        TARGET_HASH_S,
        TARGET_MISS_S,
        TARGET_SAVE_RATIO,
        save_ratio,
    )

    out: List[Dict] = []
    add = _adder(out)

    for key, samples, what, limit in (
        ("miss", "fetch_s", "fetch that finds nothing", TARGET_MISS_S),
        ("hash", "total_s", "hash chain", TARGET_HASH_S),
    ):
        r = res.get(key)
        if r:
            t = med(r[samples])
            add(
                f"{what}, {r['tokens']} tokens",
                f"{t * 1e3:.3f} ms",
                f"< {limit * 1e3:.0f} ms",
                t < limit,
            )
    s = res.get("save")
    if s:
        ratio = save_ratio(s)
        add(
            f"save() return / (return + flush), {s['tokens']} tokens",
            f"{ratio:.4f}",
            f"< {TARGET_SAVE_RATIO}",
            ratio < TARGET_SAVE_RATIO,
        )
    return out


# -- compact markdown tables of a saved run (docs) ---------------------------------------


def markdown(res: Dict) -> str:
    """The restart-relevant sections of a run as small markdown tables: the fresh
    and repeated restores (medians, ratios), open time and save until durable."""
    from kvstore.bench.durable import TARGET, speed_ratio
    from kvstore.bench.opening import TARGET_S

    out = []
    for key, title, target in (
        ("fresh", "After a restart (first restore in a fresh process)", 1.0),
        ("repeat", "Repeated restores in one process", 1.2),
        ("recycled", "Repeated restores, freed memory recycled", None),
    ):
        rows = res.get(key) or []
        if not rows:
            continue
        rooms = key == "fresh" and any("kvstore_room0" in r["cases"] for r in rows)
        out += [
            f"{title}: medians of {len(_wall(rows[0]['cases']['kvstore']))} samples; "
            "speed ratio = load_prompt_cache ms / kvstore ms "
            + (f"(target >= {target}); " if target else "(info); ")
            + "floor ratio = kvstore's speed / the floor's (the same bytes, "
            f"{rows[0]['cases']['floor']['label'].split(': ', 1)[-1]})"
            + ("; MISS, floor = the floor misses the target too" if target else "")
            + (
                ". kvstore ms: `restore_room=0` where the KV is large enough for "
                "room (like for like: load_prompt_cache's caches are exactly full); "
                "with the default room beside it, and what the room costs the "
                "fetch and saves the first forward pass over one more token."
                if rooms
                else "."
            ),
            "",
            "| dtype | tokens | KV MB | kvstore ms | load_prompt_cache ms | floor ms "
            "| speed ratio | floor ratio | lpc floor ratio | target |"
            + (
                " room 2048: ms, ratio | room: fetch / first forward ms |"
                if rooms
                else ""
            ),
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"
            + ("---:|---:|" if rooms else ""),
        ]
        for r in rows:
            c = r["cases"]
            who = _like_for_like(c) if rooms else "kvstore"
            ratio = _speed(c, "load_prompt_cache", who)
            line = (
                f"| {r['dtype']} | {r['tokens']} | {r['kv_bytes'] / MB:.1f} "
                f"| {_m(_wall(c[who])) * 1e3:.1f} "
                f"| {_m(_wall(c['load_prompt_cache'])) * 1e3:.1f} "
                f"| {_m(_wall(c['floor'])) * 1e3:.1f} | {ratio:.2f} "
                f"| {_speed(c, 'floor', who):.2f} "
                f"| {_speed(c, 'floor', 'load_prompt_cache'):.2f} "
                f"| {_status(ratio >= target, _floor_bound(c, target)) if target else 'info'} |"
            )
            if rooms:
                trade = _room_trade(c)
                line += (
                    f" {_m(_wall(c['kvstore'])) * 1e3:.1f}, "
                    f"{_speed(c, 'load_prompt_cache'):.2f} "
                    + (
                        f"| {trade[0]:+.1f} / {-trade[1]:+.1f} |"
                        if trade
                        else "| (no room) |"
                    )
                )
            out.append(line)
        out.append("")
    o = res.get("open")
    if o:
        known, new = (_m(_wall(o["cases"][k])) for k in ("known", "new"))
        out += [
            "| open a store (fresh process, model load not timed) | median ms "
            "| samples ms | target |",
            "|---|---:|---|---|",
            f"| model seen before | {known * 1e3:.1f} "
            f"| {_samples_ms(_wall(o['cases']['known']))} "
            f"| {_status(known <= TARGET_S)} (<= {TARGET_S * 1e3:.0f} ms) |",
            f"| model never seen | {new * 1e3:.1f} "
            f"| {_samples_ms(_wall(o['cases']['new']))} | info |",
            "",
        ]
    d = res.get("durable")
    if d:
        ratio = speed_ratio(d)[0]
        b = d["files_bytes"]
        out += [
            f"| save until durable, {d['tokens']} tokens of {d['dtype']} "
            f"({b / MB:.0f} MB, {d['files']} files) | median ms | GB/s | samples ms |",
            "|---|---:|---:|---|",
        ]
        for label, xs in (
            ("kvstore save + flush", d["kvstore_s"]),
            ("one file, one fsync", d["one_file_s"]),
            (f"{d['files']} files, each fsynced", d["per_node_files_s"]),
        ):
            if xs:
                out.append(
                    f"| {label} | {_m(xs) * 1e3:.0f} | {gbps(b, _m(xs)):.2f} "
                    f"| {_samples_ms(xs)} |"
                )
        out += [
            "",
            f"kvstore / one file: {ratio:.2f}x, target >= {TARGET}: "
            f"{_status(ratio >= TARGET)}",
            "",
        ]
    out += _markdown_calls(res)
    return "\n".join(out)


def _markdown_calls(res: Dict) -> List[str]:
    """The miss, hash and save sections as one table: medians and every target."""
    rows = []
    m, h, s = res.get("miss"), res.get("hash"), res.get("save")
    if m:
        rows.append((f"fetch that finds nothing, {m['tokens']} tokens", m["fetch_s"]))
    if h:
        rows.append((f"hash chain, {h['tokens']} tokens", h["total_s"]))
    if s:
        rows.append((f"save() return, {s['tokens']} tokens", s["save_return_s"]))
        rows.append((f"flush() after it, {s['tokens']} tokens", s["flush_s"]))
    if not rows:
        return []
    out = [
        "| call | median ms | min ms | max ms | samples |",
        "|---|---:|---:|---:|---:|",
    ]
    for what, xs in rows:
        out.append(
            f"| {what} | {med(xs) * 1e3:.3f} | {min(xs) * 1e3:.3f} "
            f"| {max(xs) * 1e3:.3f} | {len(xs)} |"
        )
    out.append("")
    for t in call_targets(res):
        out.append(
            f"{t['what']}: {t['value']}, target {t['target']}: "
            f"{_status(t['ok'], t.get('floor_bound', False))}"
        )
        out.append("")
    return out
