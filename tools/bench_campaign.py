"""The speed goals' whole table in one campaign: every benchmark tool, fixed arguments, one folder.

    python tools/bench_campaign.py [--out bench-out/campaign] [--scale 1] [--repeat 3]
                                   [--only STEP,...] [--skip STEP,...] [--plan]

Run it with any Python from the checkout under test: each tool runs in the peers' venv
(``--python``, default ``/work/main/.venv-bench/bin/python``) with ``PYTHONPATH`` set to this
checkout, so shardloader is the tree being measured.  Steps, in order (``--only``/``--skip``
take their names):

  preflight    the venv, the peers' versions, the tree's commit, the native JPEG decoder
               (built in place with ``setup.py build_ext --inplace`` when missing)
  read-build   tools/bench_read.py --repeat 0: its corpus (tools/make_corpus.py, --jpeg-only)
               written by every system read below; tools/bench_pack.py reuses the corpus
  peers-build  tools/bench_peers.py --repeat 0: the second harness's own corpus and writes
  read         raw images / documents x tar / Arrow x 0 / 2 workers against LitData
  peers        the same rows from the second harness (tools/bench_peers.py)
  tokens       TokenBlocks 2048 x 8, default and lean, against LitData's TokensLoader, 0 / 2
  vision       the JPEG train pipeline, 2 workers, batch 64, at 256x256 and 500x375
  s3           moto S3 against local disk and LitData, 2 workers, and pack to s3:// vs local
  s3-docs      the same reads of 1.5 KB documents
  pack         shardloader pack against MDSWriter zstd on the read corpus's images and text

``--scale`` multiplies every corpus (1: the goals' 20,000 images, 200,000 documents, 54.5 M
tokens, 200 MB on S3, 240 MB packed to S3); ``--scale 0.05`` checks that every step runs.
Each tool's table goes to ``OUT/STEP.md`` (its stdout), its progress to ``OUT/STEP.log``, its
figures to ``OUT/STEP.json``; ``uptime`` is recorded before and after each step.  At the end
``OUT/SUMMARY.md`` holds the steps (wall time, CPU, load, exit status, command), the rows of
the goals' table taken from the JSON files, and every tool's own tables.  ``--only`` reruns
some steps into the same ``OUT`` and keeps the others' records (at the same ``--scale``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_PYTHON = "/work/main/.venv-bench/bin/python"
BENCH_LOG = "/tmp/benchvenv.log"  # where the workplace's venv build says "done"
# each read step's systems: LitData was the best peer of every raw row (the last independent check)
READ_SYSTEMS = "shardloader,shardloader-arrow,litdata"
NEEDS_GB = 15


def steps(out: str, scale: float, repeat: int) -> dict[str, list[str]]:
    """Each step's command line (after the Python), at ``scale``."""

    def n(full: float, least: int) -> str:
        return str(max(least, round(full * scale)))

    images, docs = n(20000, 200), n(200000, 2000)
    # bench_tokens reads Pss_Anon after 1,000 batches and divides by it: >= 16.4 M tokens
    tdocs = n(200000, 64000)
    corpus = os.path.join(out, "read", "corpus")
    read = ["tools/bench_read.py", "--work", f"{out}/read", "--images", images, "--docs", docs]
    read += ["--systems", READ_SYSTEMS]
    peers = ["tools/bench_peers.py", "--work", f"{out}/peers", "--images", images, "--docs", docs]
    r = str(repeat)
    return {
        "read-build": [*read, "--repeat", "0"],
        "peers-build": [*peers, "--repeat", "0"],
        "read": [*read, "--repeat", r, "--workers", "0,2", "--json", f"{out}/read.json"],
        "peers": [*peers, "--repeat", r, "--workers", "0,2", "--json", f"{out}/peers.json"],
        # bench_tokens reuses its packed shards whatever --docs says: a folder per size
        "tokens": ["tools/bench_tokens.py", "--docs", tdocs, "--work", f"{out}/tokens-{tdocs}"]
        + ["--systems", "shardloader,lean,litdata", "--workers", "0,2", "--repeat", r]
        + ["--markdown", "--json", f"{out}/tokens.json"],
        "vision": ["tools/bench_vision.py", "--sizes", "256x256,500x375", "--workers", "2"]
        + ["--images", n(2000, 256), "--reps", r, "--json", f"{out}/vision.json"],
        "s3": ["tools/bench_s3.py", "--mb", n(200, 8), "--pack-mb", n(240, 8), "--workers", "2"]
        + ["--shard-mb", "16", "--repeat", r, "--parts", "epochs,pack"]
        + ["--json", f"{out}/s3.json"],
        # documents: the 1.5 KB JSONL lines, reads only (pack is measured above)
        "s3-docs": ["tools/bench_s3.py", "--mb", n(100, 4), "--sample-kb", "1.5"]
        + ["--workers", "2", "--shard-mb", "16", "--repeat", r, "--parts", "epochs"]
        + ["--json", f"{out}/s3-docs.json"],
        "pack": ["tools/bench_pack.py", "--corpus", corpus, "--out", f"{out}/pack-out"]
        + ["--images", images, "--docs", docs, "--repeat", r, "--workers", "2"]
        + ["--skip", "litdata,webdataset", "--json", f"{out}/pack.json"],
    }


