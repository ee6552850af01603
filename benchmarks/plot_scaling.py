"""Tables and plots from the scaling JSONs that ``bench_scaling.py`` writes (one per GPU count).

    python benchmarks/plot_scaling.py benchmarks/results/scaling_h200_x*.json \\
        --png benchmarks/results/scaling_h200.png --md benchmarks/results/scaling_h200.md

Prints (and with ``--md`` writes) a markdown table per tokens-per-GPU value: rows are
implementation / strategy / configuration / causal, columns are GPU counts, cells are
"ms (efficiency)"; the same rows with "peak GiB (peak / own)" where the runs measured memory
(own: the rank's q, k, v, out, dout, dq, dk, dv); then the max-length probe per GPU count, and
where ``--profile`` ran, the GPU time of a step split into compute, communication and the
communication no compute hides. The PNG has four panels:
efficiency vs GPUs (LongNet; full attention), tokens/s vs GPUs, peak memory vs tokens
per GPU (the probe). Needs matplotlib only for ``--png``.
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from collections import defaultdict


def load(paths: list[str]) -> tuple[list[dict], list[dict]]:
    """(records of every file, metas). A record written before ``own_gib`` existed gets it from its meta."""
    metas, records = [], []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        meta = data["meta"]
        metas.append(meta)
        for r in data["records"]:
            if "own_gib" not in r and all(meta.get(k) for k in ("batch", "heads", "head_dim", "dtype_bytes")):
                r["own_gib"] = own_gib(meta, r["tokens_per_gpu"])
        records += data["records"]
    return records, metas


def load_profile(paths: list[str]) -> list[dict]:
    """The ``profile`` entries (``bench_scaling.py --profile``) of every file."""
    out = []
    for path in paths:
        with open(path) as f:
            out += json.load(f).get("profile") or []
    return out


def own_gib(meta: dict, rows: int) -> float:
    """GiB of one rank's q, k, v, out, dout, dq, dk, dv at ``rows`` tokens, from a scaling JSON's meta."""
    from bench_scaling import own_bytes

    return own_bytes(meta["batch"], rows, meta["heads"], meta.get("kv_heads") or meta["heads"], meta["head_dim"],
                     meta["dtype_bytes"]) / 2**30


def memory_cell(r: dict | None) -> str:
    """"peak GiB (peak / own x)" of a record; "-" where it has no peak."""
    if r is None or r.get("peak_gib") is None:
        return "-"
    own = r.get("own_gib")
    return f"{r['peak_gib']:.2f} ({r['peak_gib'] / own:.1f}x)" if own else f"{r['peak_gib']:.2f}"


def profile_table(entries: list[dict]) -> list[str]:
    """Markdown lines: one row per profiled case (``bench_scaling.py --profile``), slowest rank."""
    if not entries:
        return []
    lines = ["**Where communication is exposed** (`--profile`: GPU time of one forward+backward step on the "
             "slowest rank, mean over the profiled steps; timed = the same case's timed median, without the "
             "profiler; comm = NCCL kernels, exposed = NCCL running while no compute kernel runs, idle = nothing "
             "running; step = compute + exposed + idle)", "",
             "| K | case | step ms | timed ms | compute ms | comm ms | exposed comm ms | exposed % "
             "| exposed fwd / bwd ms | idle ms | NCCL kernels / step |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    order = sorted(entries, key=lambda e: (e["gpus"], e["tokens_per_gpu"], e["config"], e["causal"], e["strategy"],
                                           e["layout"]))
    for e in order:
        lay = "" if e["layout"] == "contiguous" else f"/{e['layout']}"
        case = f"{e['strategy']}{lay} {e['config']} {'causal' if e['causal'] else 'non-causal'}, " \
               f"{e['tokens_per_gpu']}/GPU"
        phases = f"{e['forward']['exposed_comm_ms']:.2f} / {e['backward']['exposed_comm_ms']:.2f}" \
            if e.get("forward") and e.get("backward") else "-"
        timed = f"{e['timed_ms']:.2f}" if e.get("timed_ms") is not None else "-"
        lines.append(f"| {e['gpus']} | {case} | {e['step_ms']:.2f} | {timed} | {e['compute_ms']:.2f} | "
                     f"{e['comm_ms']:.2f} | {e['exposed_comm_ms']:.2f} | {100 * e['exposed_comm_frac']:.1f}% | "
                     f"{phases} | {e['idle_ms']:.2f} | {e['nccl_kernels']:.0f} |")
    lines.append("")
    return lines


TIE = 0.03  # strategies within 3% of each other tie
LEANER = 0.10  # a tie goes to the strategy whose peak memory is lower by more than 10%, else to the ring
MODES = {"ours": "eager", "ours+graph": "replayed"}


def auto_choices(records: list[dict], gpus: int = 2, tokens: int = 32768) -> dict[tuple[bool, bool, str], str]:
    """``strategy="auto"``'s table (``dilated_attention/auto_strategy.py``) from one run's library records at ``gpus``
    and ``tokens`` per GPU: ``{(dense, causal, layout): "ring" | "head"}``, ``dense`` meaning full attention.

    Rule: each strategy's worse ratio to the fastest strategy over the modes the run timed (eager; replayed in a
    CUDA graph with ``--cuda-graph``), so that the choice holds whether or not a step is captured and however fast
    the host issues it; the smallest wins. Strategies within ``TIE`` of the winner tie: a tie goes to the one whose
    peak memory (the worse over the modes) is more than ``LEANER`` below the ring's, else to the ring (the simpler
    strategy)."""
    ms: dict[tuple, dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    peak: dict[tuple, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r in records:
        if r["impl"] in MODES and r["gpus"] == gpus and r["tokens_per_gpu"] == tokens and "max_tokens" not in r:
            key = (r["config"] == "full", r["causal"], r.get("layout", "contiguous"))
            ms[key][r["strategy"]][MODES[r["impl"]]] = r["ms"]
            if r.get("peak_gib") is not None:
                peak[key][r["strategy"]] = max(peak[key][r["strategy"]], r["peak_gib"])
    choices = {}
    for key, by in ms.items():
        if set(by) != {"ring", "head"}:
            continue
        modes = set(by["ring"]) & set(by["head"])
        worst = {s: max(by[s][m] / min(by[t][m] for t in by) for m in modes) for s in by}
        best = min(worst, key=worst.get)
        tied = [s for s in by if worst[s] <= worst[best] * (1 + TIE)]
        choices[key] = best
        if "ring" in tied:
            peaks = peak[key]
            leaner = [s for s in tied if s != "ring" and 0 < peaks[s] < peaks["ring"] * (1 - LEANER)]
            choices[key] = min(leaner, key=peaks.get) if leaner else "ring"
    return choices


def choices_table(records: list[dict]) -> list[str]:
    """Markdown lines: ``auto_choices`` per GPU count of the run, with the times it read."""
    lines = []
    for gpus in sorted({r["gpus"] for r in records if r["gpus"] > 1}):
        choices = auto_choices(records, gpus)
        if not choices:
            continue
        lines += [f"**`strategy=\"auto\"` on this run, K={gpus}** (`auto_choices`: each strategy's worse ratio "
                  f"to the fastest, eager and replayed; within {TIE:.0%}: the ring unless the other's peak memory is "
                  f"more than {LEANER:.0%} lower)", "",
                  "| pattern | causal | layout | choice |", "| --- | :---: | --- | --- |"]
        for (dense, causal, layout), choice in sorted(choices.items()):
            lines.append(f"| {'full' if dense else 'longnet'} | {'yes' if causal else 'no'} | {layout} | {choice} |")
        lines.append("")
    return lines


def _series_key(r: dict) -> tuple:
    """A zigzag-layout ring is its own series ("ring/zigzag"); contiguous shards keep the plain name."""
    layout = r.get("layout", "contiguous")
    return (r["impl"], r["strategy"] + ("" if layout == "contiguous" else f"/{layout}"), r["config"], r["causal"])


def timed(records: list[dict], tokens: int) -> dict[tuple, dict[int, dict]]:
    """{(impl, strategy, config, causal): {gpus: record}} of timed records at ``tokens`` per GPU.

    One GPU's record (strategy "single") starts every multi-GPU series of the same impl.
    """
    out: dict[tuple, dict[int, dict]] = defaultdict(dict)
    singles = {}
    for r in records:
        if "max_tokens" in r or r["tokens_per_gpu"] != tokens:
            continue
        if r["gpus"] == 1:
            singles[(r["impl"], r["config"], r["causal"])] = r
        else:
            out[_series_key(r)][r["gpus"]] = r
    for (impl, strategy, config, causal), by_k in out.items():
        base = singles.get((impl.replace("ulysses", "ours"), config, causal))  # ulysses runs our call
        if base is not None:
            by_k[1] = base
    for (impl, config, causal), r in singles.items():  # one-GPU-only runs still show up
        if not any(k[0] == impl and k[2] == config and k[3] == causal for k in out):
            out[(impl, "single", config, causal)][1] = r
    return dict(sorted(out.items(), key=lambda kv: (kv[0][2], kv[0][3], kv[0][0] != "ours", kv[0][0], kv[0][1])))


def runs_line(metas: list[dict]) -> str:
    """Where each column comes from: each file's date and command (a table may join files of different runs)."""
    by_command: dict[str, list[str]] = {}
    for m in sorted(metas, key=lambda m: m["gpus"]):
        by_command.setdefault(m.get("command", "?"), []).append(f"K={m['gpus']} {m.get('date', '?')[:16]}")
    return "Runs: " + "; ".join(f"{', '.join(when)}: `{command}`" for command, when in by_command.items())


