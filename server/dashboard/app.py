"""`create_app`: the read-only web dashboard over the run store: JSON API + HTML pages with live plots.

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

The app's guard (methods, Host header, token, store availability, security headers) and error pages are
here; the JSON API in api.py, the pages in pages.py, checkpoint downloads in downloads.py (a benchmark's
curve is a run-folder record, server/run/curve.py), and serving (bind check, uvicorn) in serve.py.
"""

from __future__ import annotations

import hmac
import logging
import os
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.loopback import host_header_is_loopback, refused_host_message
from server.dashboard.api import add_api_routes
from server.dashboard.pages import PRIVACY_NOTE, add_page_routes, page_renderer
from server.store.engine import StoreUnavailable, one_line
from server.store.run_store import RunStore

STATIC_DIR = Path(__file__).resolve().parent / "static"
log = logging.getLogger("fedla.dashboard")


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
    page = page_renderer(token)

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

    add_api_routes(app, store, run_roots)
    add_page_routes(app, store, run_roots, page)
    app.mount("/static", StaticFiles(directory=str(STATIC_DIR)), name="static")
    return app