# ----------------------------------------------------------------------------------- running


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _children_cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def run_step(name: str, argv: list[str], python: str, out: str, env: dict[str, str]) -> dict:
    """Run one tool; its stdout to ``OUT/NAME.md``, its stderr to ``OUT/NAME.log``."""
    command = shlex.join([f"PYTHONPATH={ROOT}", "python", *argv])
    record: dict[str, Any] = {"step": name, "command": command, "uptime_before": uptime()}
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {command}", flush=True)
    t0, cpu0 = time.perf_counter(), _children_cpu()
    with open(f"{out}/{name}.md", "w") as md, open(f"{out}/{name}.log", "w") as log:
        rc = subprocess.run([python, *argv], cwd=ROOT, env=env, stdout=md, stderr=log).returncode
    record |= {"rc": rc, "wall_s": time.perf_counter() - t0, "uptime_after": uptime()}
    # the tool and every process it started that was waited for (an orphan's CPU is not here)
    record["cpu_s"] = _children_cpu() - cpu0
    print(
        f"    {record['wall_s']:.0f} s, CPU {record['cpu_s']:.0f} s, rc {rc}; "
        f"{record['uptime_after']}",
        flush=True,
    )
    return record


def preflight(python: str, out: str, env: dict[str, str], build: bool) -> dict[str, Any]:
    """What the figures depend on: the venv, the peers, the tree, the native decoder."""
    probe = (
        "import importlib.metadata as m, json, platform\n"
        "from shardloader.vision import jpeg\n"
        "names = ('torch', 'torchvision', 'litdata', 'mosaicml-streaming', 'webdataset', 'moto')\n"
        "v = {}\n"
        "for n in names:\n"
        "    try: v[n] = m.version(n)\n"
        "    except m.PackageNotFoundError: v[n] = None\n"
        "print(json.dumps({'python': platform.python_version(), 'versions': v,\n"
        "                  'native_jpeg': jpeg.native_reason() or 'built'}))\n"
    )

    def ask() -> dict[str, Any]:
        got = subprocess.run(
            [python, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True
        )
        if got.returncode:
            raise SystemExit(f"{python} cannot import what the campaign needs:\n{got.stderr}")
        return json.loads(got.stdout)  # type: ignore[no-any-return]

    info = ask()
    if info["native_jpeg"] != "built" and build:
        with open(f"{out}/native-build.log", "w") as log:
            cmd = [python, "setup.py", "build_ext", "--inplace"]
            subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=log)
        info = ask()
    git = ["git", "-C", ROOT]
    info["commit"] = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True)
    info["commit"] = info["commit"].stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True).stdout
    info["dirty"] = bool(dirty.strip())
    try:
        with open(BENCH_LOG) as f:
            info["bench_venv_log"] = f.read().strip().splitlines()[-1]
    except (OSError, IndexError):
        info["bench_venv_log"] = None
    info["cores"], info["uptime"] = os.cpu_count(), uptime()
    info["free_gb"] = shutil.disk_usage(out).free / 1e9
    if info["free_gb"] < NEEDS_GB:  # corpora, every system's copy, the node cache
        print(f"warning: {info['free_gb']:.0f} GB free under {out}; a full run writes ~12 GB")
    return info


