"""Plots bench/results/datapath.json: per-packet cost against the number of
installed Services, one line per case. Called by `cargo xtask bench`."""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

results_dir = sys.argv[1]
rows = json.load(open(f"{results_dir}/datapath.json"))
services = [r["services"] for r in rows]
cases = [c["case"] for c in rows[0]["cases"]]
fig, ax = plt.subplots(figsize=(8, 5))
for case in cases:
    ns = [next(c["single_ns"] for c in r["cases"] if c["case"] == case) for r in rows]
    ax.plot(services, ns, marker="o", label=case)
ax.set_xscale("log")
ax.set_xlabel("Services installed (10 endpoints each)")
ax.set_ylabel("ns per packet (median, BPF_PROG_TEST_RUN)")
ax.set_title("ebpf-proxy tc_ingress per-packet cost")
ax.set_ylim(bottom=0)
ax.grid(True, which="both", alpha=0.3)
ax.legend()
fig.tight_layout()
fig.savefig(f"{results_dir}/datapath.png", dpi=110)
print(f"wrote {results_dir}/datapath.png")
