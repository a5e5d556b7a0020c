#!/usr/bin/env python
"""Draw the documentation's benchmark pictures from the benchmark tools' JSON output.

    python tools/plot_benchmarks.py [--data docs/benchmarks] [--out docs/img] [--check]

Reads, from ``--data``, what each tool writes with ``--json FILE``:

- ``read.json``   ``tools/bench_read.py``: every run (medians are taken here, as its table does);
- ``s3.json``     ``tools/bench_s3.py``: epoch rows, MB/s by source and reader;
- ``tokens.json`` ``tools/bench_tokens.py``: M tokens/s by system and workers;
- ``pack.json``   ``tools/bench_pack.py``: input MB/s by workload and writer;
- ``balance.json`` ``tools/bench_balance.py``: per-step max/mean rank cost, balanced or not;

and writes one SVG per file into ``--out``: samples/s against ``num_workers`` for shardloader
and its peers, S3 and HTTP against local disk, tokens/s, and pack speed.  A file may be the
tool's output as written, or that output inside an object with a ``source`` note (how the
committed figures say where they come from).  The SVGs are deterministic (no dates, fixed ids),
so ``--check`` (and tests/test_docs.py) can tell whether the committed pictures still match the
committed data.  Needs matplotlib (``pip install 'shardloader[plot]'``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = "#1f4e99"
PEER_COLORS = ["#d95f02", "#7570b3", "#1b9e77", "#e7298a", "#a6761d", "#666666"]


def load(path: str, key: str) -> list[dict[str, Any]]:
    """The list of records in a tool's JSON file: the file itself, or its ``key`` entry."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    records = data[key] if isinstance(data, dict) else data
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise SystemExit(f"{path}: expected a list of records (or an object with {key!r})")
    return records


