"""A/B of the weight-streaming kernel: bench_cpu.linear_rows at 1 and 2 threads, in the tree on PYTHONPATH."""
import json, sys, torch
sys.path.insert(0, "benchmarks")
from bench_cpu import linear_rows, sizes
out = {}
for th in (1, 2):
    torch.set_num_threads(th)
    out[th] = linear_rows(sizes(False))
print(json.dumps(out))
