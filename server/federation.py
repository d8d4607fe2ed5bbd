"""The federated run behind the ServerApp: set up, then one `run_round` per round, each record to the recorder.

Where each job lives: the reply guard in server/guard.py, one round (train exchange through Flower's
SecAgg+ or plain FedAvg workflow, aggregation, evaluations) in server/rounds.py, server and client
evaluation in server/evaluation.py, and everything written about the run in server/run/recorder.py. This
module owns the run: the base and the starting heads (public, fresh, a heads folder, or a resumed checkpoint),
the up-front checks Flower does not make, and the loop.
"""

from __future__ import annotations

import logging
import random
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.server.client_manager import SimpleClientManager
from flwr.server.compat.app_utils import start_update_client_manager_thread
from flwr.serverapp.grid import Grid

from common.errors import FedLookaheadError
from common.federation.config import FedConfig
from common.federation.protocol import PUBLIC_PRECONDITIONER
from common.federation.records import heads_to_ndarrays
from common.federation.wire import secagg_plan
from common.heads.draft_vocab import public_draft_vocab
from common.heads.lookahead import DraftHeads
from common.model.base import BaseModel, load_base
from common.model.default import ensure_default_base
from common.training.loop import DEFAULT_DRAFT_VOCAB
from server import server_optimizer
from server.evaluation import ServerEval
from server.rounds import RoundContext, run_round
from server.run.folder import RunFolder
from server.run.recorder import Recorder
from server.secagg import TolerantSecAggPlusWorkflow
from server.store.engine import store_url
from server.store.run_store import RunStore

log = logging.getLogger(
    "flwr.fedla.server"
)  # a child of Flower's logger: its handlers stream our lines to `flwr run --stream` / `flwr log`


FRESH_DP_VERDICT = (
    "DP from fresh heads is not expected to learn: untrained heads under DP-SGD ended at head-1 accuracy 0.04 "
    'after 2 rounds of 2 clients (issue 30); init-heads="public" starts from heads trained on public code'
)

NO_DP_VERDICT = "No DP: the clients' updates carry no privacy guarantee"


