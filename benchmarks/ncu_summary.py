"""Summarise an ncu source-counter export: where a kernel's instructions and warp stalls are.

    ncu --import R.ncu-rep --page source --print-source sass --csv > R.csv
    python benchmarks/ncu_summary.py R.csv [--top 30]

Prints the stall reasons over the whole kernel, the opcode mix of executed instructions, the code regions
(runs of SASS lines with the same execution count: a loop body per count) by share of instructions and of
stall samples, and the SASS lines with the most stall samples.
"""

import argparse
import collections
import csv


def _num(s):
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return 0.0


def load(path):
    rows = list(csv.reader(open(path, errors="replace")))
    head = next(i for i, r in enumerate(rows) if any(c.strip() == "Source" for c in r))
    names = [c.strip() for c in rows[head]]
    return names, [r for r in rows[head + 1:] if len(r) == len(names)]


def _opcode(src):
    toks = src.split()
    op = toks[1] if toks and toks[0].startswith("@") and len(toks) > 1 else (toks[0] if toks else "")
    return op.split(".")[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    names, body = load(args.csv)
    src, ex = names.index("Source"), names.index("Instructions Executed")
    st = names.index("Warp Stall Sampling (All Samples)")
    reasons = [(i, n[len("stall_"):]) for i, n in enumerate(names) if n.startswith("stall_") and "Not Issued" not in n]
    total_ex = sum(_num(r[ex]) for r in body) or 1.0
    total_st = sum(_num(r[st]) for r in body) or 1.0
    print(f"{len(body)} SASS lines, {total_ex:.0f} warp instructions executed, {total_st:.0f} stall samples")

    by_reason = {n: sum(_num(r[i]) for r in body) for i, n in reasons}
    s = sum(by_reason.values()) or 1.0
    print("stall reasons:", ", ".join(f"{n} {100 * v / s:.1f}%" for n, v in
                                      sorted(by_reason.items(), key=lambda kv: -kv[1]) if v / s >= 0.005))

    ops = collections.Counter()
    for r in body:
        ops[_opcode(r[src].strip())] += _num(r[ex])
    print("opcodes:", ", ".join(f"{op} {100 * v / total_ex:.1f}%" for op, v in ops.most_common(15)))

    regions = collections.defaultdict(lambda: [0, 0.0, 0.0, None])  # lines, instructions, samples, first line
    for i, r in enumerate(body):
        c = _num(r[ex])
        if c == 0:
            continue
        g = regions[c]
        g[0] += 1
        g[1] += c
        g[2] += _num(r[st])
        g[3] = i if g[3] is None else g[3]
    print("regions (same execution count), by stall samples:")
    for c, (n, ins, smp, first) in sorted(regions.items(), key=lambda kv: -kv[1][2])[:10]:
        print(f"  executed {c:10.0f}x  {n:4d} lines from line {first:5d}: {100 * ins / total_ex:5.1f}% of "
              f"instructions, {100 * smp / total_st:5.1f}% of stall samples")

    print(f"top {args.top} lines by stall samples (share, main reason, executions, SASS):")
    for r in sorted(body, key=lambda r: -_num(r[st]))[:args.top]:
        main_reason = max(reasons, key=lambda ir: _num(r[ir[0]]))
        print(f"  {100 * _num(r[st]) / total_st:5.1f}%  {main_reason[1]:14s} {_num(r[ex]):10.0f}  {r[src].strip()[:90]}")


if __name__ == "__main__":
    main()
