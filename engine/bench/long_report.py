"""The `bench long` result rendered: its Markdown report and its PNG plot of decode ms/token and peak RSS
against the context length. The plot needs matplotlib, an optional extra (``pip install 'specache[plot]'``):
without it `long_plot` returns None and the report says the picture was not drawn."""
from __future__ import annotations

import io

from engine.bench.common import fmt, md_header, md_table, md_targets

PLOT_NAME = "long.png"
PLOT_MISSING = "no plot: matplotlib is not installed (pip install 'specache[plot]')"
COLUMNS = ("mode", "context", "prefill tok/s", "decode ms/token", "decode x full", "peak RSS MiB",
           "RSS above model MiB", "top-1 vs full", "mean KL", "pass-keys found", "found where full found")


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def passkey_cell(p: dict) -> str:
    """'2/3 (0.1 yes, 0.5 yes, 0.9 no)', or '-' for a point without pass-keys (llama.cpp)."""
    keys = p.get("passkeys")
    if not keys:
        return "-"
    each = ", ".join(f"{k['depth']:g} {'yes' if k['found'] else 'no'}" for k in keys)
    return f"{sum(k['found'] for k in keys)}/{len(keys)} ({each})"


def table_rows(r: dict) -> list[list[str]]:
    """One row per point, as the CLI's table and the Markdown report show it."""
    full = next((m["label"] for m in r["modes"] if m["mode"] == "full"), None)
    ms_full = {p["length"]: p.get("decode_ms_per_token") for p in r["points"] if p["mode"] == full}
    rows = []
    for p in sorted(r["points"], key=lambda p: p["length"]):
        if p.get("error"):
            rows.append([p["mode"], str(p["length"]), f"failed: {p['error']}"] + ["-"] * (len(COLUMNS) - 3))
            continue
        ref, ms = ms_full.get(p["length"]), p.get("decode_ms_per_token")
        rows.append([p["mode"], str(p["length"]), fmt(p["prefill_tokens_per_s"], 0), fmt(ms, 1),
                     fmt(ref / ms if ref and ms else None, 2), _mib(p["peak_rss_bytes"]),
                     _mib(p.get("peak_above_model_bytes")), fmt(p.get("top1_agreement")), fmt(p.get("mean_kl"), 4),
                     passkey_cell(p), fmt(p.get("found_where_full_found"), 2)])
    return rows


def long_markdown(r: dict, png_name: str | None = None) -> str:
    s = r["settings"]
    out = [md_header("Long contexts", r),
           f"Documents: {', '.join(s['documents'])} ({s['corpus_tokens']} tokens, repeated to reach a length). "
           f"Per length: the summary prompt over the text's first tokens, prefilled and decoded {s['decode_tokens']} "
           "tokens (the full cache greedily, the other modes teacher-forced on its tokens: top-1 and KL against "
           f"it); then a pass-key prompt of the same length per depth ({', '.join(f'{d:g}' for d in s['depths'])}), "
           f"{s['passkey_tokens']} answer tokens. Each point ran in a child process of its own: its peak RSS "
           "(ru_maxrss after the timed run: model, warm-up, prefill and decode) is its own.\n"]
    if s["skipped"]:
        out.append("Skipped: " + "; ".join(f"{x['length']} tokens ({x['reason']})" for x in s["skipped"]) + ".\n")
    llama = s["llama_cpp"]
    out.append(f"llama.cpp: {'ran (node-llama-cpp, f16 K/V, the raw text without chat template)' if llama['ran'] else llama['note']}.\n")
    out.append(f"![decode ms/token and peak RSS against context]({png_name})\n" if png_name else f"({PLOT_MISSING})\n")
    out.append("## Results\n")
    out.append(md_table(COLUMNS, table_rows(r)) + "\n")
    out.append("Load average (1 min) at each point's start / end: " + "; ".join(
        f"{p['mode']} {p['length']}: {p['load_average']['start'][0]:.2f} / {p['load_average']['end'][0]:.2f}"
        for p in r["points"] if (p.get("load_average") or {}).get("start") and p["load_average"].get("end"))
        + ". Other work on the machine slows every timing it overlaps.\n")
    out.append("## Targets\n")
    out.append(md_targets(r["targets"]) + "\n")
    return "\n".join(out)


def series(r: dict, key: str) -> dict[str, tuple[list[int], list[float]]]:
    """Per mode: the lengths and the values of `key` at them (points without the value left out)."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for p in sorted(r["points"], key=lambda p: p["length"]):
        if p.get(key) is not None:
            xs, ys = out.setdefault(p["mode"], ([], []))
            xs.append(p["length"])
            ys.append(p[key])
    return out


def long_plot(r: dict) -> bytes | None:
    """Decode ms/token and peak RSS (MiB) against context tokens, a line per mode; None without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(10, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    for ax, key, scale, label in ((left, "decode_ms_per_token", 1.0, "decode ms/token"),
                                  (right, "peak_rss_bytes", 2.0 ** -20, "peak RSS (MiB)")):
        for mode, (xs, ys) in series(r, key).items():
            ax.plot(xs, [y * scale for y in ys], marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xticks(r["settings"]["lengths"], [str(n) for n in r["settings"]["lengths"]])
        ax.set_xlabel("context tokens")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    model = r["environment"].get("model", {}).get("name", "?")
    fig.suptitle(f"{model}; {r['environment'].get('cpu', '?')}; torch threads {r['environment']['torch_threads']}")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()
