"""Plot time to first token against prompt length, from bench/results/ttft.json.

One panel per model: recompute (nothing cached), mlx-lm `load_prompt_cache` of a file, and
kvstore's disk and memory tiers, with 90% of the prompt cached (solid) and 50% (dashed).

    python bench/plot.py  ->  bench/results/ttft.png
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import common as C  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402

METHODS = [("kvstore_memory", "kvstore, memory tier", "tab:green"),
           ("kvstore_disk", "kvstore, disk (page cache warm)", "tab:blue"),
           ("mlx_lm_file", "mlx-lm load_prompt_cache (one file)", "tab:orange")]


def plot(data: dict, out) -> None:
    results = [r for r in data["results"] if r["points"]]
    fig, axes = plt.subplots(1, len(results), figsize=(6.2 * len(results), 4.6), squeeze=False)
    for ax, res in zip(axes[0], results):
        pts = res["points"]
        lengths = [p["length"] for p in pts]
        ax.plot(lengths, [p["recompute_s"] for p in pts], "o-", color="black", label="recompute (0% cached)")
        fractions = sorted({f for p in pts for f in p["fractions"]}, key=float, reverse=True)
        for f in fractions:
            style = "-" if float(f) >= 0.9 else "--"
            for key, label, color in METHODS:
                xs = [p["length"] for p in pts if f in p["fractions"]]
                ys = [p["fractions"][f][key]["ttft_s"] for p in pts if f in p["fractions"]]
                ax.plot(xs, ys, style, marker="o", markersize=3.5, color=color,
                        label=f"{label}, {int(float(f) * 100)}% cached")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(lengths, [f"{n // 1024}k" if n >= 1024 else str(n) for n in lengths])
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel("time to first token (s)")
        ax.set_title(res["model"], fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"Time to first token, CPU ({data['machine']['cores']} cores), BLAS: {data['blas']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    data = json.loads((C.RESULTS / "ttft.json").read_text())
    out = C.RESULTS / "ttft.png"
    plot(data, out)
    print(out)


if __name__ == "__main__":
    main()
