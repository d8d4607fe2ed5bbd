"""Run a simulation scenario: `python -m simulations.run iid-10` (see simulations/scenarios/*.toml).

A scenario is a TOML file with a `[federation]` table (num-supernodes, client-resources-num-cpus: the
simulation's `--federation-config`), a `[run-config]` table (overrides of [tool.flwr.app.config]) and
an optional `[faults]` table (simulations/faults.py: clients that crash mid-round, injected by a mod
the product's ClientApp does not have); `base = "other"` inherits another scenario. The runner
starts a private local SuperLink (its own ports and FLWR_HOME, see server/superlink.py), submits
`flwr run . local --run-config ... --federation-config ... --stream` (with faults: `flwr run` of a
copy of the app whose ClientApp carries them), waits for the run to end and stops every process it started.
The ServerApp writes runs/<run-id>/ (summary.json, rounds/, checkpoints/, plot.png); the runner adds
flwr.log, prints the server's privacy verdict as soon as its plan is written (before round 1) and the
per-round table. A population scenario (partitioning = "user") has its users'
features cached first (simulations/population.py), so its clients train without the base's layers.

Options: --set k=v (more run-config overrides, TOML values), --rounds N, --clients N (simulated clients;
the run waits for all of them), --run-id ID, --inprocess (no SuperLink/Ray: the same ServerApp loop and ClientApp over simulations.inprocess.InProcessGrid,
clients one after another), --timeout SECONDS.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
import tomllib
from datetime import datetime, timezone
from pathlib import Path

from common.errors import FedLookaheadError
from common.federation.config import DEFAULTS, FedConfig
from server.run.folder import RunFolder
from simulations.faults import FaultPlan, faulty_app_copy, faulty_client_app, write_plan

REPO = Path(__file__).resolve().parents[1]
SCENARIOS = Path(__file__).resolve().parent / "scenarios"


def load_scenario(name: str) -> dict:
    path = SCENARIOS / f"{name}.toml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in SCENARIOS.glob("*.toml")))
        raise SystemExit(f"error: no scenario {name!r} (known: {known})")
    data = tomllib.loads(path.read_text())
    if "base" in data:
        parent = load_scenario(data["base"])
        data = {
            "description": data.get("description", parent.get("description", "")),
            "federation": {**parent.get("federation", {}), **data.get("federation", {})},
            "run-config": {**parent.get("run-config", {}), **data.get("run-config", {})},
            "faults": {**parent.get("faults", {}), **data.get("faults", {})},
        }
    return data


def scenario_settings(
    scenario: dict, sets: list[str], *, rounds: int | None = None, clients: int | None = None
) -> tuple[dict, dict]:
    """(run config, federation config) of a scenario after the command line's overrides."""
    run_config = dict(scenario.get("run-config", {}))
    run_config.update(parse_sets(sets))
    for key in ("init-heads", "base-model-dir", "resume-from", "data-source"):  # the app runs in another folder
        value = run_config.get(key)
        if isinstance(value, str) and value and Path(value).exists():
            run_config[key] = str(Path(value).resolve())
    if rounds:
        run_config["num-server-rounds"] = rounds
    federation = dict(scenario.get("federation", {}))
    if clients:
        federation["num-supernodes"] = clients
        run_config["min-available-clients"] = clients  # round 1 waits for all of them
        wanted = run_config.get("min-train-clients", DEFAULTS["min-train-clients"])
        run_config["min-train-clients"] = min(int(wanted), clients)
    return run_config, federation


def parse_sets(values: list[str]) -> dict:
    out = {}
    for item in values:
        key, _, raw = item.partition("=")
        out[key.strip()] = tomllib.loads(f"v = {raw.strip()}")["v"]
    return out


def print_table(summary: dict) -> None:
    print(f"\nrun {summary['run']['run_id']}: {summary['run']['status']}")
    print(
        f"{'round':>5} {'tau':>6} {'c-tau':>6} {'acc (server eval, heads 1..K)':<32} {'loss':>7} "
        f"{'smp':>4} {'ok':>3} {'drop':>4} {'rej':>3} {'eps max':>8} {'s':>6} {'bytes/cl':>9}"
    )
    for r in summary["rounds"]:
        m, p, pr = r["metrics"], r["participation"], r["privacy"]
        tau = f"{m['tau']:.3f}" if m["tau"] is not None else "-"
        ctau = f"{m['client_tau']:.3f}" if m.get("client_tau") is not None else "-"
        acc = " ".join(f"{a:.3f}" for a in m["head_accuracy"])
        eps = f"{pr['epsilon_max']:.3f}" if pr["epsilon_max"] is not None else "inf"
        print(
            f"{r['round']:>5} {tau:>6} {ctau:>6} {acc:<32} {m['train_loss']:>7.3f} {p['sampled']:>4} "
            f"{p['succeeded']:>3} {p['dropped']:>4} {len(p['rejected']):>3} {eps:>8} {r['wall_seconds']:>6.0f} "
            f"{r['bytes_per_client']:>9}"
        )