def medians(runs: list[dict[str, Any]], keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """One record per ``keys`` group, each numeric field its median over the group's runs."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault(tuple(run[k] for k in keys), []).append(run)
    out = []
    for group_key, group in groups.items():
        row = dict(zip(keys, group_key, strict=True))
        for field, value in group[0].items():
            if field not in keys and isinstance(value, int | float):
                row[field] = statistics.median(r[field] for r in group)
        out.append(row)
    return out


# ------------------------------------------------------------------------------- the figures


def _style() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcdefaults()
    plt.rcParams.update(
        {
            "svg.hashsalt": "shardloader",  # fixed element ids: the same data, the same bytes
            "svg.fonttype": "none",  # text stays text (small files, the page's font)
            "font.size": 9,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "axes.grid": True,
            "grid.alpha": 0.3,
        }
    )
    return plt


def _is_ours(name: str) -> bool:
    return name.startswith("shardloader")


def plot_read(runs: list[dict[str, Any]], plt: Any) -> Any:
    """Raw samples/s against num_workers, one panel per corpus, a line per system."""
    rows = medians(runs, ("corpus", "workers", "system"))
    corpora = list(dict.fromkeys(r["corpus"] for r in rows))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    systems.sort(key=lambda s: (not _is_ours(s), s))
    fig, axes = plt.subplots(1, len(corpora), figsize=(8, 3.4), squeeze=False)
    peers = iter(PEER_COLORS * 2)
    colors = {s: OURS if _is_ours(s) else next(peers) for s in systems}
    styles = {"shardloader": "-", "shardloader-arrow": "--", "shardloader-dicts": ":"}
    for ax, corpus in zip(axes[0], corpora, strict=True):
        for system in systems:
            points = sorted(
                (r["workers"], r["samples_s"])
                for r in rows
                if r["corpus"] == corpus and r["system"] == system
            )
            if not points:
                continue
            ours = _is_ours(system)
            ax.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                styles.get(system, "-"),
                marker="o",
                color=colors[system],
                linewidth=2.4 if system == "shardloader" else 1.3,
                alpha=1.0 if ours else 0.85,
                label=system,
            )
        ax.set_yscale("log")
        ax.set_title({"docs": "documents"}.get(corpus, corpus))
        ax.set_xlabel("num_workers")
        ax.set_xticks(sorted({r["workers"] for r in rows}))
    axes[0][0].set_ylabel("samples/s (log scale)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", frameon=False)
    fig.suptitle("Raw samples/s against num_workers, shuffled, batches of 32 (higher is better)")
    fig.tight_layout(rect=(0, 0, 0.8, 1))
    return fig


def plot_s3(rows: list[dict[str, Any]], plt: Any) -> Any:
    """Epoch MB/s from local disk, HTTP and S3 for each reader; the bare client as a line."""
    sources = ["local disk", "HTTP (http.server)", "S3 (moto)"]
    bare = [r for r in rows if str(r["reader"]).startswith("bare")]
    readers = [r for r in dict.fromkeys(str(r["reader"]) for r in rows) if not r.startswith("bare")]
    names = {"now": "shardloader", "today": "shardloader (older)"}
    fig, ax = plt.subplots(figsize=(8, 3.4))
    width = 0.8 / max(len(readers), 1)
    peers = iter(PEER_COLORS)
    for i, reader in enumerate(readers):
        measured = [
            (k + (i - (len(readers) - 1) / 2) * width, r["mb_s"])
            for k, s in enumerate(sources)
            for r in rows
            if r["reader"] == reader and r["source"] == s
        ]  # a source a reader was not measured on has no bar
        color = OURS if reader == "now" else ("#8fa8d6" if reader == "today" else next(peers))
        bars = ax.bar(
            [x for x, _ in measured],
            [v for _, v in measured],
            width * 0.95,
            color=color,
            label=names.get(reader, reader),
        )
        ax.bar_label(bars, fmt="%.0f", fontsize=8, padding=2)
    if bare:
        best = max(r["mb_s"] for r in bare)
        ax.axhline(best, color="#444", linestyle="--", linewidth=1)
        ax.annotate(
            f"bare boto3 GET: {best:.0f} MB/s",
            (len(sources) - 0.5, best),
            ha="right",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(range(len(sources)), ["local disk", "HTTP", "S3"])
    ax.set_ylabel("epoch MB/s (higher is better)")
    ax.set_title("One epoch, cold cache: object storage against local disk")
    ax.legend(frameon=False, loc="upper right", bbox_to_anchor=(1.0, 0.9))
    fig.tight_layout()
    return fig


def plot_tokens(rows: list[dict[str, Any]], plt: Any) -> Any:
    """M tokens/s by num_workers: TokenBlocks against the peer."""
    names = {"shardloader": "shardloader TokenBlocks", "litdata": "LitData TokensLoader"}
    systems = list(dict.fromkeys(r["system"] for r in rows))
    systems.sort(key=lambda s: not _is_ours(s))
    workers = sorted({r["workers"] for r in rows})
    fig, ax = plt.subplots(figsize=(6, 3.2))
    width = 0.8 / max(len(systems), 1)
    peers = iter(PEER_COLORS)
    for i, system in enumerate(systems):
        values = [
            next((r["mtok_s"] for r in rows if r["system"] == system and r["workers"] == w), 0.0)
            for w in workers
        ]
        xs = [k + (i - (len(systems) - 1) / 2) * width for k in range(len(workers))]
        color = OURS if _is_ours(system) else next(peers)
        bars = ax.bar(xs, values, width * 0.95, color=color, label=names.get(system, system))
        ax.bar_label(bars, fmt="%.1f", fontsize=8, padding=2)
    ax.set_xticks(range(len(workers)), [f"num_workers={w}" for w in workers])
    ax.set_ylabel("M tokens/s (higher is better)")
    ax.set_title("LLM rows of 2,048 tokens, batches of 8")
    ax.legend(frameon=False)
    fig.tight_layout()
    return fig


def plot_pack(rows: list[dict[str, Any]], plt: Any) -> Any:
    """Input MB/s of each writer, one panel per workload."""
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(workloads), figsize=(8, 3.2), squeeze=False)
    for ax, work in zip(axes[0], workloads, strict=True):
        group = sorted((r for r in rows if r["workload"] == work), key=lambda r: r["mb_s"])
        labels = [f"{r['writer']}\n{r['config']}" for r in group]
        colors = [
            OURS if r["writer"] == "shardloader" else "#8fa8d6" if _is_ours(r["writer"]) else "#999"
            for r in group
        ]
        bars = ax.barh(range(len(group)), [r["mb_s"] for r in group], color=colors)
        ax.bar_label(bars, fmt="%.0f", fontsize=8, padding=2)
        ax.set_yticks(range(len(group)), labels, fontsize=7)
        ax.set_xlabel("input MB/s (higher is better)")
        ax.set_title(f"packing {work}")
        ax.grid(axis="y", visible=False)
    fig.tight_layout()
    return fig


# name of the data file -> (record key, picture, drawing function)
def plot_balance(rows: list[dict[str, Any]], plt: Any) -> Any:
    """Per-step dearest/mean rank cost of one configuration over its steps, balanced against
    not; beside it each configuration's mean (2 rows a rank)."""
    curve = next(r for r in rows if "per_step_balanced" in r)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4), width_ratios=(3, 2))
    for name, color in (("unbalanced", "#999"), ("balanced", OURS)):
        ys = curve[f"per_step_{name}"]
        left.plot(range(len(ys)), ys, color=color, linewidth=1.0, label=name)
    left.set_xlabel("step")
    left.set_ylabel("dearest rank / mean rank (lower is better)")
    left.set_title(
        f"seq_len {curve['seq_len']:,}, {curve['ranks']} ranks x {curve['rows_per_rank']} rows",
        fontsize=9,
    )
    left.legend(frameon=False)
    two = [r for r in rows if r["rows_per_rank"] == 2]
    labels = [f"{r['seq_len'] // 1024}k x {r['ranks']}" for r in two]
    for i, (name, color) in enumerate((("unbalanced", "#999"), ("balanced", OURS))):
        xs = [k + (i - 0.5) * 0.4 for k in range(len(two))]
        bars = right.bar(xs, [r[name] for r in two], 0.38, color=color, label=name)
        right.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
    right.set_xticks(range(len(two)), labels, fontsize=8)
    right.set_ylabel("mean over steps")
    right.set_title("seq_len x ranks, 2 rows a rank", fontsize=9)
    fig.suptitle(
        "shardloader PackedBatches: per-step rank cost (sum of L^2), balanced or not, "
        "this round's run"
    )
    fig.tight_layout()
    return fig


