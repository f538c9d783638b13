"""Results files and their tables: every benchmark writes benchmarks/results/<name>_<device>.json
(the numbers) and .md (the tables a reader and the docs quote), says which command made them,
and takes --out / --no-files so that a trial run leaves the recorded results alone."""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

from harness import REPO, RESULTS


def parser(doc: str, **kwargs) -> argparse.ArgumentParser:
    """A benchmark's argument parser, described by the first paragraph of its docstring."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0], **kwargs)


def add_output(ap, default=RESULTS, help_out="output folder (default benchmarks/results)"):
    """--out FOLDER and --no-files (print the tables, write nothing)."""
    ap.add_argument("--out", default=None if default is None else str(default), help=help_out)
    ap.add_argument("--no-files", action="store_true", help="print the tables, write no files")


def add_threads(ap, default=1):
    """--threads N (torch.set_num_threads); 1 by default: on a shared 2-core machine OpenMP's
    threads wait for each other at every op."""
    ap.add_argument("--threads", type=int, default=default, help="torch.set_num_threads")


def out_dir(args, quick=False) -> Path | None:
    """Where the files go: --out, else benchmarks/results unless this is a smoke run (quick)
    or --no-files; None: write nothing."""
    if getattr(args, "no_files", False):
        return None
    if args.out:
        return Path(args.out)
    return None if quick else RESULTS


def recorded(args) -> dict:
    """The options of a run, for its results file: what it measured with, not where it wrote."""
    return {k: v for k, v in vars(args).items() if k != "no_files"}


def command(script, argv=None, prefix="python3") -> str:
    """The command line that ran this benchmark, the script relative to the repository, for the
    results file's header."""
    rel = os.path.relpath(os.path.abspath(script), REPO)
    args = sys.argv[1:] if argv is None else list(argv)
    return " ".join([prefix, rel] + args)


def write_results(folder, stem, doc, markdown, indent=1) -> Path:
    """folder/stem.json (doc) and folder/stem.md (markdown: the text, or a function writing it
    to the path it is given); returns the stem's path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    base = folder / stem
    base.with_name(stem + ".json").write_text(json.dumps(doc, indent=indent) + "\n")
    md = base.with_name(stem + ".md")
    if callable(markdown):
        markdown(md)
    else:
        md.write_text(markdown)
    print(f"wrote {base}.{{json,md}}", file=sys.stderr)
    return base


def table(head, align, rows=(), compact=False) -> list[str]:
    """A markdown table's lines: head (cells), align (one letter a column, l or r), rows (lists
    of cells). compact: the rule without spaces (|---|--:|), as some results files have it."""
    rule = ["---" if a == "l" else "--:" for a in align]
    return [row_line(head), "|" + "|".join(rule) + "|" if compact else row_line(rule)] + \
        [row_line(row) for row in rows]


def row_line(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def machine_table(info) -> list[str]:
    """A machine record (harness.machine.machine_info) as a two-column table."""
    return ["| machine | |", "| --- | --- |"] + [row_line(kv) for kv in info.items()]


def machine_sentence(info) -> str:
    """A machine record (harness.machine.machine_info) as one line of prose."""
    flags = ", ".join(info.get("cpu_flags", [])) or "none of the recorded ones"
    return (f"Machine: {info.get('cpu', '?')}, {info.get('cpu_cores', '?')} cores (flags: "
            f"{flags}; torch CPU capability {info.get('cpu_capability', '?')}), "
            f"{info.get('torch_threads', '?')} torch threads, torch {info.get('torch', '?')}. "
            f"Date: {info.get('date_utc', '?')}. Commit: {info.get('fusedamp_commit', '?')}.")


def ratio_cell(ratio, bold_below=None, fmt=".2f") -> str:
    """A ratio for a table, **bold** where it is below bold_below (the side measured is the
    slower one there)."""
    if ratio is None:
        return "—"
    cell = format(ratio, fmt)
    return f"**{cell}**" if bold_below is not None and ratio < bold_below else cell


def mean_sd(vals):
    """Mean and sample sd; NaN for both where a run diverged (statistics.stdev raises on it),
    and a NaN sd for a lone value."""
    if not all(math.isfinite(x) for x in vals):
        return math.nan, math.nan
    return statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else math.nan
