"""Read-only web dashboard over the run store: JSON API + HTML pages with live plots.

* ``GET /api/runs``, ``/api/runs/{id}``, ``/api/runs/{id}/rounds``: JSON, documented at ``/openapi.json``.
* ``GET /`` lists runs with epsilon spent and left; ``GET /runs/{id}`` says in one line what the run has gained
  on its starting heads and spent, plots loss, per-head accuracy and tau (from the starting heads' round-0
  point), epsilon against the budget, participation and traffic per round, shows the privacy plan and its
  verdict, the SecAgg+ settings and the latest checkpoint, and polls the API while the run is going.
* ``GET /runs/{id}/checkpoint``: the run's latest (or ``?round=N``) recorded checkpoint: the file itself,
  or a zip of the checkpoint directory, served only from under ``<run-dir>/<run-id>/`` (run-dir: the
  store's own folder, as in the default ``runs/fedla.db`` layout, or the ``run_dir`` the operator gives);
  the database is not trusted to name any other file.

The store is opened read-only (``RunStore(read_only=True)``): a missing, empty or foreign file is refused
at start with a one-line error and nothing is created; a store deleted or replaced while serving gives
503 on every request until the dashboard is restarted.

Nothing changes state: every route is GET, any other method is answered 405. Bound to loopback by
default, and then it answers only requests whose Host header names this machine (a web page could
otherwise reach it by DNS rebinding: common/loopback.py); any other address needs a token, which is then checked on every request (``Authorization:
Bearer <token>`` or ``?token=<token>``; the pages pass it on to the API calls, links and assets).

Plots use Chart.js 4.6.1 (MIT, see static/chart.js.LICENSE.md), vendored from the npm registry: no CDN.
Individual client updates are never stored or shown: with SecAgg+ the server only sees the aggregate.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import re
import tempfile
import zipfile
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator, Optional
from urllib.parse import urlencode

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from pydantic import BaseModel, Field
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.loopback import host_header_is_loopback, is_loopback, refused_host_message
from server.run.folder import PRIVACY_UTILITY_FILE, RunFolder
from server.store.engine import StoreUnavailable, one_line
from server.store.run_store import RunStore

PACKAGE_DIR = Path(__file__).resolve().parent
STATIC_DIR = PACKAGE_DIR / "static"
TEMPLATES_DIR = PACKAGE_DIR / "templates"
TOKEN_ENV = "FEDLA_DASHBOARD_TOKEN"
MIN_TOKEN_LENGTH = 16
PRIVACY_NOTE = (
    "Individual client updates are never stored. With SecAgg+ the server only ever sees the "
    "aggregate of the sampled clients' updates; every number here is per round and aggregated."
)
log = logging.getLogger("fedla.dashboard")


# ------------------------------------------------------------------------------------ API models


class RunSummaryOut(BaseModel):
    run_id: str
    status: str = Field(description='"running", "finished" or "failed"')
    started_at: datetime
    updated_at: datetime
    finished_at: Optional[datetime] = None
    num_rounds: int
    last_round: Optional[int] = None
    last_train_loss: Optional[float] = None
    last_tau: Optional[float] = None
    last_epsilon_max: Optional[float] = Field(None, description="null when unbounded (no DP) or no rounds yet")
    epsilon_budget: Optional[float] = Field(
        None, description="epsilon each client may spend in the run (null: no DP, a fixed noise multiplier, or no plan)"
    )


class CheckpointOut(BaseModel):
    round: int
    head_version: int
    path: str
    size_bytes: int
    sha256: str
    created_at: datetime


class StartingHeadsOut(BaseModel):
    head_accuracy: list[float] = Field(description="server-side held-out top-1 accuracy per head before round 1")
    tau: Optional[float] = None
    tau_heads_only: Optional[float] = None
    loss: Optional[float] = None


class RunOut(BaseModel):
    run_id: str
    status: str
    config: dict[str, Any]
    secagg: dict[str, Any] = Field(description="SecAgg+ settings the run used")
    plan: Optional[dict[str, Any]] = Field(
        None, description="known before round 1: nodes, clients per round, SecAgg+ shares, privacy (budget, verdict)"
    )
    starting_heads: Optional[StartingHeadsOut] = Field(
        None, description="the round-0 point: the heads the run starts from"
    )
    started_at: datetime
    updated_at: datetime
    finished_at: Optional[datetime] = None
    num_rounds: int
    last_round: Optional[int] = None
    latest_checkpoint: Optional[CheckpointOut] = None


class MetricsOut(BaseModel):
    train_loss: float = Field(description="aggregated training loss of the round")
    head_accuracy: list[float] = Field(description="server-side held-out top-1 accuracy per lookahead head")
    tau: Optional[float] = Field(None, description="server-side mean accepted tokens per decoding step")
    client_head_accuracy: Optional[list[float]] = None
    client_tau: Optional[float] = None


class RejectedOut(BaseModel):
    reason: str


class ParticipationOut(BaseModel):
    sampled: int
    succeeded: int
    dropped: int
    rejected: list[RejectedOut]


class PrivacyOut(BaseModel):
    epsilon_max: Optional[float] = Field(None, description="null when unbounded (no DP)")
    epsilon_mean: Optional[float] = None
    delta: Optional[float] = None


class BytesOut(BaseModel):
    down_per_client: int = Field(description="heads sent to one sampled client")
    up_per_client: int = Field(description="one client's (masked) update")
    eval_push_per_client: int = Field(description="heads pushed to one client for evaluation")


class SecondsOut(BaseModel):
    fit: Optional[float] = Field(None, description="the train exchange (SecAgg+ stages and aggregation)")
    server_eval: Optional[float] = None
    client_eval: Optional[float] = None
    client_train_sum: Optional[float] = Field(None, description="the clients' own training time, summed")


class RoundOut(BaseModel):
    round: int
    metrics: MetricsOut
    tau_heads_only: Optional[float] = Field(
        None, description="server-side tau of the heads alone, without the n-gram drafter (measured on the last round)"
    )
    participation: ParticipationOut
    privacy: PrivacyOut
    wall_seconds: float
    bytes_per_client: int
    bytes: Optional[BytesOut] = Field(None, description="null for rounds recorded before schema v3")
    seconds: Optional[SecondsOut] = Field(None, description="null for rounds recorded before schema v3")
    recorded_at: datetime


class ErrorOut(BaseModel):
    detail: str


class BenchmarkRunOut(BaseModel):
    kind: str = Field(description="federated_nodp or dp")
    epsilon: Optional[float] = Field(description="the run's target epsilon (null: no DP)")
    tau: float


class PrivacyUtilityOut(BaseModel):
    epsilon: list[float] = Field(description="target epsilons of the DP runs (delta 1e-5, all rounds)")
    dp: list[float] = Field(description="heads-only tau on the clients' held-out code at each epsilon")
    references: dict[str, float] = Field(description="public_only, federated_nodp, central_nodp tau")
    clients: Optional[int]
    rounds: Optional[int]
    this_run: Optional[BenchmarkRunOut] = Field(description="where this run sits on the curve")


# ------------------------------------------------------------------------------------------- app


def _safe_filename(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "run"


def _wants_html(request: Request) -> bool:
    return not request.url.path.startswith(("/api/", "/openapi.json", "/static/"))


def create_app(
    store: RunStore | str | None = None, *, token: str | None = None, run_dir: str | Path | None = None
) -> FastAPI:
    """The dashboard app over ``store`` (a RunStore, or a SQLAlchemy URL / SQLite path, or None for the
    default DB, which is then opened read-only and must exist: StoreUnavailable otherwise).

    ``run_dir``: a folder holding ``<run-id>/`` run folders, besides the store's own folder, from which
    checkpoints may be served (for a store kept elsewhere than its runs)."""
    store = store if isinstance(store, RunStore) else RunStore(store, read_only=True)
    roots = ([store.sqlite_path.parent] if store.sqlite_path is not None else []) + ([Path(run_dir)] if run_dir else [])
    run_roots = [Path(os.path.realpath(root)) for root in roots]
    token = token or None
    app = FastAPI(
        title="FedLookahead dashboard",
        version="1",
        docs_url="/docs",
        redoc_url=None,
        description="Read-only view of federated runs recorded in the run store. " + PRIVACY_NOTE,
    )
    app.state.store = store
    templates = Jinja2Templates(directory=str(TEMPLATES_DIR))
    templates.env.filters["show"] = lambda v: v if isinstance(v, str) else json.dumps(v)  # true/null, not True/None
    templates.env.filters["exponent"] = lambda v: re.sub(r"e([+-])0*(\d)", r"e\1\2", f"{v:g}")  # 1e-5, as in JS

    def with_token(request: Request, url: str) -> str:
        """Links and assets carry the browser's ?token= so that every request stays authorised."""
        value = request.query_params.get("token") if token else None
        if not value:
            return url
        return f"{url}{'&' if '?' in url else '?'}{urlencode({'token': value})}"

    def page(request: Request, name: str, status_code: int = 200, **context) -> HTMLResponse:
        context.update(url=lambda u: with_token(request, u), privacy_note=PRIVACY_NOTE)
        return templates.TemplateResponse(request, name, context, status_code=status_code)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if request.method not in ("GET", "HEAD"):
            return JSONResponse(
                {"detail": "read-only dashboard: only GET is allowed"}, status_code=405, headers={"Allow": "GET, HEAD"}
            )
        if token is None and not host_header_is_loopback(request.headers.get("host")):
            return JSONResponse(
                {"detail": refused_host_message(request.headers.get("host"), "dashboard")}, status_code=400
            )
        if token is not None:
            header = request.headers.get("authorization", "")
            given = header[7:].strip() if header.lower().startswith("bearer ") else request.query_params.get("token")
            if not given or not hmac.compare_digest(given.encode(), token.encode()):
                if _wants_html(request):
                    return HTMLResponse(
                        "<!doctype html><title>401</title><p>Missing or invalid token: open this "
                        "page with ?token=&lt;token&gt;.</p>",
                        status_code=401,
                        headers={"WWW-Authenticate": "Bearer"},
                    )
                return JSONResponse(
                    {"detail": "missing or invalid token"}, status_code=401, headers={"WWW-Authenticate": "Bearer"}
                )
        if not request.url.path.startswith("/static/"):
            try:
                store.check_available()
            except StoreUnavailable as exc:
                return unavailable(request, str(exc))
        response = await call_next(request)
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("Referrer-Policy", "no-referrer")  # never leak ?token= to other sites
        response.headers.setdefault("X-Frame-Options", "DENY")
        if request.url.path != "/docs":  # FastAPI's own docs page loads Swagger UI from its CDN
            response.headers.setdefault(
                "Content-Security-Policy",
                "default-src 'self'; img-src 'self' data:; style-src 'self'; "
                "script-src 'self'; connect-src 'self'; frame-ancestors 'none'",
            )
        if request.url.path.startswith("/api/"):
            response.headers.setdefault("Cache-Control", "no-store")
        return response

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if _wants_html(request) and exc.status_code in (400, 404):
            return page(request, "error.html", exc.status_code, title=f"{exc.status_code}", message=str(exc.detail))
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)

    def unavailable(request: Request, message: str) -> Response:
        log.error("run store unavailable: %s", message)
        if _wants_html(request):
            return page(request, "error.html", 503, title="503", message=message)
        return JSONResponse({"detail": message}, status_code=503, headers={"Cache-Control": "no-store"})

    @app.exception_handler(SQLAlchemyError)
    async def database_error(request: Request, exc: SQLAlchemyError):
        return unavailable(request, f"cannot read the run store: {one_line(exc)}")

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        message = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        if _wants_html(request):
            return page(request, "error.html", 400, title="400", message=message)
        return JSONResponse({"detail": message}, status_code=400)

    def run_or_404(run_id: str) -> dict:
        run = store.get_run(run_id)
        if run is None:
            raise HTTPException(404, f"unknown run id {run_id!r}")
        return run

    # ---------------------------------------------------------------------------------- JSON API

    @app.get("/api/runs", response_model=list[RunSummaryOut], tags=["api"], summary="All runs, newest first")
    def api_runs():
        return store.list_runs()

    @app.get(
        "/api/runs/{run_id}",
        response_model=RunOut,
        responses={404: {"model": ErrorOut}},
        tags=["api"],
        summary="One run: config, SecAgg+ settings, status, latest checkpoint",
    )
    def api_run(run_id: str):
        return run_or_404(run_id)

    @app.get(
        "/api/runs/{run_id}/rounds",
        response_model=list[RoundOut],
        responses={404: {"model": ErrorOut}},
        tags=["api"],
        summary="The run's aggregated metrics, participation and privacy per round",
    )
    def api_rounds(run_id: str, since: Optional[int] = Query(None, description="only rounds after this one")):
        run_or_404(run_id)
        rounds = store.get_rounds(run_id)
        return rounds if since is None else [r for r in rounds if r["round"] > since]

    # ------------------------------------------------------------------------------------- pages

    @app.get(
        "/api/runs/{run_id}/privacy-utility",
        response_model=PrivacyUtilityOut,
        responses={404: {"model": ErrorOut}},
        tags=["api"],
        summary="The privacy-utility curve of the benchmark this run was part of (heads-only tau against epsilon)",
    )
    def api_privacy_utility(run_id: str):
        run_or_404(run_id)
        curve = privacy_utility_curve(_run_folders(run_roots, run_id), run_id)
        if curve is None:
            raise HTTPException(404, f"run {run_id!r} was not part of a privacy-utility benchmark")
        return curve

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def index(request: Request):
        return page(request, "index.html", runs=store.list_runs())

    @app.get("/runs/{run_id}", response_class=HTMLResponse, include_in_schema=False)
    def run_page(request: Request, run_id: str):
        run = run_or_404(run_id)
        curve = privacy_utility_curve(_run_folders(run_roots, run_id), run_id)
        return page(request, "run.html", run=run, rounds=store.get_rounds(run_id), privacy_utility=curve)

    @app.get("/runs/{run_id}/checkpoint", include_in_schema=False)
    def checkpoint(run_id: str, round: Optional[int] = Query(None, ge=0)):
        run_or_404(run_id)
        recorded = store.checkpoints(run_id)
        if round is None:
            chosen = store.latest_checkpoint(run_id)
        else:
            chosen = next((c for c in recorded if c["round"] == round), None)
        if chosen is None:
            raise HTTPException(
                404, f"run {run_id!r} has no recorded checkpoint" + ("" if round is None else f" for round {round}")
            )
        return _checkpoint_response(run_id, chosen, _run_folders(run_roots, run_id))

    app.mount("/static", StaticFiles(directory=str(STATIC_DIR)), name="static")
    return app


