"""Top source lines by warp-stall samples from `ncu -i REPORT --page source --csv --print-source cuda`.

    python3 benchmarks/ncu_source_top.py source.csv [N] [COLUMN]

Prints the N (default 40) CUDA source lines with the most stall samples, their share of all
samples and the line's text, so the stall profile of a kernel reads without the Nsight GUI.
With COLUMN, the lines are ranked by the first column whose name contains it instead (e.g.
"Shared Excessive": the shared-memory wavefronts lost to bank conflicts, line by line).
The CSV layout differs between Nsight Compute versions: the sample column is found by name,
and when it is not there the header and first rows are printed instead.
"""
import csv
import sys


def _num(x: str) -> float:
    try:
        return float(x.replace(",", "").strip() or 0)
    except ValueError:
        return 0.0


def main(path: str, n: int = 40, column: str = "") -> int:
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    key = column or "Sampling"
    head_i = next((i for i, r in enumerate(rows) if any(key in c for c in r)), None)
    if head_i is None:
        print(f"no column named like {key!r}; first rows of the CSV:")
        for r in rows[:8]:
            print(" | ".join(r)[:300])
        return 1
    head = rows[head_i]
    if column:
        col = next(i for i, c in enumerate(head) if column in c)
    else:
        col = next(i for i, c in enumerate(head) if "Sampling" in c and "All" in c) \
            if any("Sampling" in c and "All" in c for c in head) else next(i for i, c in enumerate(head) if "Sampling" in c)
    src = next((i for i, c in enumerate(head) if c.strip().lower() == "source"), len(head) - 1)
    line = next((i for i, c in enumerate(head) if c.strip() in ("#", "Line", "Line #")), 0)
    body = [r for r in rows[head_i + 1:] if len(r) > max(col, src)]
    total = sum(_num(r[col]) for r in body) or 1.0
    print(f"{head[col]}: {total:.0f} in all over {len(body)} lines; top {n}:")
    for r in sorted(body, key=lambda r: -_num(r[col]))[:n]:
        print(f"{_num(r[col]) / total:6.1%}  line {r[line]:>5}  {r[src].strip()[:150]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40, sys.argv[3] if len(sys.argv) > 3 else ""))
