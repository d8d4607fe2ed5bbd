"""What a device's state folder says: `fedla client status`, and `fedla client forget`.

Both read or change only the state folder (client.state describes its layout); neither needs the
daemon, the network or the base.

`status` shows the device's lifetime epsilon against its budget (from the privacy ledger, at the
device's delta), the runs it joined and its last round, the newest heads it keeps, where everything
is stored, and the exact `fedla generate` command and endpoint URL that use those heads. A ledger
that cannot be trusted is shown as such (the device does not train until its owner resets it) and
makes the command exit 1: a lost ledger never reads as "nothing spent".

`forget` deletes the device's private text caches (chunks/, the tokenised files, and features/, the
base's features of them) and keeps the privacy ledger and its marker (forgetting spending would
give the budget back) and the global heads (they are the federation's, aggregated under DP, not
this device's text). Deleting the whole state folder would also delete the ledger: don't.
"""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path
from typing import Any

from client.endpoint.defaults import DEFAULT_PORT
from client.kept_heads import latest_heads
from client.node_config import BASE_MODEL_DIR_KEY, DATA_DIR_KEY, HEADS_DIR_KEY, STATE_DIR_KEY
from client.state import StateDir, read_node_config
from common.errors import FedLookaheadError
from common.federation.protocol import SKIPPED
from common.model.int8_kernels import cached_reports, cpu_info, describe_cpu


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def _daemon_alive(info: dict | None) -> bool:
    """The daemon that wrote daemon.json still runs (its pid is alive and is a fedla process)."""
    if not info or info.get("status") == "stopped" or not isinstance(info.get("pid"), int):
        return False
    try:
        cmdline = Path(f"/proc/{info['pid']}/cmdline").read_bytes()
    except OSError:
        return False
    return b"fedla" in cmdline or b"common.cli.app" in cmdline


def _runs(state: Path) -> list[dict]:
    """The runs this device took part in, oldest first, from events.jsonl."""
    runs: dict[Any, dict] = {}
    try:
        lines = StateDir(state).events.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            event = json.loads(line)
            run = event["run"]
        except (ValueError, KeyError, TypeError):
            continue
        entry = runs.setdefault(
            run,
            {
                "run": run,
                "name": None,
                "rounds": set(),
                "trained": set(),
                "declined": set(),
                "heads_version": None,
                "finished": False,
                "last_time": None,
            },
        )
        server_round = event.get("round")
        if server_round is not None:
            entry["rounds"].add(server_round)
        entry["last_time"] = event.get("time", entry["last_time"])
        kind = event.get("event")
        if kind == "train-start" and event.get("fedla_run"):
            entry["name"] = event["fedla_run"]
        elif kind == "train-done":
            (entry["declined"] if event.get("metrics", {}).get(SKIPPED) else entry["trained"]).add(server_round)
        elif kind == "heads":
            entry["heads_version"] = max(int(event.get("version", 0)), entry["heads_version"] or 0)
        elif kind == "eval" and event.get("final"):
            entry["finished"] = True
    out = []
    for entry in runs.values():
        rounds = sorted(r for r in entry["rounds"] if isinstance(r, (int, float)))
        out.append(
            {
                **entry,
                "rounds": len(rounds),
                "last_round": int(rounds[-1]) if rounds else None,
                "trained": len(entry["trained"]),
                "declined": len(entry["declined"]),
            }
        )
    return sorted(out, key=lambda e: e["last_time"] or 0)


def _privacy(state: Path, node_config: dict) -> dict:
    from client.training.dp import epsilon_of
    from client.training.floor import DeviceFloor
    from client.training.ledger import load_ledger

    out: dict[str, Any] = {"ledger": str(StateDir(state).ledger), "marker": str(StateDir(state).trained_marker)}
    try:
        floor = DeviceFloor.from_node_config({**node_config, STATE_DIR_KEY: str(state)})
    except FedLookaheadError as exc:
        floor = DeviceFloor(state)
        out["floor_error"] = str(exc)
    out.update(budget=floor.budget_epsilon, delta=floor.delta)
    try:
        ledger = load_ledger(state)
    except FedLookaheadError as exc:
        out.update(trusted=False, error=str(exc), epsilon=None, remaining=None)
        return out
    epsilon = epsilon_of(ledger.history(), floor.delta)
    out.update(
        trusted=True,
        epsilon=epsilon,
        remaining=max(0.0, floor.budget_epsilon - epsilon),
        steps=ledger.steps,
        runs_trained=sorted(ledger.runs),
        first_trained=ledger.first_trained,
        resets=len(ledger.resets),
    )
    return out