def markdown(records: list[dict], metas: list[dict], profile: list[dict] | None = None) -> str:
    gpus = sorted({m["gpus"] for m in metas})
    tokens_list = sorted({r["tokens_per_gpu"] for r in records if "max_tokens" not in r})
    m0 = metas[0] if metas else {}
    lines = [f"{m0.get('gpu', '?')}, torch {m0.get('torch', '?')}, {m0.get('dtype', '?')}, B={m0.get('batch')} "
             f"H={m0.get('heads')} D={m0.get('head_dim')}, backend {m0.get('backend')}, kernel {m0.get('kernel')}; "
             "forward+backward ms (efficiency = T1 / (K x TK), T1 = one GPU on the whole sequence, same run)", "",
             runs_line(metas), ""]
    for tokens in tokens_list:
        lines += [f"**{tokens} tokens per GPU**", "",
                  "| impl | strategy | config | causal | " + " | ".join(f"K={k}" for k in gpus) + " |",
                  "| --- | --- | --- | :---: | " + " | ".join("---:" for _ in gpus) + " |"]
        for (impl, strategy, config, causal), by_k in timed(records, tokens).items():
            cells = []
            for k in gpus:
                r = by_k.get(k)
                if r is None:
                    cells.append("-")
                else:
                    eff = f" ({100 * r['efficiency']:.0f}%)" if r.get("efficiency") is not None and k > 1 else ""
                    cells.append(f"{r['ms']:.1f}{eff}")
            lines.append(f"| {impl} | {strategy} | {config} | {'yes' if causal else 'no'} | " + " | ".join(cells) + " |")
        lines.append("")
        series = timed(records, tokens)
        if any(r.get("peak_gib") is not None for by_k in series.values() for r in by_k.values()):
            lines += [f"**Peak memory per GPU, {tokens} tokens per GPU**: GiB (peak / own: the rank's q, k, v, out, "
                      "dout, dq, dk, dv in the input dtype)", "",
                      "| impl | strategy | config | causal | " + " | ".join(f"K={k}" for k in gpus) + " |",
                      "| --- | --- | --- | :---: | " + " | ".join("---:" for _ in gpus) + " |"]
            for (impl, strategy, config, causal), by_k in series.items():
                lines.append(f"| {impl} | {strategy} | {config} | {'yes' if causal else 'no'} | "
                             + " | ".join(memory_cell(by_k.get(k)) for k in gpus) + " |")
            lines.append("")
    probes = {}
    for m in metas:
        if "probe" in m:
            probes[m["gpus"]] = m["probe"]
    if probes:
        peak = {}
        for r in records:
            if "max_tokens" in r and r["gpus"] * r["tokens_per_gpu"] == r["max_tokens"]:
                peak[r["gpus"]] = r
        lines += ["**Longest LongNet sequence, forward+backward** (tokens per GPU doubled until OOM / cap / time)", "",
                  "| K | max tokens | per GPU | peak GiB | own GiB | peak / own | stopped by |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        for k in sorted(probes):
            r, p = peak.get(k), probes[k]
            gib = f"{r['peak_gib']:.1f}" if r and r.get("peak_gib") is not None else "-"
            own = f"{r['own_gib']:.2f}" if r and r.get("own_gib") else "-"
            ratio = f"{r['peak_gib'] / r['own_gib']:.1f}x" if gib != "-" and own != "-" else "-"
            per = f"{r['tokens_per_gpu']:,}" if r else "-"
            lines.append(f"| {k} | {p['max_tokens']:,} | {per} | {gib} | {own} | {ratio} | {p['stop']} |")
        lines.append("")
    lines += choices_table(records)
    lines += profile_table(profile or [])
    notes = sorted({m["profiling"]["note"] for m in metas if (m.get("profiling") or {}).get("note")})
    if notes:
        lines += ["Profile: " + "; ".join(notes), ""]
    skipped = [(m["gpus"], s) for m in metas for s in m.get("skipped", [])]
    if skipped:
        lines += ["Skipped: " + "; ".join(sorted({f"{s['impl']}/{s['strategy']} ({s['reason'][:80]})"
                                                  for _, s in skipped}))]
    return "\n".join(lines)


def plot(records: list[dict], metas: list[dict], png: str, tokens: int | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    tokens_list = sorted({r["tokens_per_gpu"] for r in records if "max_tokens" not in r})
    if tokens is None and tokens_list:
        tokens = 32768 if 32768 in tokens_list else tokens_list[-1]
    series = timed(records, tokens) if tokens else {}
    names = sorted({f"{i}/{s}" for i, s, _, _ in series})
    palette = plt.cm.tab10 if len(names) <= 10 else plt.cm.tab20  # one colour per series
    colors = {n: palette(i % palette.N) for i, n in enumerate(names)}
    styles = {False: "-", True: "--"}
    markers = {"longnet": "o", "full": "s"}
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    m0 = metas[0] if metas else {}
    fig.suptitle(f"{m0.get('gpu', '?')}: dilated_attention scaling, {tokens} tokens/GPU, {m0.get('dtype', '')}, "
                 f"H={m0.get('heads')} D={m0.get('head_dim')}", fontsize=12)
    gpus = sorted({m["gpus"] for m in metas})
    for ax, config in ((axes[0, 0], "longnet"), (axes[0, 1], "full")):
        for (impl, strategy, cfg, causal), by_k in series.items():
            if cfg != config:
                continue
            ks = sorted(k for k in by_k if by_k[k].get("efficiency") is not None)
            if not ks:
                continue
            ax.plot(ks, [100 * by_k[k]["efficiency"] for k in ks], styles[causal], marker=markers[cfg],
                    color=colors[f"{impl}/{strategy}"])
        ax.set(title=f"efficiency vs GPUs: {config}", xlabel="GPUs (K)", ylabel="T1 / (K x TK) [%]", xscale="log")
        ax.set_ylim(bottom=0, top=max(110, ax.get_ylim()[1]))
        ax.axhline(100, color="grey", lw=0.5)
    ax = axes[1, 0]
    for (impl, strategy, cfg, causal), by_k in series.items():
        ks = sorted(by_k)
        ax.plot(ks, [k * by_k[k]["tokens_per_gpu"] / (by_k[k]["ms"] / 1e3) for k in ks], styles[causal],
                marker=markers[cfg], color=colors[f"{impl}/{strategy}"])
    ax.set(title="throughput vs GPUs (whole sequence per fwd+bwd)", xlabel="GPUs (K)", ylabel="tokens / s",
           xscale="log", yscale="log")
    ax = axes[1, 1]
    by_k: dict[int, list[dict]] = defaultdict(list)
    for r in records:
        if r.get("peak_gib") is not None:
            by_k[r["gpus"]].append(r)
    for i, k in enumerate(sorted(by_k)):
        probe = sorted((r for r in by_k[k] if "max_tokens" in r), key=lambda r: r["tokens_per_gpu"])
        if probe:
            ax.plot([r["tokens_per_gpu"] for r in probe], [r["peak_gib"] for r in probe], "-o",
                    color=plt.cm.viridis(i / max(1, len(by_k) - 1)), label=f"K={k} LongNet probe")
    caps = {m.get("gpu_memory_gib") for m in metas if m.get("gpu_memory_gib")}
    for cap in caps:
        ax.axhline(cap, color="red", lw=0.8, ls=":", label=f"{cap:.0f} GiB per GPU")
    ax.set(title="peak memory vs tokens per GPU (LongNet, fwd+bwd)", xlabel="tokens per GPU", ylabel="peak GiB per GPU",
           xscale="log", yscale="log")
    if by_k:
        ax.legend(fontsize=8)
    for a in (axes[0, 0], axes[0, 1], axes[1, 0]):
        if gpus:
            a.set_xticks(gpus, [str(k) for k in gpus])
            a.minorticks_off()
    proxies = [Line2D([], [], color=colors[n], lw=2, label=n) for n in names]
    proxies += [Line2D([], [], color="k", ls=styles[c], label="causal" if c else "non-causal") for c in (False, True)]
    proxies += [Line2D([], [], color="k", marker=markers[c], ls="", label=c) for c in markers]
    axes[0, 0].legend(handles=proxies, fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+", help="scaling_<gpu>_x<K>.json files (globs allowed)")
    ap.add_argument("--png", default=None)
    ap.add_argument("--md", default=None)
    ap.add_argument("--tokens", type=int, default=None, help="tokens per GPU for the plots (default 32768 or the largest)")
    a = ap.parse_args(argv)
    paths = sorted({p for pat in a.json for p in (glob.glob(pat) or [pat])})
    records, metas = load(paths)
    table = markdown(records, metas, load_profile(paths))
    print(table)
    if a.md:
        with open(a.md, "w") as f:
            f.write(table + "\n")
    if a.png:
        plot(records, metas, a.png, a.tokens)
        print(f"wrote {a.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
