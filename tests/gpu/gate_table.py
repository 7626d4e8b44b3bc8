"""The GPU tests' gates beside their measured errors: reads the ``GATE`` lines that ``gpu_metrics.gate`` / ``report``
print under ``pytest -s`` and writes one row per gate (parametrized cases merged: the worst measured value), with
the limit's multiple of it.  Rows past ``--flag`` x are marked: a gate that loose needs a comment saying why.

    python -m pytest -s tests/gpu/... | python tests/gpu/gate_table.py [--flag 10] [--out FILE]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

LINE = re.compile(r"GATE (\S+) measured (\S+) limit (\S+)$")  # pytest may print a progress mark first


def table(lines, flag: float) -> list[str]:
    worst: dict[str, tuple[float, str]] = {}
    for line in lines:
        match = LINE.search(line.strip())
        if not match:
            continue
        name, measured, limit = match.groups()
        name = re.sub(r"\[[^\]]*\]", "[*]", name)  # parametrized cases: one row, the worst of them
        value = float(measured)
        if name not in worst or value > worst[name][0]:
            worst[name] = (value, limit)
    rows = [f"{'gate':90s} {'measured':>10s} {'limit':>8s} {'multiple':>9s}"]
    for name, (value, limit) in sorted(worst.items()):
        if limit == "-":
            multiple = "-"
        else:
            ratio = float(limit) / value if value > 0 else float("inf")
            multiple = f"{ratio:8.1f}x" + (" LOOSE" if ratio > flag else "")
        rows.append(f"{name:90s} {value:10.3e} {limit:>8s} {multiple}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", nargs="*", type=Path, help="pytest -s outputs (default: stdin)")
    parser.add_argument("--flag", type=float, default=10.0, help="mark gates looser than this multiple")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    lines = [line for log in args.logs for line in log.read_text().splitlines()] if args.logs else sys.stdin
    text = "\n".join(table(lines, args.flag))
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
