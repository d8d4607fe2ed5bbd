"""Privacy-utility benchmark (issue 12): does federated DP fine-tuning beat public-only heads on the
clients' own code, and at what epsilon?

    python -m simulations.privacy_utility --json out.json --public-heads heads/public
    python -m simulations.privacy_utility --quick --base TINY_DIR --json out.json   # end-to-end check, tiny

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
this script. Configurations:

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
* ``user_dp``: user-level DP (dp-level=user, Flower's fixedclipping_mod + server noise, server/user_dp.py)
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
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

PACKAGES = (
    "click",
    "attr",
    "requests",
    "yaml",
    "httpx",
    "dateutil",
    "urllib3",
    "pyparsing",
    "anyio",
    "starlette",
    "markdown_it",
    "tqdm",
)
EPSILONS = (1, 2, 4, 8)
DELTA = 1e-5
TRICK_EPSILON = 8
# Each trick: (name, run-config overrides it adds to the recipe). Tried in this order, kept if it helps.
TRICKS = (
    ("large_batch", {"batch-size": 64}),  # expected batch 64 instead of 16: ~4x fewer, less noisy steps
    ("lr_clip", {"lr": 3e-4, "dp-max-grad-norm": 0.3}),  # a smaller step and a tighter clip for DP
    ("server_momentum", {"server-optimizer": "fedavgm", "server-momentum": 0.9, "server-lr": 0.5}),
    ("fusion_only", {"dp-trainable": "fusion"}),  # 1/3 of the parameters: the same noise on fewer coordinates
    # rank-8 updates of every Linear (~50k coordinates instead of ~2M), which need a larger step
    ("low_rank", {"dp-trainable": "lowrank", "dp-rank": 8, "lr": 3e-3}),
)


@dataclass(frozen=True)
class Scale:
    clients: int = 4
    rounds: int = 2
    chunk_len: int = 64
    max_chunks_per_client: int = 600  # 450 to train: DP-SGD needs data (docs/benchmarks.md: the signal-to-noise)
    heldout_fraction: float = 0.25
    batch_size: int = 16
    lr: float = 1e-3
    max_files_per_package: int = 0  # 0: every .py file
    packages: tuple[str, ...] = PACKAGES
    tricks: bool = True
    user_dp: bool = True
    validate_prompts: int = 3
    validate_tokens: int = 32


QUICK = Scale(
    clients=4,
    rounds=2,
    chunk_len=32,
    max_chunks_per_client=24,
    heldout_fraction=0.25,
    batch_size=4,
    lr=1e-3,
    max_files_per_package=3,
    packages=PACKAGES[:8],
    tricks=False,
    user_dp=True,
    validate_prompts=1,
    validate_tokens=8,
)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ data


def site_packages() -> Path:
    import click  # any installed third-party package: its parent is site-packages

    return Path(click.__file__).resolve().parents[1]


def private_corpus(packages: tuple[str, ...], max_files: int, root: Path) -> Path:
    """A folder with one sub-folder per package holding its .py sources (copied once, then reused)."""
    tag = f"{'-'.join(packages)}-{max_files}"
    import hashlib

    folder = root / f"private-{hashlib.sha256(tag.encode()).hexdigest()[:12]}"
    if (folder / ".complete").exists():
        return folder
    if folder.exists():
        shutil.rmtree(folder)
    source = site_packages()
    for package in packages:
        files = sorted((source / package).rglob("*.py"))
        if max_files:
            files = sorted(files, key=lambda p: (-p.stat().st_size, str(p)))[:max_files]
        for path in files:
            target = folder / package / path.relative_to(source / package)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
    (folder / ".complete").write_text("\n".join(packages))
    return folder


# ------------------------------------------------------------------------------------------ configs


def base_run_config(scale: Scale, base_dir: Path, data_dir: Path, heads_dir: Path, out_dir: Path) -> dict:
    """The product's run config (pyproject keys) shared by every federated configuration."""
    n = scale.clients
    return {
        "base-model-dir": str(base_dir),
        "data-source": str(data_dir),
        "partitioning": "package",
        "init-heads": str(heads_dir),
        "num-server-rounds": scale.rounds,
        "min-train-clients": n,
        "min-available-clients": n,
        "node-wait-seconds": 0.0,
        "chunk-len": scale.chunk_len,
        "max-chunks-per-client": scale.max_chunks_per_client,
        "local-heldout-fraction": scale.heldout_fraction,
        "batch-size": scale.batch_size,
        "lr": scale.lr,
        "local-epochs": 1,
        "num-heads": 4,
        "dp-delta": DELTA,
        "secagg": True,
        "fraction-evaluate": 0.0,
        "server-eval-chunks": 0,
        "eval-prompts": 1,
        "eval-max-new-tokens": 0,
        "client-eval-prompts": 0,
        "run-dir": str(out_dir / "runs"),
        "store-url": f"sqlite:///{out_dir / 'runs' / 'privacy_utility.db'}",
    }