FIGURES: dict[str, tuple[str, str, Callable[[list[dict[str, Any]], Any], Any]]] = {
    "read.json": ("runs", "bench-read-workers.svg", plot_read),
    "s3.json": ("rows", "bench-s3.svg", plot_s3),
    "tokens.json": ("rows", "bench-tokens.svg", plot_tokens),
    "pack.json": ("rows", "bench-pack.svg", plot_pack),
    "balance.json": ("rows", "bench-balance.svg", plot_balance),
}


def render(data_dir: str) -> dict[str, bytes]:
    """Every picture whose data file is in ``data_dir``: {file name: SVG bytes}."""
    plt = _style()
    out = {}
    for data_name, (key, picture, draw) in FIGURES.items():
        path = os.path.join(data_dir, data_name)
        if not os.path.exists(path):
            continue
        fig = draw(load(path, key), plt)
        buf = io.BytesIO()
        fig.savefig(buf, format="svg", metadata={"Date": None})
        plt.close(fig)
        out[picture] = buf.getvalue()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=os.path.join(ROOT, "docs", "benchmarks"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "img"))
    ap.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if a picture is out of date"
    )
    args = ap.parse_args(argv)
    pictures = render(args.data)
    if not pictures:
        print(f"no benchmark JSON in {args.data}", file=sys.stderr)
        return 1
    stale = []
    for name, svg in pictures.items():
        path = os.path.join(args.out, name)
        if args.check:
            if not os.path.exists(path) or open(path, "rb").read() != svg:
                stale.append(path)
            continue
        os.makedirs(args.out, exist_ok=True)
        with open(path, "wb") as f:
            f.write(svg)
        print(f"wrote {path}")
    if stale:
        print("out of date (run python tools/plot_benchmarks.py):", *stale, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
