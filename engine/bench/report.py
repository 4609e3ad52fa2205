"""Markdown reports of the bench results (the JSON is the source; these only render it)."""
from __future__ import annotations

from engine.bench.common import fmt, md_header, md_table, md_targets


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def needle_markdown(r: dict, png_name: str | None = None) -> str:
    s = r["settings"]
    lengths, depths = s["lengths"], s["depths"]
    out = [md_header("Needle (pass key) retrieval", r),
           f"Documents: {', '.join(s['documents'])} ({s['corpus_tokens']} tokens). "
           f"{s['needles_per_cell']} needle(s) per cell, greedy, {s['max_tokens']} answer tokens. "
           f"Needle: \"{s['needle']}\". Question: \"{s['question']}\"\n"]
    if png_name:
        out.append(f"![accuracy heatmap]({png_name})\n")
    out.append("## Accuracy per mode\n")
    headers = ["mode", "overall"] + [f"{n} tok" for n in lengths] + ["found where full found", "same output as full",
                                                                   f"device MiB/row @{lengths[-1]}"]
    rows = []
    for m in r["modes"]:
        e = r["per_mode"][m["label"]]
        rows.append([m["label"], fmt(e["accuracy"], 2)] + [fmt(e["by_length"][str(n)], 2) for n in lengths]
                    + [fmt(e.get("succeeds_where_full_does"), 2), fmt(e.get("same_output_as_full"), 2),
                       _mib(e["device_bytes_per_row"][str(lengths[-1])])])
    out.append(md_table(headers, rows) + "\n")
    out.append("## Accuracy grid (rows: depth, columns: context tokens)\n")
    for m in r["modes"]:
        grid = r["accuracy"][m["label"]]
        out.append(f"**{m['label']}**\n")
        out.append(md_table(["depth"] + [str(n) for n in lengths],
                            [[f"{d:g}"] + [fmt(grid[str(n)][f"{d:g}"], 2) for n in lengths] for d in depths]) + "\n")
    out.append("## Targets\n")
    out.append(md_targets(r["targets"]) + "\n")
    return "\n".join(out)


def fidelity_markdown(r: dict) -> str:
    s = r["settings"]
    docs = "; ".join(f"{d['source']} ({d['prompt_tokens']} prompt tokens{', truncated' if d['truncated'] else ''})"
                     for d in s["documents"])
    out = [md_header("Fidelity against the full cache", r),
           f"Documents: {docs}. Up to {s['forced_tokens']} tokens of the full cache's greedy summary, "
           "teacher-forced through each mode's real step loop (two-token speculative steps or one-token steps, as the "
           "mode's prefetch says).\n",
           "## Agreement\n"]
    rows = []
    for m in r["modes"]:
        e = r["per_mode"][m["label"]]
        rows.append([m["label"], fmt(e["top1_agreement"]), fmt(e["mean_kl"], 4), fmt(e["identical_prefix"], 1),
                     fmt(e["equal_share"]), _mib(e["device_bytes"]), fmt(e["device_fraction_of_fp16"]),
                     fmt(e.get("prefetch_reuse"))])
    out.append(md_table(["mode", "teacher-forced top-1", "mean KL", "free-run identical prefix (tokens)",
                         "free-run equal tokens", "device MiB", "device / fp16 full", "prefetch reuse"], rows) + "\n")
    if any(r["per_mode"][m["label"]].get("prefetch_reuse") is not None for m in r["modes"]):
        out.append("Prefetch reuse (speculative with correction, the default): the share of each step's exact set, "
                   "chosen by the output token's own guide ranking, that the previous step's speculative prefetch had "
                   "already fetched; the rest is fetched when the step needs it.\n")
    sel_modes = [m for m in r["modes"] if r["per_mode"][m["label"]].get("selection")]
    if sel_modes:
        out.append("## Selection quality (recall / attention-mass coverage of the guide region)\n")
        out.append("Coverage is the next output token's exact attention mass on the chosen k positions divided by "
                   "its mass on the whole guide region (sinks and residual window excluded); recall is the share "
                   "of the exact top-k that was chosen. Attention in small models is diffuse: recall can be low "
                   "while coverage is high. Speculation hits: share of steps whose speculative token was the "
                   "next output token; region mass: share of the next token's attention on the guide region.\n")
        names = ["oracle", "fetched", "guide_own", "guide_spec", "exact_spec", "guide_output", "exact_output"]
        rows = []
        for m in sel_modes:
            e = r["per_mode"][m["label"]]
            sel = e["selection"]
            rows.append([m["label"], fmt(e.get("speculation_hit_rate")), fmt(e.get("region_mass"))] +
                        [f"{fmt(sel[n]['recall'])} / {fmt(sel[n]['coverage'])}" for n in names] +
                        [fmt(sel["fetched"]["coverage_vs_oracle"])])
        out.append(md_table(["mode", "speculation hits", "region mass"] + names + ["fetched coverage / oracle"], rows) + "\n")
        out.append("\n".join(f"- `{k}`: {v}" for k, v in s["selectors"].items()) + "\n")
        if all("coverage_total" in r["per_mode"][m["label"]]["selection"]["oracle"] for m in sel_modes):
            out.append("Share of all the next token's attention served exactly (sinks + residual window + chosen "
                       "set), the measure some write-ups call coverage:\n")
            rows = [[m["label"]] + [fmt(r["per_mode"][m["label"]]["selection"][n]["coverage_total"]) for n in names]
                    for m in sel_modes]
            out.append(md_table(["mode"] + names, rows) + "\n")
    out.append("## Targets\n")
    out.append(md_targets(r["targets"]) + "\n")
    out.append("## Texts (free-running)\n")
    for row in r["rows"]:
        text = row["text"].replace("\n", " ")
        out.append(f"- **{row['mode']}** ({row['document']}): {text[:400]}")
    ref = next((row["reference_text"] for row in r["rows"]), "")
    out.append(f"\nReference (full cache): {ref.replace(chr(10), ' ')[:400]}\n")
    return "\n".join(out)