def main(argv: list[str] | None = None) -> int:
    known = ", ".join(sorted(p.stem for p in SCENARIOS.glob("*.toml")))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", help=f"one of: {known}")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a run-config override (TOML value)"
    )
    parser.add_argument("--rounds", type=int, help="num-server-rounds")
    parser.add_argument(
        "--clients", type=int, help="simulated clients (num-supernodes); clients per round: --set clients-per-round=M"
    )
    parser.add_argument("--run-id", help="default: <scenario>-<UTC time>")
    parser.add_argument("--run-dir", default=str(REPO / "runs"), help="where runs/<run-id>/ and fedla.db go")
    parser.add_argument("--inprocess", action="store_true", help="no SuperLink: clients one after another")
    parser.add_argument("--timeout", type=float, default=3 * 3600, help="seconds before the run is stopped")
    args = parser.parse_args(argv)

    scenario = load_scenario(args.scenario)
    run_config, federation = scenario_settings(scenario, args.set, rounds=args.rounds, clients=args.clients)
    run_id = args.run_id or f"{args.scenario}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
    run_root = Path(args.run_dir).resolve()
    run_dir = run_root / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    folder = RunFolder(run_dir)
    run_config.update({"run-id": run_id, "run-dir": str(run_root)})
    run_config.setdefault("client-state-dir", str(run_dir / "client-state"))
    print(f"scenario {args.scenario}: {scenario.get('description', '')}\nrun {run_id} -> {run_dir}", flush=True)
    num_nodes = int(federation.get("num-supernodes", 2))
    try:
        faults = FaultPlan.from_table(scenario.get("faults", {}))
        warn_if_secagg_cannot_survive(faults, run_config, num_nodes)
    except FedLookaheadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    stop_announcing = threading.Event()
    threading.Thread(target=announce_verdict, args=(folder, stop_announcing), daemon=True).start()
    if run_config.get("partitioning") == "user":  # a population: every user's features once, before round 1
        from simulations.population import prepare_population

        prepared = prepare_population(run_config, num_nodes)
        print(f"population: {prepared.users} users' features ready in {prepared.seconds:.0f}s", flush=True)
    if args.inprocess:
        code = _run_inprocess(run_config, num_nodes, run_dir, faults)
    else:
        from server.superlink import SuperLink

        app_dir = REPO
        if faults.injects:
            write_plan(folder, faults)
            app_dir = faulty_app_copy(REPO, run_dir / "app")
        with SuperLink.for_simulation(log_dir=run_dir, cwd=REPO) as link:
            code, _ = link.submit(
                app_dir, run_config, federation, log_path=folder.log, timeout=args.timeout, echo=False
            )
    stop_announcing.set()
    seconds = time.perf_counter() - started
    summary_file = folder.summary
    if not summary_file.is_file():
        print(f"error: no summary written (exit code {code}); see {folder.log}", file=sys.stderr)
        return 1
    summary = json.loads(summary_file.read_text())
    if not folder.plot.is_file():
        from server.run.plot import plot_run

        plot_run(run_dir)
    (run_dir / "scenario.json").write_text(
        json.dumps(
            {
                "scenario": args.scenario,
                "federation": federation,
                "run_config": run_config,
                "wall_seconds": seconds,
                "mode": "inprocess" if args.inprocess else "flwr run",
            },
            indent=2,
        )
    )
    print_table(summary)
    print(f"\nwall time {seconds:.0f}s; summary {summary_file}; plot {folder.plot}")
    return 0 if code == 0 and summary["run"]["status"] == "finished" else 1


def announce_verdict(folder: RunFolder, stop: threading.Event, poll_seconds: float = 0.5) -> None:
    """Print the privacy plan's one-line verdict (server/federation.py privacy_plan) once run.json holds it:
    the server writes it before round 1, so the researcher reads it before waiting on a run that will not learn."""
    while not stop.is_set():
        try:
            plan = json.loads(folder.run_file.read_text())["plan"]
        except (OSError, ValueError, KeyError):  # not written yet, mid-write, or the plan not in it yet
            stop.wait(poll_seconds)
            continue
        verdict = plan.get("privacy", {}).get("verdict")
        if verdict:
            print(f"privacy plan: {verdict}", flush=True)
        return


def warn_if_secagg_cannot_survive(faults: FaultPlan, run_config: dict, num_nodes: int) -> None:
    """Raises FedLookaheadError on a run config the ServerApp would refuse (checked here, before the run)."""
    from server.federation import check_federation

    if not faults.injects:
        return
    config = FedConfig.from_mapping(run_config)
    if not config.secagg:
        return
    plan = check_federation(config, num_nodes)
    sampled, tolerated = plan["clients_per_round"], plan["secagg"]["tolerated_dropouts"]
    drops = int(round(faults.dropout_rate * sampled))
    if drops > tolerated:
        print(
            f"warning: dropout-rate {faults.dropout_rate:.2f} drops about {drops} of {sampled} clients, more than "
            f"the {tolerated} SecAgg+ tolerates: those rounds will abort",
            file=sys.stderr,
        )


def _run_inprocess(run_config: dict, num_nodes: int, run_dir: Path, faults: FaultPlan) -> int:
    from flwr.app import Context, RecordDict

    from client.client_app import app as client_app
    from server.federation import run_federation
    from simulations.inprocess import InProcessGrid

    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        handlers=[logging.FileHandler(run_dir / "inprocess.log"), logging.StreamHandler()],
    )
    grid = InProcessGrid(faulty_client_app(faults) if faults.injects else client_app, num_nodes, run_config)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)
    run_federation(grid, context, FedConfig.from_mapping(run_config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
