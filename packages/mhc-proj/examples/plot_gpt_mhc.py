"""Loss curves and H_res's doubly-stochastic error from gpt_mhc.py's JSON, as a PNG.

python packages/mhc-proj/examples/plot_gpt_mhc.py OUT/gpt_mhc.json docs/img/mhc-proj-gpt.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LABELS = {"birkhoff": "exact projection", "sinkhorn": "Sinkhorn-20"}


def smooth(values, k=20):
    out, acc = [], []
    for v in values:
        acc.append(v)
        acc = acc[-k:]
        out.append(sum(acc) / len(acc))
    return out


def main(argv=None):
    src, dst = (argv or sys.argv[1:])[:2]
    doc = json.loads(open(src).read())
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, run in doc["runs"].items():
        label = LABELS.get(name, name)
        steps = range(1, len(run["loss"]) + 1)
        (line,) = ax1.plot(steps, smooth(run["loss"]), label=f"{label} train (20-step mean)")
        ax1.plot(
            run["val_step"],
            run["val_loss"],
            "o--",
            color=line.get_color(),
            ms=3,
            label=f"{label} validation",
        )
        ax2.semilogy(steps, run["marginal_max"], color=line.get_color(), label=f"{label}: max")
        ax2.semilogy(
            steps, run["marginal_median"], ":", color=line.get_color(), label=f"{label}: median"
        )
    ax2.axhline(1e-5, color="gray", lw=0.8, ls="--", label="1e-5")
    ax1.set(xlabel="step", ylabel="cross-entropy (nats / byte)", title="loss")
    ax2.set(
        xlabel="step",
        ylabel="L1 marginal error of H_res",
        title="H_res over every token and layer, per step",
    )
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    env = doc.get("env", {})
    fig.suptitle(
        f"byte-level GPT with mHC (n = {doc['config']['streams']}), {env.get('device')}", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    main()
