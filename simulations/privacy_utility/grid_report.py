"""The population grid's table and plot: heads-only tau per (eps, cohort, population), emulated points marked."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def grid_entries(result: dict[str, Any]) -> list[tuple[str, str, str, dict[str, Any]]]:
    """(eps, cohort, population, entry) for every measured grid point."""
    return [
        (eps, cohort, population, entry)
        for eps, by_cohort in result.get("user_dp", {}).items()
        for cohort, by_population in by_cohort.items()
        for population, entry in by_population.items()
    ]


def grid_table(result: dict[str, Any]) -> str:
    public, nodp = result["public_only"]["tau_heads_only"], result["federated_nodp"]["tau_heads_only"]
    lines = [
        f"population {result['population_real']} real users, {result['rounds']} rounds, "
        f"{result['signal_clients']} real clients' signal a round",
        f"public_only tau {public:.3f} | federated_nodp {nodp:.3f} (gain {nodp - public:+.3f})",
        "eps | cohort | population | z | tau | kept | snr | forecast | outcome | agrees",
    ]
    for eps, cohort, population, e in grid_entries(result):
        mark = " (emulated)" if e["emulated"] else ""
        lines.append(
            f"{eps} | {cohort} | {population}{mark} | {e['noise_multiplier']:.3f} | {e['tau_heads_only']:.3f} | "
            f"{e['kept_share_of_gain']:.2f} | {e['signal_to_noise']:.3f} | {e['forecast']} | {e['outcome']} | "
            f"{'yes' if e['verdict_agrees'] else 'NO'}"
        )
    if "true_run" in result:
        t = result["true_run"]
        lines.append(
            f"true run: {t['cohort']} clients x {t['rounds']} rounds, eps {t['epsilon']:g}: tau {t['tau_heads_only']:.3f}; "
            f"emulated {t['emulated_tau_heads_only']:.3f} (seeds {', '.join(f'{v:.3f}' for v in t['emulated_seeds'])}), "
            f"{'within' if t['within_spread'] else 'OUTSIDE'} the spread"
        )
    for eps, e in result.get("example_dp", {}).items():
        lines.append(f"example-level DP-SGD eps {eps}: tau {e['tau_heads_only']:.3f}")
    return "\n".join(lines)


def plot_grid(result: dict[str, Any], path: Path) -> Path:
    """Heads-only tau against cohort, one line per (eps, population); emulated points hollow and labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    lines: dict[tuple[str, str], list[tuple[int, dict[str, Any]]]] = {}
    for eps, cohort, population, entry in grid_entries(result):
        lines.setdefault((eps, population), []).append((int(cohort), entry))
    for (eps, population), points in sorted(lines.items()):
        points.sort(key=lambda p: p[0])
        xs, ys = [p[0] for p in points], [p[1]["tau_heads_only"] for p in points]
        (line,) = ax.plot(
            xs,
            ys,
            "-" if population == str(result["population_real"]) else "--",
            label=f"eps {eps}, population {population}",
        )
        for x, y, (_, entry) in zip(xs, ys, points):
            ax.plot([x], [y], "o", color=line.get_color(), fillstyle="none" if entry["emulated"] else "full")
    for name, style in (("public_only", "k:"), ("federated_nodp", "b-.")):
        ax.axhline(result[name]["tau_heads_only"], color=style[0], linestyle=style[1:], label=name)
    if "true_run" in result:
        t = result["true_run"]
        ax.plot(
            [t["cohort"]],
            [t["tau_heads_only"]],
            "r*",
            markersize=12,
            label=f"true run ({t['rounds']} rounds, through the apps)",
        )
    ax.set_xscale("log", base=2)
    ax.set(
        xlabel="clients per round (cohort)",
        ylabel="heads-only tau, users' held-out code",
        title=f"user-level DP, {result['rounds']} rounds; hollow = emulated (signal of "
        f"{result['signal_clients']} real clients, noise of the cohort)",
    )
    ax.title.set_fontsize(9)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
