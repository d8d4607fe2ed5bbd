"""The privacy-utility benchmark's curve, read from the JSON that simulations/privacy_utility/ leaves in
each run's folder (the run page plots it)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from server.run.folder import PRIVACY_UTILITY_FILE, RunFolder


def privacy_utility_curve(run_folders: list[Path], run_id: str) -> dict | None:
    """The curve of the privacy-utility benchmark (simulations/privacy_utility/) that left its JSON in
    this run's folder: tau at each epsilon, the references, and where this run sits. None: no benchmark
    JSON, or one that cannot be read (the page then simply has no such plot)."""
    for folder in run_folders:
        try:
            result = json.loads(RunFolder(folder).privacy_utility.read_text())
            dp = sorted(((float(eps), entry) for eps, entry in result.get("dp", {}).items()), key=lambda p: p[0])
            curve = {
                "epsilon": [eps for eps, _ in dp],
                "dp": [entry["tau_heads_only"] for _, entry in dp],
                "references": {
                    name: result[name]["tau_heads_only"]
                    for name in ("public_only", "federated_nodp", "central_nodp")
                    if name in result
                },
                "clients": result.get("clients"),
                "rounds": result.get("rounds"),
                "this_run": None,
            }
            entries = [("federated_nodp", None, result.get("federated_nodp"))]
            entries += [("dp", eps, entry) for eps, entry in dp]
            for kind, eps, entry in entries:
                if entry and Path(str(entry.get("run_dir", ""))).name == run_id:
                    curve["this_run"] = {"kind": kind, "epsilon": eps, "tau": entry["tau_heads_only"]}
            return curve
        except FileNotFoundError:
            continue
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            logging.getLogger(__name__).warning("unreadable %s in %s: %s", PRIVACY_UTILITY_FILE, folder, exc)
            return None
    return None
