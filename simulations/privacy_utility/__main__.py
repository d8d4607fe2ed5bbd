"""Privacy-utility benchmark: does federated DP fine-tuning beat public-only heads on the clients' own code,
and at what epsilon?

    python -m simulations.privacy_utility --json out.json      # user-level DP at population scale (issue 28)
    python -m simulations.privacy_utility --packages --json out.json --public-heads heads/public   # issue 12

The default is the population grid (simulations/privacy_utility/population_grid.py: user-level DP over
eps x cohort x population on 2,000 real users, emulated points labelled, one true run through the apps).
`--packages` is the earlier benchmark (issue 12), described below:

The scenario (simulations/scenarios/privacy-utility.toml describes the same settings for `simulations.run`):

* public data: the stdlib train split, on which the server's initial heads were trained centrally
  (`--public-heads`; trained here with `common.training.loop.fit_heads` when absent);
* private data: the sources of third-party packages installed in this environment (site-packages),
  copied once into `$FEDLA_HOME/privacy_utility/`, split *by package* across clients with the
  product's `package` partitioning (non-IID: each client writes in its packages' own style). Each
  client keeps `local-heldout-fraction` of its chunks out of training (client/local_data.py); that held-out
  part is halved: a validation half (used only to choose among the DP tricks) and a test half (every
  number in the JSON).

Every federated configuration runs the product's own code path: the real ServerApp loop
(`server.federation.run_federation`: Flower's SecAgg+ workflow, the guard, the server optimiser) over
`simulations.inprocess.InProcessGrid` with the real ClientApp (`client.client_app.app`: Opacus DP-SGD with
the accountant composed over all rounds, `client/training/`). Only the heads' evaluation is local to
this package. Configurations:

* ``public_only``: the public heads, untouched;
* ``central_nodp``: the public heads fine-tuned centrally, without DP, on the pooled private training
  chunks of all clients (same optimiser, batch and passes over the data as the federated runs): the
  upper reference;
* ``federated_nodp``: the federation with dp=false;
* ``dp``: the federation with Opacus DP-SGD at epsilon 1, 2, 4, 8 (delta 1e-5, composed over all
  rounds: sigma is calibrated once for all planned rounds and every client's epsilon is checked);
* ``tricks``: at epsilon 8, each DP trick added greedily to the recipe and kept only when it raises the
  validation tau: larger expected batches (fewer steps), a smaller learning rate with a tighter clip,
  server momentum (FedAvgM over the DP mean), training only the fusion head, training rank-8 updates of
  every Linear (merged after each round, common/heads/lowrank.py). The epsilons below 8 use
  the recipe this comparison chose;
* ``user_dp``: user-level DP (dp-level=user: Flower's fixedclipping_mod, each device's noise share, common/federation/user_dp.py)
  at epsilon 8.

Metrics per client on its held-out test half: per-head top-1 accuracy against the base's greedy
choice, and heads-only tau estimated from a teacher-forced pass: at each position the heads' chain
(head k fusing the tokens before it) is accepted up to the first head that misses the base's greedy
token, so tau = 1 + the mean accepted length (the bonus token included), i.e. the expected tokens per
base forward of chain drafting under greedy verification. It is validated once against a real
`ams_heads_only` decode (AMS-LD without the n-gram drafter, `common.decoding.tau.decode_tau`) on a few
prompts (`tau_validation` in the JSON). The JSON and a PNG of the curve are written side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from pathlib import Path

import torch

from simulations.privacy_utility.central import central_finetune
from simulations.privacy_utility.configs import EPSILONS, QUICK, TRICK_EPSILON, Scale, dp_run_config, user_dp_run_config
from simulations.privacy_utility.corpus import private_corpus
from simulations.privacy_utility.results import table
from simulations.privacy_utility.session import Session, log, strip
from simulations.privacy_utility.tau import evaluate, validate_tau
from simulations.privacy_utility.tricks import choose_recipe


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m simulations.privacy_utility",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", default="privacy_utility.json", help="output JSON (the PNG goes beside it)")
    parser.add_argument("--base", default="", help="base model folder (default: the embedded default base)")
    parser.add_argument("--public-heads", default="", help="the server's public heads (default: trained once, cached)")
    parser.add_argument(
        "--quick", action="store_true", help="tiny scale: an end-to-end check in under a minute on a tiny base"
    )
    parser.add_argument(
        "--packages",
        action="store_true",
        help="the earlier benchmark (issue 12): 4 package clients, example-level DP-SGD and its tricks",
    )
    parser.add_argument("--signal-clients", type=int, default=0, help="grid: real clients per round (the signal)")
    parser.add_argument("--skip-true-run", action="store_true", help="grid: leave out the true run through the apps")
    parser.add_argument("--clients", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=0)
    parser.add_argument("--max-chunks-per-client", type=int, default=0)
    parser.add_argument("--no-tricks", action="store_true", help="skip the comparison of DP tricks")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument(
        "--prepare-data",
        action="store_true",
        help="only build the private folder (site-packages sources by package) and print it",
    )
    return parser


def chosen_scale(args: argparse.Namespace) -> Scale:
    """QUICK or the full scale, with the command line's overrides."""
    scale = QUICK if args.quick else Scale()
    overrides = {
        k: v
        for k, v in (
            ("clients", args.clients),
            ("rounds", args.rounds),
            ("max_chunks_per_client", args.max_chunks_per_client),
        )
        if v
    }
    if args.no_tricks:
        overrides["tricks"] = False
    if overrides:
        scale = dataclasses.replace(scale, **overrides)
    return scale


