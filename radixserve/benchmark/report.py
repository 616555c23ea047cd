"""Reports: markdown tables and PNG plots of benchmark results (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np


def format_tokens(n: float) -> str:
    """500000 -> '0.5M', 64000 -> '64k' (decimal units, as the Mooncake README uses)."""
    for unit, scale, smallest in (("G", 1e9, 1e9), ("M", 1e6, 5e5), ("k", 1e3, 1e3)):
        if n >= smallest:
            return f"{n / scale:g}{unit}"
    return f"{n:g}"


def format_capacity(device: int, host: int = 0) -> str:
    """'0.5M', or '0.5M+8M' with a host tier (device + host)."""
    return format_tokens(device) + (f"+{format_tokens(host)}" if host else "")


def parse_tokens(text: str) -> int:
    """'0.5M' -> 500000, '64k' -> 64000, '1000' -> 1000."""
    text = text.strip()
    scales = {"k": 1e3, "K": 1e3, "m": 1e6, "M": 1e6, "g": 1e9, "G": 1e9}
    if text and text[-1] in scales:
        return int(round(float(text[:-1]) * scales[text[-1]]))
    return int(text)


def percent(x: float | None) -> str:
    """0.1234 -> '12.3%'; None -> '-'."""
    return "-" if x is None else f"{100 * x:.1f}%"


def sweep_table(sweep: Sequence[Mapping]) -> str:
    """Markdown table: one row per configuration, one column per capacity, each cell the hit
    rate and (in brackets) its fraction of the offline optimum (the better of arrival and DFS
    order where both exist); bound rows at the bottom.

    `sweep` is a list of simulate-run objects (`suite.run_suite`), one per capacity (columns
    "device+host" with a host tier, where the optimum is that of the whole capacity).
    """
    labels: list[str] = []
    for run in sweep:
        for entry in run["runs"]:
            if entry["label"] not in labels:
                labels.append(entry["label"])
    header = "| configuration | " + " | ".join(format_capacity(r["capacity_tokens"], r.get("host_capacity_tokens", 0))
                                               for r in sweep) + " |"
    lines = [header, "|---" * (len(sweep) + 1) + "|"]
    for label in labels:
        cells = []
        for run in sweep:
            entry = next((e for e in run["runs"] if e["label"] == label), None)
            if entry is None:
                cells.append("-")
            else:
                opt = max(run["optimal_hit_rate"], run.get("optimal_dfs_hit_rate") or 0.0)
                frac = f" ({entry['hit_rate'] / opt:.0%})" if opt else ""
                cells.append(percent(entry["hit_rate"]) + frac)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("| **offline optimum** (arrival order) | "
                 + " | ".join(percent(r["optimal_hit_rate"]) for r in sweep) + " |")
    if any(r.get("host_capacity_tokens") for r in sweep):
        lines.append("| offline optimum, device capacity alone | "
                     + " | ".join(percent(r.get("optimal_device_hit_rate")) for r in sweep) + " |")
    if any(r.get("optimal_dfs_hit_rate") is not None for r in sweep):
        lines.append("| offline optimum, DFS order | "
                     + " | ".join(percent(r.get("optimal_dfs_hit_rate")) for r in sweep) + " |")
    lines.append("| infinite cache | " + " | ".join(percent(r["infinite_hit_rate"]) for r in sweep) + " |")
    return "\n".join(lines) + "\n"


def window_table(sweep: Sequence[Mapping], windowed: str, full: str) -> str:
    """Markdown table of a windowed model next to full attention (`bench simulate --window`):
    per capacity, the hit rate, the pages the tree holds at the end, and the pages running
    sequences keep from being freed (mean over steps, peak)."""
    lines = ["| capacity | attention | hit rate | pages cached at the end | pages held by running "
             "sequences, mean / peak |", "|---|---|---|---|---|"]
    for run in sweep:
        for label, name in ((windowed, "sliding window"), (full, "full")):
            entry = next((e for e in run["runs"] if e["label"] == label), None)
            if entry is None:
                continue
            what = f"{name}" + (f" ({entry['window']})" if entry.get("window") else "")
            lines.append(f"| {format_capacity(run['capacity_tokens'], run.get('host_capacity_tokens', 0))} | "
                         f"{what} | {percent(entry['hit_rate'])} | {entry['cached_pages']} | "
                         f"{entry['held_pages_mean']:.1f} / {entry['held_pages_peak']} |")
    return "\n".join(lines) + "\n"


def serve_table(results: Mapping[str, Mapping]) -> str:
    """Markdown table of serve-mode summaries, one row per labelled run."""
    keys = [("hit_rate", "hit rate", percent), ("ttft_mean_s", "TTFT mean", _ms), ("ttft_p99_s", "TTFT p99", _ms),
            ("itl_mean_s", "ITL mean", _ms), ("request_throughput", "req/s", _num),
            ("output_token_throughput", "out tok/s", _num), ("total_token_throughput", "total tok/s", _num)]
    lines = ["| run | " + " | ".join(k[1] for k in keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for label, summary in results.items():
        lines.append(f"| {label} | " + " | ".join(fmt(summary.get(key)) for key, _, fmt in keys) + " |")
    return "\n".join(lines) + "\n"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.1f} ms"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def plot_hit_rate_vs_capacity(sweep: Sequence[Mapping], path: str | Path, title: str = "") -> None:
    """Hit rate against capacity, one line per configuration, with the optimum and the
    infinite-cache bound."""
    plt = _pyplot()
    capacities = np.array([run["capacity_tokens"] for run in sweep], dtype=float)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels: list[str] = []
    for run in sweep:
        labels += [e["label"] for e in run["runs"] if e["label"] not in labels and e["use_cache"]]
    for label in labels:
        ys = [next((e["hit_rate"] for e in run["runs"] if e["label"] == label), np.nan) for run in sweep]
        ax.plot(capacities, 100 * np.array(ys), marker="o", label=label)
    ax.plot(capacities, [100 * r["optimal_hit_rate"] for r in sweep], "k--", marker="s", label="offline optimum")
    ax.axhline(100 * sweep[0]["infinite_hit_rate"], color="grey", linestyle=":", label="infinite cache")
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(capacities, [format_tokens(c) for c in capacities])
    _finish_hit_rate_plot(plt, fig, ax, path, "cache capacity (tokens)", title or "hit rate vs capacity")


def plot_hit_rate_vs_host_capacity(sweep: Sequence[Mapping], path: str | Path, title: str = "") -> None:
    """Hit rate against host tier capacity, one line per device capacity for the main
    configuration, with the same capacity as one cache, the offline optimum of the whole
    capacity and the infinite-cache bound."""
    plt = _pyplot()
    hosts = sorted({run["host_capacity_tokens"] for run in sweep})
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for device in sorted({run["capacity_tokens"] for run in sweep}):
        runs = {run["host_capacity_tokens"]: run for run in sweep if run["capacity_tokens"] == device}
        xs = [i for i, h in enumerate(hosts) if h in runs]
        name = format_tokens(device)
        line, = ax.plot(xs, [100 * runs[hosts[i]]["hit_rate"] for i in xs], marker="o",
                        label=f"device {name} + host tier ({runs[hosts[xs[0]]]['main']})")
        one_cache = [next((e["hit_rate"] for e in runs[hosts[i]]["runs"] if e["label"].endswith("one cache of device+host")),
                          runs[hosts[i]]["hit_rate"] if hosts[i] == 0 else np.nan) for i in xs]
        ax.plot(xs, 100 * np.array(one_cache), linestyle="--", color=line.get_color(), marker="^",
                label=f"one device cache of {name} + host capacity")
        ax.plot(xs, [100 * runs[hosts[i]]["optimal_hit_rate"] for i in xs], linestyle=":", color=line.get_color(),
                marker="s", label=f"offline optimum, {name} + host capacity")
    ax.axhline(100 * sweep[0]["infinite_hit_rate"], color="grey", linestyle=":", label="infinite cache")
    ax.set_xticks(range(len(hosts)), [format_tokens(h) if h else "0" for h in hosts])
    _finish_hit_rate_plot(plt, fig, ax, path, "host tier capacity (tokens)", title or "hit rate vs host tier capacity")


def _finish_hit_rate_plot(plt, fig, ax, path: str | Path, xlabel: str, title: str) -> None:
    """Labels, grid and legend of a hit-rate plot; writes it to `path`."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel("prefix hit rate (%)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_ttft_cdf(ttfts: Mapping[str, Sequence[float]], path: str | Path, title: str = "") -> None:
    """Empirical CDF of TTFT per labelled run (e.g. cache on vs off)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, values in ttfts.items():
        xs = np.sort(np.asarray([v for v in values if v == v], dtype=float)) * 1000
        if len(xs):
            ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=label)
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title or "TTFT distribution")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