# ----------------------------------------------------------------------------------- summary


def _load(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)  # type: ignore[no-any-return]


def raw_rows(data: dict[str, Any], tar: str, arrow: str, cpu: str) -> list[str]:
    """The goals' raw rows (images / documents, 0 / 2 workers) from bench_read or bench_peers."""
    rows = {(r["corpus"], r["workers"], r["system"]): r for r in data["rows"]}
    out = []
    for corpus in ("images", "docs"):
        for w in sorted({k[1] for k in rows}):
            lit, t, a = (rows.get((corpus, w, s)) for s in ("litdata", tar, arrow))
            if not (lit and t and a):
                continue
            sp = lit["samples_s"]
            out.append(
                f"| raw {corpus}, {w} workers | LitData {sp:,.0f} ({lit[cpu]:.1f} µs) "
                f"| {t['samples_s']:,.0f} / {a['samples_s']:,.0f} "
                f"({t[cpu]:.1f} / {a[cpu]:.1f} µs) | {t['samples_s'] / sp:.2f} / "
                f"{a['samples_s'] / sp:.2f} | {lit[cpu] / t[cpu]:.2f} / {lit[cpu] / a[cpu]:.2f} "
                f"| {statistics.median([lit['load'], t['load'], a['load']]):.1f} |"
            )
    return out


def token_rows(data: dict[str, Any]) -> list[str]:
    rows = {(r["system"], r["workers"]): r for r in data["rows"]}
    out = []
    for w in (0, 2):
        lit = rows.get(("litdata", w))
        own, lean = rows.get(("shardloader", w)), rows.get(("lean", w))
        if not (lit and own and lean):
            continue
        cpu = "tree_cpu_us_per_batch"
        keep = ""
        if w and ("shardloader", 0) in rows:
            keep = f"; keeps {own['mtok_s'] / rows[('shardloader', 0)]['mtok_s']:.2f}"
        out.append(
            f"| token rows 2048 x 8, {w} workers | LitData {lit['mtok_s']:.1f} M tokens/s "
            f"({lit[cpu]:.0f} µs/batch) | {own['mtok_s']:.1f} default / {lean['mtok_s']:.1f} "
            f"lean ({own[cpu]:.0f} / {lean[cpu]:.0f} µs/batch){keep} | "
            f"{own['mtok_s'] / lit['mtok_s']:.2f} / {lean['mtok_s'] / lit['mtok_s']:.2f} | "
            f"{lit[cpu] / own[cpu]:.2f} / {lit[cpu] / lean[cpu]:.2f} | "
            f"{data.get('load', [float('nan')])[0]:.1f} at the end |"
        )
    return out


def vision_rows(data: dict[str, Any]) -> list[str]:
    out = []
    for table in data["tables"]:
        runners = table["runners"]
        peers = {k: v for k, v in runners.items() if "torchvision" in k}
        ours = runners.get("shardloader train")
        if not (peers and ours):
            continue
        name, best = max(peers.items(), key=lambda kv: kv[1]["img_s"])
        out.append(
            f"| JPEG train, 2 workers, batch 64, {table['size']} | {name} {best['img_s']:.0f} "
            f"img/s ({best['cpu_ms']:.2f} ms) | {ours['img_s']:.0f} ({ours['cpu_ms']:.2f} ms) "
            f"| {ours['img_s'] / best['img_s']:.2f} | {best['cpu_ms'] / ours['cpu_ms']:.2f} "
            f"| {' '.join(f'{x:.1f}' for x in data.get('load', []))} |"
        )
        floor = next((v for k, v in runners.items() if k.startswith("bare ops")), None)
        if floor:  # the train pipeline's CPU per image over its bare operations' (goal <= 1.15)
            out.append(
                f"| train CPU / bare ops (crop decode + resize), {table['size']} | - "
                f"| {ours['cpu_ms']:.2f} / {floor['cpu_ms']:.2f} ms | "
                f"{ours['cpu_ms'] / floor['cpu_ms']:.2f} | - | |"
            )
    return out