def _machine() -> dict:
    """This CPU, and the int8 kernel an unforced int8 load picks on it, as the newest one measured (None: no
    int8 load yet; a name of None: no kernel is exact here)."""
    reports = cached_reports()
    if not reports:
        return {"cpu": cpu_info(), "int8_kernel": None}
    report = reports[0]
    return {"cpu": report.cpu, "int8_kernel": {"name": report.fastest, "one_token_ms": report.one_token_ms}}


def device_status(state_dir: Path) -> dict:
    """Everything `fedla client status` shows, as data; FedLookaheadError when there is no such folder."""
    state = state_dir.expanduser()
    if not state.is_dir():
        raise FedLookaheadError(f"state folder not found: {state} (give the daemon's --state-dir)")
    state = state.resolve()
    node_config = read_node_config(state)
    daemon = _read_json(StateDir(state).daemon_status)
    kept = latest_heads(state)
    heads = None
    if kept is not None:
        folder, meta = kept
        heads = {
            "path": str(StateDir(state).latest_heads),
            "folder": str(folder),
            "version": meta.get("version"),
            "run": meta.get("run"),
            "round": meta.get("round"),
            "sha256": meta.get("sha256"),
            "base_fingerprint": meta.get("base_fingerprint"),
        }
    runs = _runs(state)
    if heads is not None:  # the run's FedLookahead name (the server's runs/<run-id>), when the device trained in it
        heads["run_name"] = next((r["name"] for r in runs if r["run"] == heads["run"] and r["name"]), heads["run"])
    base = str(node_config.get(BASE_MODEL_DIR_KEY, "") or "")
    generate = ["fedla", "generate", "--state-dir", str(state)] + (["--base", base] if base else [])
    generate += ["--prompt", "def parse_header(line):"]
    serve_url = daemon.get("serve_url") if daemon and _daemon_alive(daemon) else None
    serve = ["fedla", "client", "serve", "--state-dir", str(state)] + (["--base", base] if base else [])
    return {
        "state_dir": str(state),
        "daemon": {
            "running": _daemon_alive(daemon),
            "status": (daemon or {}).get("status"),
            "pid": (daemon or {}).get("pid"),
            "superlink": (daemon or {}).get("superlink"),
            "node_id": (daemon or {}).get("node_id"),
        },
        "privacy": _privacy(state, node_config),
        "machine": _machine(),
        "runs": [{k: v for k, v in run.items() if k != "last_time"} for run in runs],
        "last_round": ({"run": runs[-1]["name"] or runs[-1]["run"], "round": runs[-1]["last_round"]} if runs else None),
        "heads": heads,
        "paths": {
            "state": str(state),
            "privacy ledger": str(StateDir(state).ledger),
            "trained-once marker": str(StateDir(state).trained_marker),
            "global heads": str(StateDir(state).heads),
            "published heads": str(node_config.get(HEADS_DIR_KEY) or "(not published)"),
            "chunks (private text)": str(StateDir(state).chunks),
            "features (private)": str(StateDir(state).features),
            "round events": str(StateDir(state).events),
            "node config": str(StateDir(state).node_config),
            "supernode log": str(StateDir(state).supernode_log),
            "flower home": str(StateDir(state).flwr_home),
            "data folder": str(node_config.get(DATA_DIR_KEY) or "(unknown: the daemon has not run here)"),
            "base": base or "(the embedded default)",
        },
        "sizes": {name: _size(state / name) for name in StateDir.PRIVATE_CACHES},
        "generate": shlex.join(generate),
        "endpoint": serve_url or f"http://127.0.0.1:{DEFAULT_PORT}/v1/completions",
        "endpoint_running": bool(serve_url),
        "serve": shlex.join(serve),
    }


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


