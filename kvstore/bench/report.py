"""The bench's output: targets with PASS/MISS, the tables, and the PNG chart."""

from typing import Dict, List, Optional

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


def targets(res: Dict) -> List[Dict]:
    out = []

    def add(what, value, target, ok):
        out.append({"what": what, "value": value, "target": target, "ok": ok})

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
        status = "info" if t["ok"] is None else "PASS" if t["ok"] else "MISS"
        print(f"  [{status}] {t['what']}: {t['value']} (target {t['target']})")


def print_report(res: Dict) -> None:
    if res.get("ttft"):
        print_ttft(res["ttft"])
    if res.get("write"):
        print_write(res["write"])
    if res.get("restore"):
        print_restore(res["restore"])
        print_disk(res["restore"])
    if res.get("scale"):
        print_scale(res["scale"])
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