def federate(run_config: dict, clients: int, name: str) -> tuple[Path, dict]:
    """One federated run through the product's server loop and ClientApp; (its run folder, its epsilons)."""
    from flwr.app import Context, RecordDict

    from client.client_app import app
    from common.federation.config import FedConfig
    from server.federation import run_federation
    from simulations.inprocess import InProcessGrid

    config = dict(run_config, **{"run-id": f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"})
    grid = InProcessGrid(app, clients, config)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config)
    run_dir = run_federation(grid, context, FedConfig.from_mapping(config))
    rounds = [
        json.loads(p.read_text())
        for p in sorted((run_dir / "rounds").glob("round-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    ]
    plan = json.loads((run_dir / "run.json").read_text())["plan"]
    last = rounds[-1]
    privacy = {
        "epsilon_max": last["privacy"]["epsilon_max"],
        "epsilon_mean": last["privacy"]["epsilon_mean"],
        "noise_multiplier": last["privacy"]["noise_multiplier"],
        "q": last["privacy"]["q"],
        "aggregated_rounds": sum(int(r["aggregated"]) for r in rounds),
        "rounds": len(rounds),
        "skipped_budget": sum(len(r["participation"]["skipped_budget"]) for r in rounds),
    }
    if "user_dp" in plan:
        privacy["user_dp"] = plan["user_dp"]
    return run_dir, privacy


def final_heads(run_dir: Path, base):
    from common.heads.lookahead import DraftHeads
    from server.recorder import latest_checkpoint

    found = latest_checkpoint(run_dir)
    if found is None:
        raise RuntimeError(f"no checkpoint in {run_dir}")
    return DraftHeads.load(found[1], base)


# ------------------------------------------------------------------------------------------ evaluation


@dataclass
class ClientSplit:
    train: object  # Features
    val: object
    test: object


def client_splits(run_config: dict, base, clients: int) -> list[ClientSplit]:
    """Each client's train chunks and held-out chunks (as the ClientApp sees them), with base features."""
    from client.local_data import client_data, client_features
    from common.federation.config import FedConfig

    config = FedConfig.from_mapping(run_config)
    splits = []
    for partition in range(clients):
        node_config = {"partition-id": partition, "num-partitions": clients}
        data = client_data(config, base, node_config)
        train = client_features(config, base, data.train, node_config)
        heldout = client_features(config, base, data.heldout, node_config)
        half = len(heldout) // 2
        splits.append(ClientSplit(train, heldout.subset(slice(0, half)), heldout.subset(slice(half, None))))
    return splits


@torch.no_grad()
def chain_acceptance(heads, features, batch_size: int = 16) -> dict:
    """Per-head top-1 accuracy and teacher-forced chain tau (module docstring) on `features`."""
    heads.eval()
    k_max = heads.num_heads
    correct = [0] * k_max
    total = [0] * k_max
    accepted_sum, positions = 0, 0
    for start in range(0, len(features), batch_size):
        part = features.subset(slice(start, start + batch_size))
        tokens, greedy = part.tokens, part.greedy
        length = tokens.shape[1]
        logits = heads(part.hidden.float(), tokens)
        hits = []
        for k in range(1, k_max + 1):
            predicted = heads.draft_ids[logits[k - 1][:, : length - k].argmax(-1)]
            hit = predicted == greedy[:, k:]
            correct[k - 1] += int(hit.sum())
            total[k - 1] += hit.numel()
            hits.append(hit[:, : length - k_max])  # positions where every head has a target
        chain = torch.stack(hits).long().cumprod(dim=0)  # (K, B, T): 1 while heads 1..k all hit
        accepted_sum += int(chain.sum())
        positions += chain.shape[1] * chain.shape[2]
    return {
        "acc": [c / t if t else 0.0 for c, t in zip(correct, total)],
        "tau_heads_only": 1.0 + accepted_sum / positions if positions else 1.0,
    }


def evaluate(heads, splits: list[ClientSplit], part: str = "test") -> dict:
    """Mean over clients (each client's held-out `part`), and the per-client values."""
    per_client = [chain_acceptance(heads, getattr(s, part)) for s in splits]
    k = heads.num_heads
    return {
        "tau_heads_only": sum(c["tau_heads_only"] for c in per_client) / len(per_client),
        "acc": [sum(c["acc"][i] for c in per_client) / len(per_client) for i in range(k)],
        "per_client": [
            {"tau_heads_only": round(c["tau_heads_only"], 4), "acc": [round(a, 4) for a in c["acc"]]}
            for c in per_client
        ],
    }


def central_finetune(public_dir: Path, base, splits: list[ClientSplit], run_config: dict):
    """Non-private central fine-tuning on the pooled training chunks: the clients' own optimiser and
    batch (client.training.local_round.train_round with dp=false), one pass per federated round."""
    from client.training.local_round import train_round
    from common.data.features import Features
    from common.federation.config import FedConfig
    from common.heads.lookahead import DraftHeads

    pooled = Features(
        torch.cat([s.train.tokens for s in splits]),
        torch.cat([s.train.hidden for s in splits]),
        torch.cat([s.train.greedy for s in splits]),
    )
    config = FedConfig.from_mapping(dict(run_config, **{"dp": False, "local-epochs": run_config["num-server-rounds"]}))
    heads = DraftHeads.load(public_dir, base)
    heads.train()
    train_round(heads, pooled, config, None)
    return heads, len(pooled)


def validate_tau(base, heads_by_name: dict, splits: list[ClientSplit], prompts: int, tokens: int) -> dict:
    """The chain estimate against a real heads-only AMS-LD decode, on the first chunks of each client's test half."""
    from common.decoding.tau import chunk_prompts, decode_tau

    out = {}
    for name, heads in heads_by_name.items():
        taus, estimates = [], []
        for split in splits:
            chosen = chunk_prompts(split.test.tokens, prompts, split.test.tokens.shape[1] // 2)
            tau = decode_tau(base, heads, chosen, tokens, ngram=False)
            if tau is not None:
                taus.append(tau)
            estimates.append(chain_acceptance(heads, split.test.subset(slice(0, prompts)))["tau_heads_only"])
        out[name] = {
            "decoded_ams_heads_only": sum(taus) / len(taus) if taus else None,
            "chain_estimate_same_chunks": sum(estimates) / len(estimates),
            "prompts": prompts * len(splits),
            "max_new_tokens": tokens,
        }
    return out


# ------------------------------------------------------------------------------------------ main


def ensure_public_heads(path: Path | None, base, scale: Scale, cache: Path) -> Path:
    """The server's public heads: the given folder, else (trained once, cached) on the stdlib train split."""
    if path is not None:
        return path
    target = cache / f"public-heads-{base.fingerprint[:12]}-{scale.chunk_len}"
    if (target / "heads_config.json").exists():
        return target
    from common.data.chunks import chunk_files, stdlib_files
    from common.training.loop import fit_heads

    files = stdlib_files("train")
    chunks = chunk_files(files[: 40 if scale is QUICK else 400], base.tokenizer, scale.chunk_len)
    heldout = chunk_files(stdlib_files("heldout")[:10], base.tokenizer, scale.chunk_len)
    limit = 64 if scale is QUICK else 1000
    heads, _ = fit_heads(
        base,
        chunks[:limit],
        heldout[:32],
        draft_vocab_size=min(8192, base.vocab_size // 2),
        epochs=2,
        max_seconds=10 if scale is QUICK else 600,
        show_progress=False,
    )
    heads.save(target)
    return target


def round_floats(value):
    if isinstance(value, float):  # 5 significant digits (a delta of 1e-5 must survive)
        return float(f"{value:.5g}") if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: round_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [round_floats(v) for v in value]
    return value


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", default="privacy_utility.json", help="output JSON (the PNG goes beside it)")
    parser.add_argument("--base", default="", help="base model folder (default: the embedded default base)")
    parser.add_argument("--public-heads", default="", help="the server's public heads (default: trained once, cached)")
    parser.add_argument(
        "--quick", action="store_true", help="tiny scale: an end-to-end check in under a minute on a tiny base"
    )
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
    args = parser.parse_args(argv)
    if args.prepare_data:
        from common.paths import cache_root

        scale = QUICK if args.quick else Scale()
        print(private_corpus(scale.packages, scale.max_files_per_package, cache_root() / "privacy_utility"))
        return 0
    torch.set_num_threads(args.threads)
    import dataclasses
    import logging

    logging.getLogger("flwr").setLevel(logging.WARNING)
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
    started = time.perf_counter()

    from common.heads.lookahead import DraftHeads
    from common.model.base import load_base
    from common.model.default import ensure_default_base
    from common.paths import cache_root

    out_json = Path(args.json).resolve()
    out_dir = out_json.with_suffix("")
    out_dir = out_dir.parent / f"{out_dir.name}-runs"
    out_dir.mkdir(parents=True, exist_ok=True)
    cache = cache_root() / "privacy_utility"
    base_dir = Path(args.base).expanduser().resolve() if args.base else ensure_default_base()
    base = load_base(base_dir)
    public_dir = ensure_public_heads(
        Path(args.public_heads).expanduser().resolve() if args.public_heads else None, base, scale, cache
    )
    data_dir = private_corpus(scale.packages, scale.max_files_per_package, cache)
    run_config = base_run_config(scale, base_dir, data_dir, public_dir, out_dir)
    timings: dict[str, float] = {}

    t = time.perf_counter()
    from client.base_cache import cached_base
    from common.federation.config import FedConfig

    client_base = cached_base(FedConfig.from_mapping(run_config))  # the instance the ClientApps will use
    splits = client_splits(run_config, client_base, scale.clients)
    timings["features"] = time.perf_counter() - t
    log(
        f"{scale.clients} clients: train chunks {[len(s.train) for s in splits]}, "
        f"val {[len(s.val) for s in splits]}, test {[len(s.test) for s in splits]} ({timings['features']:.0f}s)"
    )

    result: dict = {"clients": scale.clients, "rounds": scale.rounds}
    meta: dict = {
        "delta": DELTA,
        "scale": dataclasses.asdict(scale),
        "base": str(base_dir),
        "public_heads": str(public_dir),
        "private_data": str(data_dir),
        "train_chunks": [len(s.train) for s in splits],
        "test_chunks": [len(s.test) for s in splits],
        "val_chunks": [len(s.val) for s in splits],
        "threads": args.threads,
        "tau_method": "teacher-forced chain estimate: 1 + mean over positions of the number of leading heads "
        "whose top-1 equals the base's greedy token (greedy chain verification)",
        "evaluated_on": "each client's held-out test half; mean over clients",
        "selection": "DP tricks kept by tau on the held-out validation half (disjoint from test)",
    }
    heads_for_validation = {}

    def save() -> None:
        payload = round_floats(
            {**result, "meta": {**meta, "seconds": timings, "total_seconds": time.perf_counter() - started}}
        )
        from server.recorder import PRIVACY_UTILITY_FILE

        text = json.dumps(payload, indent=1)
        out_json.write_text(text)
        for run_dir in federated_run_dirs(payload):  # so the dashboard shows the curve on each run's page
            (run_dir / PRIVACY_UTILITY_FILE).write_text(text)
        try:
            if result.get("dp"):
                plot(payload, out_json.with_suffix(".png"))
        except Exception as exc:  # noqa: BLE001 - a plot never loses the numbers
            log(f"could not plot: {exc}")

    public = DraftHeads.load(public_dir, base)
    result["public_only"] = evaluate(public, splits)
    heads_for_validation["public_only"] = public
    log(f"public_only: {result['public_only']['tau_heads_only']:.3f} {result['public_only']['acc']}")

    t = time.perf_counter()
    central, pooled = central_finetune(public_dir, client_base, splits, run_config)
    result["central_nodp"] = {**evaluate(central, splits), "pooled_train_chunks": pooled}
    timings["central_nodp"] = time.perf_counter() - t
    log(f"central_nodp: {result['central_nodp']['tau_heads_only']:.3f} ({timings['central_nodp']:.0f}s)")
    save()

    def run(name: str, config: dict) -> dict:
        t = time.perf_counter()
        run_dir, privacy = federate(config, scale.clients, name)
        heads = final_heads(run_dir, base)
        entry = {
            **evaluate(heads, splits),
            "val_tau_heads_only": evaluate(heads, splits, "val")["tau_heads_only"],
            "privacy": privacy,
            "run_dir": str(run_dir),
            "config": {
                k: config[k]
                for k in (
                    "batch-size",
                    "lr",
                    "dp",
                    "dp-target-epsilon",
                    "dp-max-grad-norm",
                    "server-optimizer",
                    "server-lr",
                    "server-momentum",
                    "dp-trainable",
                    "dp-rank",
                    "dp-level",
                    "update-max-norm",
                )
                if k in config
            },
        }
        timings[name] = time.perf_counter() - t
        log(
            f"{name}: tau {entry['tau_heads_only']:.3f} (val {entry['val_tau_heads_only']:.3f}) acc "
            f"{[round(a, 3) for a in entry['acc']]} eps {privacy['epsilon_max']} ({timings[name]:.0f}s)"
        )
        entry["_heads"] = heads
        return entry

    def strip(entry: dict) -> dict:
        return {k: v for k, v in entry.items() if k != "_heads"}

    nodp = run("federated_nodp", dict(run_config, dp=False))
    result["federated_nodp"] = strip(nodp)
    save()

    def dp_config(eps: float, recipe: dict) -> dict:
        return dict(run_config, **{"dp": True, "dp-target-epsilon": float(eps)}, **recipe)

    recipe: dict = {}
    best = run(f"dp-eps{TRICK_EPSILON}-default", dp_config(TRICK_EPSILON, recipe))
    result["dp"] = {str(TRICK_EPSILON): strip(best)}
    save()
    if scale.tricks:
        comparison = [
            {
                "trick": "default (batch 16, lr 1e-3, clip 1.0, FedAvg, all parameters)",
                "kept": True,
                "val_tau_heads_only": best["val_tau_heads_only"],
                "tau_heads_only": best["tau_heads_only"],
                "acc": best["acc"],
                "recipe": {},
            }
        ]
        for name, change in TRICKS:
            trial = run(f"dp-eps{TRICK_EPSILON}-{name}", dp_config(TRICK_EPSILON, {**recipe, **change}))
            kept = trial["val_tau_heads_only"] > best["val_tau_heads_only"]
            comparison.append(
                {
                    "trick": name,
                    "kept": kept,
                    "val_tau_heads_only": trial["val_tau_heads_only"],
                    "tau_heads_only": trial["tau_heads_only"],
                    "acc": trial["acc"],
                    "recipe": {**recipe, **change},
                    "seconds": timings[f"dp-eps{TRICK_EPSILON}-{name}"],
                }
            )
            if kept:
                recipe, best = {**recipe, **change}, trial
            result["tricks"] = {"epsilon": TRICK_EPSILON, "comparison": comparison, "chosen_recipe": recipe}
            result["dp"][str(TRICK_EPSILON)] = strip(best)
            save()
    heads_for_validation[f"dp_eps{TRICK_EPSILON}"] = best["_heads"]
    for eps in sorted((e for e in EPSILONS if e != TRICK_EPSILON), reverse=True):
        entry = run(f"dp-eps{eps}", dp_config(eps, recipe))
        result["dp"][str(eps)] = strip(entry)
        result["dp"] = dict(sorted(result["dp"].items(), key=lambda kv: float(kv[0])))
        save()
    if scale.user_dp:
        entry = run(
            f"user-dp-eps{TRICK_EPSILON}",
            dict(
                run_config,
                **{"dp": True, "dp-level": "user", "update-max-norm": 0.1, "dp-target-epsilon": float(TRICK_EPSILON)},
            ),
        )
        result["user_dp"] = {str(TRICK_EPSILON): strip(entry)}
        save()

    t = time.perf_counter()
    result["tau_validation"] = validate_tau(
        client_base, heads_for_validation, splits, scale.validate_prompts, scale.validate_tokens
    )
    timings["tau_validation"] = time.perf_counter() - t
    save()
    log(f"wrote {out_json} and {out_json.with_suffix('.png')} in {time.perf_counter() - started:.0f}s")
    print(table(json.loads(out_json.read_text())))
    return 0


def federated_run_dirs(result: dict) -> list[Path]:
    """The run folders of the federated configurations in a result (those that exist)."""
    entries = [result.get("federated_nodp") or {}]
    entries += list(result.get("dp", {}).values()) + list(result.get("user_dp", {}).values())
    return [Path(e["run_dir"]) for e in entries if e.get("run_dir") and Path(e["run_dir"]).is_dir()]


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


if __name__ == "__main__":
    raise SystemExit(main())
