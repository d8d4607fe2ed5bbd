"""The HTML pages (Jinja2 templates): the runs list, a run's page and its checkpoint download link."""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional
from urllib.parse import urlencode

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates

from server.dashboard.api import run_or_404
from server.dashboard.downloads import checkpoint_response, run_folders_under
from server.run.curve import curve_of_run
from server.store.run_store import RunStore

TEMPLATES_DIR = Path(__file__).resolve().parent / "templates"
PRIVACY_NOTE = (
    "Individual client updates are never stored. With SecAgg+ the server only ever sees the "
    "aggregate of the sampled clients' updates; every number here is per round and aggregated."
)


def page_renderer(token: str | None) -> Callable[..., HTMLResponse]:
    """`page(request, name, status_code=200, **context)`: a template rendered with the privacy note and
    links that carry the browser's token (when the dashboard has one)."""
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

    return page


def add_page_routes(app: FastAPI, store: RunStore, run_roots: list[Path], page: Callable[..., HTMLResponse]) -> None:
    """The HTML routes over `store`, rendered by `page` (`page_renderer`)."""

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def index(request: Request):
        return page(request, "index.html", runs=store.list_runs())

    @app.get("/runs/{run_id}", response_class=HTMLResponse, include_in_schema=False)
    def run_page(request: Request, run_id: str):
        run = run_or_404(store, run_id)
        curve = curve_of_run(run_folders_under(run_roots, run_id))
        curve = asdict(curve) if curve is not None else None
        return page(request, "run.html", run=run, rounds=store.get_rounds(run_id), privacy_utility=curve)

    @app.get("/runs/{run_id}/checkpoint", include_in_schema=False)
    def checkpoint(run_id: str, round: Optional[int] = Query(None, ge=0)):
        run_or_404(store, run_id)
        recorded = store.checkpoints(run_id)
        if round is None:
            chosen = store.latest_checkpoint(run_id)
        else:
            chosen = next((c for c in recorded if c["round"] == round), None)
        if chosen is None:
            raise HTTPException(
                404, f"run {run_id!r} has no recorded checkpoint" + ("" if round is None else f" for round {round}")
            )
        return checkpoint_response(run_id, chosen, run_folders_under(run_roots, run_id))