def pack_rows(data: dict[str, Any]) -> list[str]:
    out = []
    for kind in dict.fromkeys(r["workload"] for r in data["rows"]):
        rows = [r for r in data["rows"] if r["workload"] == kind]
        ours = next((r for r in rows if r["writer"] == "shardloader"), None)
        mds = next((r for r in rows if r["writer"] == "mds"), None)
        if not (ours and mds):
            continue

        def per_mb(r: dict[str, Any]) -> float:
            return float(r["cpu_s"]) / r["input_mb"] * 1e3

        out.append(
            f"| pack {kind} ({ours['input_mb']:.0f} MB), zstd | MDS-zstd {mds['mb_s']:.1f} MB/s "
            f"({per_mb(mds):.0f} ms/MB) | {ours['mb_s']:.1f} ({per_mb(ours):.0f} ms/MB) | "
            f"{ours['mb_s'] / mds['mb_s']:.2f} | {per_mb(mds) / per_mb(ours):.2f} | "
            f"{data['load']['before'][0]:.1f}..{data['load']['after'][0]:.1f} |"
        )
    return out


def generic_rows(data: dict[str, Any]) -> list[str]:
    """Any tool's ``rows`` as a table of their keys (bench_s3's rows change with the tool)."""
    rows = [r for r in data.get("rows", []) if isinstance(r, dict)]
    if not rows:
        return []
    keys = list(dict.fromkeys(k for r in rows for k in r if not isinstance(r[k], (list, dict))))

    def cell(v: Any) -> str:
        return f"{v:,.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    return lines + ["| " + " | ".join(cell(r.get(k, "")) for k in keys) + " |" for r in rows]


EXTRACT: dict[str, tuple[str, Callable[[dict[str, Any]], list[str]]]] = {
    "read": (
        "tools/bench_read.py",
        lambda d: raw_rows(d, "shardloader", "shardloader-arrow", "tree_cpu_us"),
    ),
    "peers": (
        "tools/bench_peers.py",
        lambda d: raw_rows(d, "shardloader-tar", "shardloader-arrow", "cpu_us"),
    ),
    "tokens": ("tools/bench_tokens.py", token_rows),
    "vision": ("tools/bench_vision.py", vision_rows),
    "pack": ("tools/bench_pack.py", pack_rows),
}