def privacy_plan(config: FedConfig, start_round: int, user_dp: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the run may spend and whether DP is expected to learn, known before round 1 (run.json's plan,
    the dashboard's privacy card); `user_dp`: server.user_dp's plan, whose forecast is the verdict. A verdict
    of None: no forecast for this setting."""
    verdict = None
    if not config.dp:
        verdict = NO_DP_VERDICT
    elif config.init_heads == "fresh" and start_round == 1:
        verdict = FRESH_DP_VERDICT
    elif user_dp is not None:
        verdict = user_dp["verdict"]
    return {
        "dp": config.dp,
        "level": config.dp_level if config.dp else None,
        "epsilon_budget": config.epsilon_budget,
        "delta": config.dp_delta if config.dp else None,
        "planned_rounds": config.planned_rounds,
        "verdict": verdict,
    }


def wait_for_nodes(grid: Grid, config: FedConfig) -> list[int]:
    """Node ids once min-available-clients are connected; a clear error instead of Flower's silent wait."""
    deadline = time.monotonic() + config.node_wait_seconds
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= config.min_available_clients or time.monotonic() >= deadline:
            break
        time.sleep(1.0)
    if len(nodes) < config.min_available_clients:
        raise FedLookaheadError(
            f"only {len(nodes)} node(s) connected after {config.node_wait_seconds:g}s but min-available-clients is "
            f"{config.min_available_clients}: the strategy would wait forever (start more SuperNodes, or lower it)"
        )
    return nodes


def check_federation(config: FedConfig, num_nodes: int, num_parameters: int = 0) -> dict[str, Any]:
    """Up-front checks that Flower itself does not make (its strategies hang or abort mid-run instead), and
    SecAgg+'s parameters for the cohort (`num_parameters`: the update's length, which sets its clipping)."""
    if config.min_train_clients > num_nodes:
        raise FedLookaheadError(
            f"min-train-clients ({config.min_train_clients}) exceeds the {num_nodes} connected node(s): "
            "the round would wait forever"
        )
    if config.clients_per_round > num_nodes:
        raise FedLookaheadError(f"clients-per-round ({config.clients_per_round}) exceeds the {num_nodes} node(s)")
    sampled = min(config.clients_this_round(num_nodes), num_nodes)
    info: dict[str, Any] = {"nodes": num_nodes, "clients_per_round": sampled}
    if config.dp and config.dp_level == "user":  # common/federation/user_dp.py
        from server.user_dp import plan_user_dp

        info["user_dp"] = plan_user_dp(config, sampled, num_nodes, num_parameters)
    if config.secagg:
        if sampled < 2:
            raise FedLookaheadError("SecAgg+ needs at least 2 clients per round (Flower aborts with fewer)")
        secagg = secagg_plan(config, sampled, num_parameters, info.get("user_dp", {}).get("masked_range"))
        neighbours = min(secagg.num_shares, sampled)
        if secagg.threshold > neighbours:
            raise FedLookaheadError(
                f"SecAgg+ threshold {secagg.threshold} exceeds the {neighbours} neighbours each client has "
                f"({sampled} clients per round, {secagg.num_shares} shares): every round would abort"
            )
        info["secagg"] = secagg.to_dict()
    return info


def server_base(config: FedConfig) -> BaseModel:
    path = Path(config.base_model_dir).expanduser() if config.base_model_dir else ensure_default_base()
    return load_base(path, device=config.device)


def _mark_failed(config: FedConfig, run_dir: Path) -> None:
    """A run that cannot be resumed is a dead one: its store row says failed, not running forever."""
    store = RunStore(store_url(config.store_url, config.run_dir))
    try:
        if store.get_run(run_dir.name) is not None:
            store.finish_run(run_dir.name, "failed")
            store.write_summary(run_dir.name, RunFolder(run_dir).summary)
    finally:
        store.close()


def _starting_heads(config: FedConfig, base: BaseModel, context: Context) -> tuple[Path, str, DraftHeads, int]:
    """(run folder, run id, heads, first round): a resumed run's last checkpoint, else what init-heads says."""
    if config.resume_from:
        run_dir = Path(config.resume_from).expanduser().resolve()
        if not run_dir.is_dir():
            raise FedLookaheadError(f"resume-from: no run folder {run_dir}")
        problems = []
        for last_round, ckpt in RunFolder(run_dir).checkpoints_newest_first():
            try:
                heads = DraftHeads.load(ckpt, base)  # refuses a checkpoint for another base, or a damaged one
            except FedLookaheadError as exc:
                problems.append(str(exc))
                log.warning("resume-from: skipping checkpoint %s: %s", ckpt, exc)
                continue
            log.info("resuming run %s after round %d (head version %d)", run_dir.name, last_round, heads.config.version)
            return run_dir, run_dir.name, heads, last_round + 1
        _mark_failed(config, run_dir)
        raise FedLookaheadError(
            f"resume-from: no usable checkpoint under {RunFolder(run_dir).checkpoints_dir}"
            + (f" (the newest: {problems[0]})" if problems else "")
        )
    run_id = config.run_id or f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{context.run_id}"
    if (
        config.init_heads == "public"
    ):  # DP from untrained heads does not learn in a small run (common/training/public_heads.py)
        from common.training.public_heads import ensure_public_heads

        folder = ensure_public_heads(base, config.num_heads, config.chunk_len, config.public_heads_minutes)
        heads = DraftHeads.load(folder, base)
        log.info("starting from the public heads in %s", folder)
    elif config.init_heads == "fresh":  # still a public draft vocabulary: the full LM head makes DP ~6x slower
        heads = DraftHeads.fresh(
            base, config.num_heads, draft_vocab=public_draft_vocab(base, DEFAULT_DRAFT_VOCAB, seed=config.seed)
        )
    else:
        heads = DraftHeads.load(config.init_heads, base)
    if heads.num_heads != config.num_heads:
        raise FedLookaheadError(f"init-heads has {heads.num_heads} heads but num-heads is {config.num_heads}")
    return Path(config.run_dir).expanduser().resolve() / run_id, run_id, heads, 1


def _preconditioner(config: FedConfig, base: BaseModel, heads: DraftHeads) -> tuple[bytes | None, list | None]:
    """client-optimizer=public-sgd: the starting heads' public preconditioner, computed once per run, as the
    clients receive it, and the scale of the coordinates their updates come back in."""
    if config.client_optimizer != "public-sgd":
        return None, None
    from common.training.preconditioner import Preconditioner, stdlib_preconditioner

    started = time.perf_counter()
    blob = stdlib_preconditioner(heads, base, config.chunk_len, config.seed).to_bytes()
    log.info("public preconditioner: %d bytes in %.1f s", len(blob), time.perf_counter() - started)
    scale = Preconditioner.from_bytes(blob, heads).update_scale()
    return blob, scale


def run_federation(grid: Grid, context: Context, config: FedConfig) -> Path:
    """The whole federated run; returns runs/<run-id>. Raises (after marking the run failed) on fatal errors."""
    base = server_base(config)
    run_dir, run_id, heads, start_round = _starting_heads(config, base, context)
    store = RunStore(store_url(config.store_url, config.run_dir))
    recorder = Recorder(run_dir, run_id, store)
    recorder.start(config)
    stop = None
    try:
        if start_round > 1:  # a crash may have left the store ahead of or behind the checkpoints
            recorder.reconcile(start_round - 1)
        nodes = wait_for_nodes(grid, config)
        plan = check_federation(config, len(nodes), sum(a.size for a in heads_to_ndarrays(heads)))
        plan["privacy"] = privacy_plan(config, start_round, plan.get("user_dp"))
        if plan["privacy"]["verdict"] not in (None, NO_DP_VERDICT):  # the plan says so before a run
            log.warning("privacy plan: %s", plan["privacy"]["verdict"])
        log.info(
            "run %s: %d nodes, plan %s, %d head parameters, base %s",
            run_id,
            len(nodes),
            plan,
            heads.num_trainable(),
            base.fingerprint,
        )
        recorder.describe(
            {
                "run_id": run_id,
                "flower_run_id": context.run_id,
                "config": config.to_dict(),
                "plan": plan,
                "base_fingerprint": base.fingerprint,
                "base_dir": str(base.path),
                "head_parameters": heads.num_trainable(),
                "head_bytes": sum(a.nbytes for a in heads_to_ndarrays(heads)),
                "resumed_from_round": start_round - 1,
            }
        )
        server_eval = ServerEval.build(base, config)
        if start_round == 1:  # heads-only too, as on the last round, so that both ends compare
            recorder.record_starting_heads(server_eval.run(heads, base, config, heads_only=True))
        client_manager = SimpleClientManager()
        thread, stop, ready = start_update_client_manager_thread(grid, client_manager)
        ready.wait()
        workflow = None
        if config.secagg:
            secagg = plan["secagg"]
            workflow = TolerantSecAggPlusWorkflow(
                num_shares=secagg["num_shares"],
                reconstruction_threshold=secagg["threshold"],
                max_weight=config.weight_cap,
                clipping_range=secagg["clipping_range"],
                quantization_range=secagg["quantization_range"],
                modulus_range=secagg["modulus_range"],
                timeout=config.round_timeout or None,
            )
        preconditioner, update_scale = _preconditioner(config, base, heads)
        fit_extras: dict[str, Any] = {PUBLIC_PRECONDITIONER: preconditioner} if preconditioner is not None else {}
        if "user_dp" in plan and config.user_dp_noise == "device":  # each device adds its share
            from server.user_dp import device_noise_config

            fit_extras.update(device_noise_config(plan["user_dp"]))
        ctx = RoundContext(
            grid=grid,
            context=context,
            client_manager=client_manager,
            config=config,
            base=base,
            run_id=run_id,
            server_eval=server_eval,
            optimizer=server_optimizer.from_config(config),  # issue 12: fedavg | fedavgm | fedadam
            workflow=workflow,
            user_dp=plan.get("user_dp"),
            fit_extras=fit_extras,
            clip=config.update_max_norm,
            update_scale=update_scale,
            eval_rng=random.Random(config.seed + 1),
        )
        for server_round in range(start_round, config.num_server_rounds + 1):
            recorder.record(run_round(ctx, heads, server_round), heads)
        recorder.finish("finished")
        return run_dir
    except BaseException:
        recorder.finish("failed")
        raise
    finally:
        if stop is not None:
            stop.set()
        store.close()
