"""Re-estimate every row of docs/accuracy.md and rewrite its estimate and error columns.

    .venv/bin/python bench/accuracy.py            # rewrites docs/accuracy.md, prints a summary
    .venv/bin/python bench/accuracy.py --rows 1 --out /tmp/accuracy.md   # smallest run: first row only

Each row holds the exact `memfit plan` command and the published figure; "(alloc)" rows compare
the estimate's peak_allocated_bytes in GB (10^9 B), "(reserved)" rows peak_reserved_bytes in GiB.
"""
from __future__ import annotations

import contextlib
import io
import argparse
import json
import re
import shlex
import statistics
import sys
from pathlib import Path

from memfit.cli import main as memfit_main

DOC = Path(__file__).resolve().parents[1] / "docs" / "accuracy.md"
ROW = re.compile(r"^\| (?P<row>[^|]+) \| `memfit (?P<cmd>[^`]+)` \| (?P<est>[\d.]+) (?P<unit>GB|GiB) "
                 r"\((?P<metric>alloc|reserved)\) \| (?P<pub>[\d.]+) (?P=unit) \| (?P<err>[^|]+) \|$")
METRIC = {"alloc": ("peak_allocated_bytes", 1e9), "reserved": ("peak_reserved_bytes", 2**30)}


def estimate(command: str, metric: str) -> float:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = memfit_main([*shlex.split(command), "--json"])
    if rc:
        raise SystemExit(f"`memfit {command}` exited {rc}")
    key, unit = METRIC[metric]
    return json.loads(out.getvalue())["estimate"][key] / unit


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--doc", type=Path, default=DOC, help="the table to re-estimate (default docs/accuracy.md)")
    parser.add_argument("--out", type=Path, help="where to write the updated table (default: --doc, in place)")
    parser.add_argument("--rows", type=int,
                        help="re-estimate only the first N rows (the others are copied as they are)")
    args = parser.parse_args()
    lines, errors = args.doc.read_text().splitlines(), {}
    for n, line in enumerate(lines):
        m = ROW.match(line)
        if not m or (args.rows is not None and len(errors) >= args.rows):
            continue
        value, published = estimate(m["cmd"], m["metric"]), float(m["pub"])
        error = (value - published) / published
        errors[m["row"]] = error
        lines[n] = (f"| {m['row']} | `memfit {m['cmd']}` | {value:.2f} {m['unit']} ({m['metric']}) | "
                    f"{m['pub']} {m['unit']} | {error * 100:+.1f}% |")
        print(f"{m['row']:>18}  {value:7.2f} {m['unit']:<3}  published {published:6.2f}  {error * 100:+6.1f}%",
              file=sys.stderr)
    if not errors:
        raise SystemExit(f"no rows found in {args.doc}")
    (args.out or args.doc).write_text("\n".join(lines) + "\n")
    for name, keep in (("all", lambda r: True), ("LitGPT QLoRA (B*b)", lambda r: r.startswith("B") and r.endswith("b")),
                       ("ms-swift (J)", lambda r: r.startswith("J"))):
        chosen = [abs(e) for r, e in errors.items() if keep(r)]
        if not chosen:  # a --rows subset may hold none of a source's rows
            continue
        print(f"{name}: {len(chosen)} rows, median |error| {statistics.median(chosen) * 100:.1f}%, "
              f"max {max(chosen) * 100:.1f}%", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