def summary(out: str, info: dict[str, Any], records: list[dict[str, Any]], args: Any) -> str:
    total = sum(r["wall_s"] for r in records)
    lines = [
        f"# Campaign of {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        "",
        f"- command: `python tools/bench_campaign.py --scale {args.scale:g} --repeat "
        f"{args.repeat} --out {args.out}`; {total / 60:.1f} min of steps",
        f"- tree: {info.get('commit')}{' (uncommitted changes)' if info.get('dirty') else ''}; "
        f"native JPEG decoder: {info.get('native_jpeg')}",
        f"- Python {info.get('python')}; {info.get('versions')}; bench venv log: "
        f"{info.get('bench_venv_log')}",
        f"- {info.get('cores')} cores; {info.get('free_gb', 0):.0f} GB free; before: "
        f"{info.get('uptime')}",
        "",
        "| step | wall s | CPU s, reaped processes | load before (1/5/15 min) | load after | rc |",
        "|---|---:|---:|---|---|---:|",
    ]
    for r in records:
        before, after = (
            r[k].split("load average:")[-1].strip() for k in ("uptime_before", "uptime_after")
        )
        lines.append(
            f"| {r['step']} | {r['wall_s']:.0f} | {r['cpu_s']:.0f} | {before} | {after} "
            f"| {r['rc']} |"
        )
    lines += [
        "",
        "## The goals' rows (medians; CPU per sample of the whole process tree; "
        "ratios: shardloader over the peer, CPU: the peer's over shardloader's)",
        "",
        "| work | peer (CPU) | shardloader (CPU) | ratio | CPU ratio | load |",
        "|---|---|---|---|---|---|",
    ]
    for step, (tool, extract) in EXTRACT.items():
        path = os.path.join(out, f"{step}.json")
        try:
            got = extract(_load(path))
        except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as e:
            got = [f"| {step} | not extracted ({type(e).__name__}: {e}); see {step}.md | | | | |"]
        lines += [row.replace("| ", f"| [{tool.split('/')[1][6:-3]}] ", 1) for row in got]
    for step in ("s3", "s3-docs"):
        path = os.path.join(out, f"{step}.json")
        if os.path.exists(path):
            lines += ["", f"### {step} rows (tools/bench_s3.py; its own tables in {step}.md)", ""]
            lines += generic_rows(_load(path))
    lines += ["", "## Commands", ""]
    lines += [f"- {r['step']}: `{r['command']}`" for r in records]
    for r in records:
        lines += ["", f"## {r['step']}: its output", ""]
        with open(os.path.join(out, f"{r['step']}.md")) as f:
            lines.append(f.read().strip() or "(nothing on stdout)")
        if r["rc"]:
            with open(os.path.join(out, f"{r['step']}.log")) as f:
                lines += ["", "FAILED; the end of its log:", "", "```", f.read()[-3000:], "```"]
    return "\n".join(lines) + "\n"


def earlier(out: str, scale: float) -> list[dict[str, Any]]:
    """The steps an earlier run at the same scale recorded in ``out`` (none at another)."""
    try:
        with open(os.path.join(out, "steps.json")) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return []
    return list(data["steps"]) if data.get("scale") == scale else []


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default="bench-out/campaign")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--python", default=BENCH_PYTHON if os.path.exists(BENCH_PYTHON) else sys.executable
    )
    ap.add_argument("--only", default="", help="comma-separated steps (default: all)")
    ap.add_argument("--skip", default="", help="comma-separated steps to leave out")
    ap.add_argument("--no-build", action="store_true", help="do not build the native decoder")
    ap.add_argument("--plan", action="store_true", help="print the commands, run nothing")
    args = ap.parse_args()
    out = os.path.abspath(args.out)
    plan = steps(out, args.scale, args.repeat)
    chosen = [s for s in ["preflight", *plan] if not args.only or s in args.only.split(",")]
    chosen = [s for s in chosen if s not in args.skip.split(",")]
    if args.plan:
        for s in chosen:
            print(s, shlex.join(plan.get(s, ["(checks)"])))
        return
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=ROOT, SHARDLOADER_CACHE_DIR=os.path.join(out, "cache"))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    info = preflight(args.python, out, env, build=not args.no_build)
    print(json.dumps(info, indent=1), flush=True)
    done = {r["step"]: r for r in earlier(out, args.scale)}  # a rerun of some steps keeps the rest
    done |= {s: run_step(s, plan[s], args.python, out, env) for s in chosen if s in plan}
    records = [done[s] for s in plan if s in done]
    with open(os.path.join(out, "steps.json"), "w") as f:
        json.dump({"preflight": info, "steps": records, "scale": args.scale}, f, indent=1)
    text = summary(out, info, records, args)
    with open(os.path.join(out, "SUMMARY.md"), "w") as f:
        f.write(text)
    print(text.split("\n## Commands")[0])
    print(f"\nwritten: {out}/SUMMARY.md")


if __name__ == "__main__":
    main()