def references(session: Session):
    """public_only and central_nodp; returns the public heads (for the tau validation)."""
    from common.heads.lookahead import DraftHeads

    result, timings = session.result, session.timings
    public = DraftHeads.load(session.public_dir, session.base)
    result["public_only"] = evaluate(public, session.splits)
    log(f"public_only: {result['public_only']['tau_heads_only']:.3f} {result['public_only']['acc']}")

    t = time.perf_counter()
    central, pooled = central_finetune(session.public_dir, session.client_base, session.splits, session.run_config)
    result["central_nodp"] = {**evaluate(central, session.splits), "pooled_train_chunks": pooled}
    timings["central_nodp"] = time.perf_counter() - t
    log(f"central_nodp: {result['central_nodp']['tau_heads_only']:.3f} ({timings['central_nodp']:.0f}s)")
    session.save()
    return public


def epsilon_curve(session: Session, recipe: dict) -> None:
    """The epsilons below TRICK_EPSILON with the chosen recipe, from the largest down."""
    result = session.result
    for eps in sorted((e for e in EPSILONS if e != TRICK_EPSILON), reverse=True):
        entry = session.run(f"dp-eps{eps}", dp_run_config(session.run_config, eps, recipe))
        result["dp"][str(eps)] = strip(entry)
        result["dp"] = dict(sorted(result["dp"].items(), key=lambda kv: float(kv[0])))
        session.save()


def validation(session: Session, heads_by_name: dict) -> None:
    t = time.perf_counter()
    scale = session.scale
    session.result["tau_validation"] = validate_tau(
        session.client_base, heads_by_name, session.splits, scale.validate_prompts, scale.validate_tokens
    )
    session.timings["tau_validation"] = time.perf_counter() - t
    session.save()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.prepare_data:
        from common.paths import cache_root

        scale = QUICK if args.quick else Scale()
        print(private_corpus(scale.packages, scale.max_files_per_package, cache_root() / "privacy_utility"))
        return 0
    torch.set_num_threads(args.threads)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    if not args.packages:
        return population_main(args)
    session = Session.open(chosen_scale(args), args.json, args.base, args.public_heads, args.threads)

    heads_for_validation = {"public_only": references(session)}
    nodp = session.run("federated_nodp", dict(session.run_config, dp=False))
    session.result["federated_nodp"] = strip(nodp)
    session.save()
    recipe, best = choose_recipe(session)
    heads_for_validation[f"dp_eps{TRICK_EPSILON}"] = best["_heads"]
    epsilon_curve(session, recipe)
    if session.scale.user_dp:
        entry = session.run(f"user-dp-eps{TRICK_EPSILON}", user_dp_run_config(session.run_config))
        session.result["user_dp"] = {str(TRICK_EPSILON): strip(entry)}
        session.save()
    validation(session, heads_for_validation)

    out_json = session.out_json
    log(f"wrote {out_json} and {out_json.with_suffix('.png')} in {time.perf_counter() - session.started:.0f}s")
    print(table(json.loads(out_json.read_text())))
    return 0


def population_main(args: argparse.Namespace) -> int:
    """The population grid (issue 28): JSON after every point, the plot and the table at the end."""
    from simulations.privacy_utility import population_grid as pg
    from simulations.privacy_utility.grid_report import grid_table, plot_grid
    from simulations.privacy_utility.grid_run import run_grid
    from simulations.privacy_utility.results import round_floats

    grid = pg.QUICK if args.quick else pg.Grid()
    overrides = {"base": args.base, "rounds": args.rounds, "signal_clients": args.signal_clients}
    grid = dataclasses.replace(grid, **{k: v for k, v in overrides.items() if v})
    if args.skip_true_run:
        grid = dataclasses.replace(grid, true_run_rounds=0)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(result: dict) -> None:
        out.write_text(json.dumps(round_floats(result), indent=1) + "\n")

    result = run_grid(grid, save)
    plot_grid(result, out.with_suffix(".png"))
    print(grid_table(result))
    log(f"wrote {out} and {out.with_suffix('.png')} in {result['timings']['total']:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
