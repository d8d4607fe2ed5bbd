"""The curve as a PNG: heads-only tau and head-1 accuracy against epsilon, with the references."""

from __future__ import annotations

from pathlib import Path


def plot(result: dict, path: Path) -> Path:
    """tau (heads only) and head-1 accuracy against epsilon, with the three references as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eps = sorted(result["dp"], key=float)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in (
        (axes[0], "tau_heads_only", "heads-only tau (clients' held-out code)"),
        (axes[1], "acc", "head-1 top-1 accuracy"),
    ):

        def value(entry: dict, key: str = key) -> float:
            return entry[key] if key == "tau_heads_only" else entry[key][0]

        ax.plot(
            [float(e) for e in eps], [value(result["dp"][e]) for e in eps], "o-", label="federated DP (example level)"
        )
        for name, style in (("public_only", "k--"), ("federated_nodp", "b:"), ("central_nodp", "g-.")):
            if name in result:
                ax.axhline(value(result[name]), linestyle=style[1:], color=style[0], label=name)
        shown = [value(result["dp"][e]) for e in eps] + [
            value(result[n]) for n in ("public_only", "central_nodp") if n in result
        ]
        low, high = min(shown), max(shown)
        for name, entry in result.get("user_dp", {}).items():
            if value(entry) >= low - (high - low):
                ax.plot([float(name)], [value(entry)], "r^", label="federated DP (user level)")
            else:  # far below the rest: a note instead of an axis that flattens the curve
                ax.annotate(
                    f"user-level DP eps {name}: {value(entry):.3f} (off scale)",
                    xy=(0.02, 0.02),
                    xycoords="axes fraction",
                    fontsize=7,
                    color="r",
                )
        ax.set_xscale("log", base=2)
        ax.set(xlabel="epsilon (delta 1e-5, all rounds)", title=label)
        ax.legend(fontsize=7)
    fig.suptitle(f"privacy-utility: {result['clients']} clients, {result['rounds']} rounds, SecAgg+")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
