"""Plots the benchmark results in bench/results: datapath.png (per-packet cost
against the number of installed Services, one panel per hook, one line per
case), e2e.png and nodeport.png (connections per second against the number of
Services, one line per mode). Called by `cargo xtask bench`; a result file that
is missing is skipped."""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

results_dir = sys.argv[1]


def load(name):
    path = f"{results_dir}/{name}.json"
    return json.load(open(path)) if os.path.exists(path) else None


def style(ax, title, xlabel="Services installed"):
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")


def save(fig, name):
    fig.tight_layout()
    fig.savefig(f"{results_dir}/{name}.png", dpi=110)
    print(f"wrote {results_dir}/{name}.png")


rows = load("datapath")
# Earlier runs wrote the rows alone; now they sit beside the load report.
if isinstance(rows, dict):
    rows = rows["rows"]
if rows:
    hooks = list(dict.fromkeys(r.get("hook", "tc") for r in rows))
    # One colour per case across the panels (tc_ingress6 has no conntrack-pair case),
    # from 20 of them: the default cycle's 10 would repeat past the tenth case.
    all_cases = list(dict.fromkeys(c["case"] for r in rows for c in r["cases"]))
    colours = plt.get_cmap("tab20")
    fig, axes = plt.subplots(1, len(hooks), figsize=(6 * len(hooks), 5), squeeze=False)
    for ax, hook in zip(axes[0], hooks):
        of_hook = [r for r in rows if r.get("hook", "tc") == hook]
        services = [r["services"] for r in of_hook]
        for case in [c["case"] for c in of_hook[0]["cases"]]:
            ns = [next(c["single_ns"] for c in r["cases"] if c["case"] == case) for r in of_hook]
            ax.plot(services, ns, marker="o", label=case,
                    color=colours(all_cases.index(case) % colours.N))
        ax.set_ylabel("ns per packet (median of single runs, BPF_PROG_TEST_RUN)")
        program = {"tc6": "tc_ingress6 (IPv6)", "xdp6": "xdp_ingress6 (IPv6)"}.get(hook, f"{hook}_ingress")
        style(ax, f"ebpf-proxy {program} per-packet cost",
              "Services installed (10 endpoints each)")
    save(fig, "datapath")

for name, title, keep in [
    ("e2e", "ClusterIP, short TCP connections (client pod, routed node)",
     lambda r: r.get("proto") == "tcp" and r.get("client", "pod") == "pod"
     and r.get("family", "ipv4") == "ipv4" and r.get("exchange", "new") == "new"),
    ("nodeport", "NodePort, short TCP connections (outside client, SNAT to node B)",
     lambda r: True),
]:
    data = load(name)
    if not data:
        continue
    results = [r for r in data["results"] if keep(r)]
    fig, ax = plt.subplots(figsize=(8, 5))
    for label in dict.fromkeys(r["label"] for r in results):
        points = sorted((r["services"], r["per_second"]) for r in results if r["label"] == label)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    ax.set_ylabel("connections per second")
    style(ax, title)
    save(fig, name)
