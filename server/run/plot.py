"""A run's plot: tau and per-head accuracy per round, and client epsilon per round (from summary.json)."""

from __future__ import annotations

import json
from pathlib import Path

from server.run.folder import RunFolder


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write runs/<run-id>/plot.png from its summary.json and round records; returns the file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    summary = json.loads(RunFolder(run_dir).summary.read_text())
    rounds = summary["rounds"]
    xs = [r["round"] for r in rounds]
    fig, (ax_tau, ax_acc, ax_eps) = plt.subplots(1, 3, figsize=(15, 4))
    taus = [r["metrics"]["tau"] for r in rounds]
    client_taus = [r["metrics"].get("client_tau") for r in rounds]
    if any(t is not None for t in taus):
        ax_tau.plot(xs, [t if t is not None else float("nan") for t in taus], "o-", label="server (held-out stdlib)")
    if any(t is not None for t in client_taus):
        ax_tau.plot(xs, [t if t is not None else float("nan") for t in client_taus], "s--", label="clients (local)")
    ax_tau.set(title="AMS-LD tau (tokens per base forward)", xlabel="round")
    if ax_tau.get_lines():
        ax_tau.legend(loc="best", fontsize=8)
    else:
        ax_tau.text(0.5, 0.5, "tau not measured", ha="center", va="center", transform=ax_tau.transAxes)
    num_heads = max((len(r["metrics"]["head_accuracy"]) for r in rounds), default=0)
    for k in range(num_heads):
        ax_acc.plot(xs, [r["metrics"]["head_accuracy"][k] for r in rounds], "o-", label=f"head {k + 1}")
    ax_acc.set(title="per-head top-1 accuracy (server eval)", xlabel="round", ylim=(0, 1))
    ax_acc.legend(loc="best", fontsize=8)
    eps_max = [r["privacy"]["epsilon_max"] for r in rounds]
    eps_mean = [r["privacy"]["epsilon_mean"] for r in rounds]
    if any(e is not None for e in eps_max):
        ax_eps.plot(xs, [e if e is not None else float("nan") for e in eps_max], "o-", label="max over clients")
        ax_eps.plot(xs, [e if e is not None else float("nan") for e in eps_mean], "s--", label="mean over clients")
        target = summary["run"]["config"].get("dp-target-epsilon") if summary.get("run") else None
        if target:
            ax_eps.axhline(target, color="red", lw=0.8, label=f"target {target:g}")
        ax_eps.set(
            title=f"client epsilon (delta={rounds[-1]['privacy']['delta']:g})" if rounds else "epsilon", xlabel="round"
        )
        ax_eps.legend(loc="best", fontsize=8)
    else:
        ax_eps.text(0.5, 0.5, "no DP: epsilon unbounded", ha="center", va="center", transform=ax_eps.transAxes)
        ax_eps.set(title="client epsilon", xlabel="round")
    for axis in (ax_tau, ax_acc, ax_eps):
        axis.set_xticks(xs)
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    out = Path(out) if out else RunFolder(run_dir).plot
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
