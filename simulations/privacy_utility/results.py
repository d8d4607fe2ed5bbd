"""The benchmark's JSON: its rounding, the curve it leaves in each run folder it made (the dashboard
plots that), and the summary table printed at the end."""

from __future__ import annotations

import math
from pathlib import Path

from server.run.curve import REFERENCES, PrivacyUtilityCurve


def round_floats(value):
    if isinstance(value, float):  # 5 significant digits (a delta of 1e-5 must survive)
        return float(f"{value:.5g}") if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: round_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [round_floats(v) for v in value]
    return value


def federated_run_dirs(result: dict) -> list[Path]:
    """The run folders of the federated configurations in a result (those that exist)."""
    entries = [result.get("federated_nodp") or {}]
    entries += list(result.get("dp", {}).values()) + list(result.get("user_dp", {}).values())
    return [Path(e["run_dir"]) for e in entries if e.get("run_dir") and Path(e["run_dir"]).is_dir()]


def curve_for_run(result: dict, run_dir: Path) -> PrivacyUtilityCurve:
    """The example-level DP curve of a result, with `run_dir`'s own point on it."""
    dp = sorted(((float(eps), entry) for eps, entry in result.get("dp", {}).items()), key=lambda p: p[0])
    this_run = None
    for kind, eps, entry in [("federated_nodp", None, result.get("federated_nodp"))] + [("dp", e, x) for e, x in dp]:
        if entry and Path(str(entry.get("run_dir", ""))).name == run_dir.name:
            this_run = {"kind": kind, "epsilon": eps, "tau": entry["tau_heads_only"]}
    return PrivacyUtilityCurve(
        epsilon=[eps for eps, _ in dp],
        dp=[entry["tau_heads_only"] for _, entry in dp],
        references={name: result[name]["tau_heads_only"] for name in REFERENCES if name in result},
        clients=result.get("clients"),
        rounds=result.get("rounds"),
        this_run=this_run,
    )


def table(result: dict) -> str:
    rows = [("config", "eps (max over clients)", "tau heads-only", "acc heads 1..4")]

    def add(name: str, entry: dict) -> None:
        eps = entry.get("privacy", {}).get("epsilon_max")
        user = entry.get("privacy", {}).get("user_dp")
        eps_text = f"{user['epsilon']:.2f} (user level)" if user else ("-" if eps is None else f"{eps:.2f}")
        rows.append((name, eps_text, f"{entry['tau_heads_only']:.3f}", " / ".join(f"{a:.3f}" for a in entry["acc"])))

    for name in ("public_only", "central_nodp", "federated_nodp"):
        if name in result:
            add(name, result[name])
    for eps, entry in result.get("dp", {}).items():
        add(f"dp eps {eps}", entry)
    for eps, entry in result.get("user_dp", {}).items():
        add(f"user-level dp eps {eps}", entry)
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    for trial in result.get("tricks", {}).get("comparison", []):
        lines.append(
            f"trick {trial['trick']}: val tau {trial['val_tau_heads_only']:.3f}, test tau "
            f"{trial['tau_heads_only']:.3f}, {'kept' if trial['kept'] else 'dropped'}"
        )
    return "\n".join(lines)