def format_status(status: dict) -> str:
    """The human-readable `fedla client status`."""
    privacy = status["privacy"]
    daemon = status["daemon"]
    lines = [f"device state: {status['state_dir']}"]
    if daemon["running"]:
        lines.append(
            f"daemon: running (pid {daemon['pid']}, {daemon['status']}), SuperLink {daemon['superlink']}, "
            f"node {daemon['node_id']}"
        )
    else:
        lines.append("daemon: not running" + (f" (last: {daemon['status']})" if daemon["status"] else ""))
    if privacy["trusted"]:
        lines.append(
            f"privacy: lifetime epsilon {privacy['epsilon']:.3f} of budget {privacy['budget']:g} "
            f"(delta {privacy['delta']:g}); {privacy['remaining']:.3f} left; {privacy['steps']} DP-SGD steps "
            f"over {len(privacy['runs_trained'])} run(s)"
            + (f"; ledger reset {privacy['resets']} time(s)" if privacy["resets"] else "")
        )
    else:
        lines.append(f"privacy: lifetime epsilon UNKNOWN, budget {privacy['budget']:g}: {privacy['error']}")
    machine = status["machine"]
    kernel = machine["int8_kernel"]
    lines.append(
        f"cpu: {describe_cpu(machine['cpu'])}; int8 kernel: "
        + (
            "not measured yet (the first --dtype int8 load measures it)"
            if kernel is None
            else "none is exact here (int8 is refused)"
            if kernel["name"] is None
            else f"{kernel['name']} (checked exact here; one token "
            + ", ".join(f"{name} {ms:.1f} ms" for name, ms in kernel["one_token_ms"].items())
            + ")"
        )
    )
    runs = status["runs"]
    if runs:
        lines.append(f"runs joined: {len(runs)}")
        for run in runs:
            name = run["name"] or run["run"]
            lines.append(
                f"  run {name}: {run['rounds']} round(s) seen, trained in {run['trained']}, declined "
                f"in {run['declined']}, last round {run['last_round']}"
                + (f", heads v{run['heads_version']}" if run["heads_version"] else "")
                + (", finished" if run["finished"] else "")
            )
        last = status["last_round"]
        lines.append(f"last round: {last['round']} of run {last['run']}")
    else:
        lines.append("runs joined: none yet")
    heads = status["heads"]
    if heads:
        lines.append(
            f"heads: v{heads['version']} of run {heads['run_name']} (round {heads['round']}, sha256 "
            f"{str(heads['sha256'])[:12]}) in {heads['folder']}"
        )
    else:
        lines.append("heads: none kept yet (a round's evaluation delivers them)")
    lines.append("stored:")
    width = max(len(k) for k in status["paths"])
    for name, path in status["paths"].items():
        size = status["sizes"].get(name.split(" ")[0])
        lines.append(f"  {name:<{width}}  {path}" + (f"  ({_mb(size)})" if size else ""))
    if heads:
        lines.append(f"generate with the newest heads: {status['generate']}")
    else:  # nothing to speed generation up with yet: no command that would only decode plainly
        lines.append("generate: after the first round delivers heads (`fedla generate` without heads decodes plainly)")
    if status["endpoint_running"]:
        lines.append(f"local endpoint (running): {status['endpoint']}")
    else:
        lines.append(f"local endpoint: {status['serve']}  ->  {status['endpoint']}")
    return "\n".join(lines)


def forget(state_dir: Path, yes: bool = False) -> str:
    """Delete the device's private text caches (chunks/, features/); keep the ledger, its marker and the heads.

    Without `yes` nothing changes and FedLookaheadError says what would go. Refused while the daemon
    runs (its rounds would write the caches again). Returns one line saying what was deleted.
    """
    state = state_dir.expanduser()
    if not state.is_dir():
        raise FedLookaheadError(f"state folder not found: {state}")
    targets = [state / name for name in StateDir.PRIVATE_CACHES if (state / name).exists()]
    freed = sum(_size(path) for path in targets)
    if not yes:
        raise FedLookaheadError(
            f"forget deletes this device's tokenised private text and its features in {state} "
            f"({', '.join(p.name + '/' for p in targets) or 'nothing there now'}, {_mb(freed)}); the privacy ledger "
            f"and the global heads stay; add --yes to delete them"
        )
    daemon = _read_json(StateDir(state).daemon_status)
    if _daemon_alive(daemon):
        raise FedLookaheadError(
            f"fedla client is running on {state} (pid {daemon['pid']}): stop it first, "
            "its rounds would write the caches again"
        )
    for path in targets:
        if path.is_symlink() or path.is_file():
            path.unlink()
        else:
            shutil.rmtree(path)
    kept = [name for name in (StateDir.LEDGER, StateDir.TRAINED_MARKER, StateDir.HEADS) if (state / name).exists()]
    return (
        f"forgot {', '.join(p.name + '/' for p in targets) or 'nothing (no private caches)'} in {state} "
        f"({_mb(freed)}); kept {', '.join(kept) or 'nothing else'}"
    )