def _inside(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
        return True
    except ValueError:
        return False


def _run_folders(roots: list[Path], run_id: str) -> list[Path]:
    """Where the run's checkpoints may live: ``<root>/<run-id>/`` for each run-dir root. Only the
    operator chooses the roots (never a database row), and a run id that is not one path component
    has no folder."""
    if not run_id or run_id in (".", "..") or "/" in run_id or "\\" in run_id or "\0" in run_id:
        return []
    return [Path(os.path.realpath(root / run_id)) for root in roots]


def privacy_utility_curve(run_folders: list[Path], run_id: str) -> dict | None:
    """The curve of the privacy-utility benchmark (simulations/privacy_utility.py) that left its JSON in
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


def _checkpoint_response(run_id: str, checkpoint: dict, run_folders: list[Path]) -> Response:
    """Serve exactly a recorded checkpoint path: the file, or a zip of the directory's regular files.

    The path (symlinks resolved) must lie under the run's folder (`_run_folders`): a database row that
    names any other file (``/etc/passwd``) is never served. Symlinks may not lead outside the recorded
    location either (the file's own directory, or the checkpoint directory for a zip)."""
    recorded = Path(checkpoint["path"]).expanduser()
    if not recorded.is_absolute():
        recorded = Path.cwd() / recorded
    recorded = Path(os.path.abspath(recorded))
    resolved = recorded.resolve()
    headers = {
        "X-Checkpoint-Sha256": checkpoint["sha256"],
        "X-Checkpoint-Round": str(checkpoint["round"]),
        "X-Head-Version": str(checkpoint["head_version"]),
    }
    stem = f"{_safe_filename(run_id)}-round{checkpoint['round']}-v{checkpoint['head_version']}"
    if not any(_inside(resolved, folder) and resolved != folder for folder in run_folders):
        log.warning("refused checkpoint path outside the run folder of %r", run_id)
        raise HTTPException(404, "the recorded checkpoint path is outside the run's folder: not served")
    if not _inside(resolved, recorded.parent.resolve()):
        raise HTTPException(404, "checkpoint path leaves its recorded location")
    if resolved.is_file():
        return FileResponse(
            resolved,
            media_type="application/octet-stream",
            headers=headers,
            filename=f"{stem}-{_safe_filename(recorded.name)}",
        )
    if resolved.is_dir():
        return StreamingResponse(
            _zip_directory(resolved),
            media_type="application/zip",
            headers={**headers, "Content-Disposition": f'attachment; filename="{stem}.zip"'},
        )
    raise HTTPException(404, f"checkpoint of round {checkpoint['round']} is recorded but no longer on disk")


def _zip_directory(root: Path, chunk: int = 1 << 20) -> Iterator[bytes]:
    with tempfile.SpooledTemporaryFile(max_size=64 << 20) as buffer:
        with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
            for path in sorted(root.rglob("*")):
                target = path.resolve()
                if target.is_file() and _inside(target, root):
                    archive.write(target, arcname=path.relative_to(root).as_posix())
        buffer.seek(0)
        while data := buffer.read(chunk):
            yield data


# ----------------------------------------------------------------------------------------- serve


class _RedactToken(logging.Filter):
    """Keep ?token=... out of the access log."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(
                re.sub(r"(token=)[^&\s]*", r"\1***", a) if isinstance(a, str) else a for a in record.args
            )
        return True


def check_bind(host: str, token: str | None) -> None:
    """Refuse (one-line ValueError) to serve beyond loopback without a strong enough token."""
    if token is not None and not token.strip():
        raise ValueError("the dashboard token is empty")
    if not is_loopback(host):
        if not token:
            raise ValueError(
                f"refusing to bind the dashboard to {host}: binding beyond 127.0.0.1 requires --token or ${TOKEN_ENV}"
            )
        if len(token) < MIN_TOKEN_LENGTH:
            raise ValueError(
                f"the dashboard token must be at least {MIN_TOKEN_LENGTH} characters when binding to {host}"
            )


def serve(
    db: str | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    token: str | None = None,
    run_dir: str | Path | None = None,
) -> None:
    """Run the dashboard with uvicorn until interrupted (``run_dir``: see `create_app`)."""
    import uvicorn

    token = token or os.environ.get(TOKEN_ENV) or None
    check_bind(host, token)
    app = create_app(db, token=token, run_dir=run_dir)
    logging.getLogger("uvicorn.access").addFilter(_RedactToken())
    where = f"http://{host}:{port}/" + ("?token=<token>" if token else "")
    log.info("dashboard over %s at %s", app.state.store.url, where)
    uvicorn.run(app, host=host, port=port, log_level="info", workers=1)
