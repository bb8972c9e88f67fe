"""Pairs ncu's kernel durations (file 1, in launch order) with plan_sweep's SEQ lines (file 2): medians."""
import re, sys, statistics
durs = []
name = None
for line in open(sys.argv[1]):
    if "Context" in line and "(" in line and "CC" in line:
        g = re.search(r"\((\d+, \d+, \d+)\)x\((\d+, \d+, \d+)\)", line)
        k = re.search(r"(Fp8Decode\w*Kernel<[^>]*>|\w+Kernel\w*)", line)
        name = (k.group(1) if k else "?") + (f" {g.group(1)}x{g.group(2)}" if g else "")
    elif "gpu__time_duration.sum" in line:
        parts = line.split(); v = float(parts[-1].replace(",", "")); u = parts[-2]
        durs.append((v / 1000 if u.startswith("ns") or u == "nsecond" else v * 1000 if u in ("ms", "msecond") else v, name))
i = 0
for line in open(sys.argv[2]):
    if not line.startswith("SEQ"): continue
    _, case, plan, n = line.split()
    n = int(n[1:]); chunk = durs[i:i + n]; i += n
    if plan == "warmup": continue
    if chunk:
        print(f"{case:14s} {plan:10s} {statistics.median(d for d, _ in chunk):8.2f} us  [{min(d for d,_ in chunk):.2f}-{max(d for d,_ in chunk):.2f}]  {chunk[0][1]}")
print(f"(kernels {len(durs)}, used {i})")