def _load(m: dict) -> str:
    la = m.get("load_average") or {}
    if not la.get("start") or not la.get("end"):
        return "-"
    return f"{la['start'][0]:.2f} / {la['end'][0]:.2f}"


def speed_markdown(r: dict) -> str:
    s = r["settings"]
    out = [md_header("Speed", r),
           f"Documents: {', '.join(s['documents'])}; {s['prompts']}. Decode: {s['warmup_steps']} warm-up steps, then "
           f"median over {s['repeats']} segments of {s['decode_tokens']} greedy steps. "
           f"{'Each mode ran in its own child process (peak RSS is that process).' if s['isolated'] else 'All modes ran in one process (no per-mode RSS).'}\n",
           "## Results\n"]
    rows = []
    for c in r["comparison"]:
        rows.append([c["mode"], c["length"], c["batch"], fmt(c["prefill_tokens_per_s"], 0),
                     fmt(c["decode_ms_per_token"], 1), fmt(c["decode_tokens_per_s"], 1),
                     fmt(c["decode_speedup_vs_full"], 2), fmt(c["decode_speedup_vs_hf"], 2),
                     fmt(c["prefill_vs_full"], 2), _mib(c["device_bytes"]), _mib(c["peak_rss_bytes"])])
    out.append(md_table(["mode", "context", "batch", "prefill tok/s", "decode ms/token", "decode tok/s (all rows)",
                         "decode x full", "decode x hf", "prefill x full", "KV device MiB", "peak RSS MiB"], rows) + "\n")
    out.append("## Peak RSS per mode\n")
    out.append(md_table(["mode", "after model load + warm-up MiB", "peak MiB", "peak above model MiB",
                         "torch threads", "load average at start / end (1 min)"],
                        [[m["label"], _mib(m["rss"]["model_bytes"]), _mib(m["rss"]["peak_bytes"]),
                          _mib(m["rss"]["peak_above_model_bytes"]), m.get("torch_threads", "-"), _load(m)]
                         for m in r["per_mode"]]) + "\n")
    out.append("Other work on the machine (load average above the cores in use) slows every number it overlaps.\n")
    out.append("## Targets\n")
    out.append(md_targets(r["targets"]) + "\n")
    return "\n".join(out)


def decode_markdown(r: dict) -> str:
    s = r["settings"]
    out = [md_header("Decode, modes side by side", r),
           f"Documents: {', '.join(s['documents'])}; context {s['length']} tokens. Each mode prefilled its own cache, "
           f"then the modes took turns: {s['burst']} greedy steps each, {s['repeats']} rounds; median ms per step "
           "(a step gives every row one output token; exact mode's step is one cycle of drafts and a verification, "
           "its time divided by the tokens it gave each row). hf = stock transformers (DynamicCache, SDPA, "
           "nn.Linear), one forward per token as `generate` does it.\n", "## Results\n"]
    rows = [[x["mode"], x["batch"], fmt(x["ms_per_step"], 1), fmt(x["tokens_per_s"], 1), fmt(x["speedup_vs_full"], 2),
             fmt(x["speedup_vs_hf"], 2), " ".join(fmt(v, 1) for v in x["ms_per_step_all"])] for x in r["rows"]]
    out.append(md_table(["mode", "batch", "ms/step (median)", "tokens/s (all rows)", "x full", "x hf",
                         "every round's ms/step"], rows) + "\n")
    exact = [x for x in r["rows"] if "exact" in x]
    if exact:
        out.append("Exact mode (acceptance = accepted drafts / drafted; tokens per verification per row; mean "
                   "gamma; mean ms of a draft pass and of a verification):\n")
        out.append(md_table(["mode", "batch", "acceptance", "tokens/verify", "gamma", "draft ms", "verify ms"],
                            [[x["mode"], x["batch"], fmt(x["exact"].get("acceptance_rate"), 3),
                              fmt(x["exact"].get("tokens_per_verify"), 2), fmt(x["exact"].get("gamma_mean"), 2),
                              fmt(x["exact"].get("draft_pass_ms"), 1), fmt(x["exact"].get("verify_ms"), 1)]
                             for x in exact]) + "\n")
    out.append("## Targets\n")
    out.append(md_targets(r["targets"]) + "\n")
    return "\n".join(out)
