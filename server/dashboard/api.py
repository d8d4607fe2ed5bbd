"""The JSON API: runs, one run, its rounds, and its privacy-utility curve (models in models.py)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Optional

from fastapi import FastAPI, HTTPException, Query

from server.dashboard.downloads import run_folders_under
from server.dashboard.models import ErrorOut, PrivacyUtilityOut, RoundOut, RunOut, RunSummaryOut
from server.run.curve import curve_of_run
from server.store.run_store import RunStore


def run_or_404(store: RunStore, run_id: str) -> dict:
    run = store.get_run(run_id)
    if run is None:
        raise HTTPException(404, f"unknown run id {run_id!r}")
    return run


def add_api_routes(app: FastAPI, store: RunStore, run_roots: list[Path]) -> None:
    """The /api/... routes over `store` (`run_roots`: where run folders may be, see create_app)."""

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
        return run_or_404(store, run_id)

    @app.get(
        "/api/runs/{run_id}/rounds",
        response_model=list[RoundOut],
        responses={404: {"model": ErrorOut}},
        tags=["api"],
        summary="The run's aggregated metrics, participation and privacy per round",
    )
    def api_rounds(run_id: str, since: Optional[int] = Query(None, description="only rounds after this one")):
        run_or_404(store, run_id)
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
        run_or_404(store, run_id)
        curve = curve_of_run(run_folders_under(run_roots, run_id))
        if curve is None:
            raise HTTPException(404, f"run {run_id!r} was not part of a privacy-utility benchmark")
        return asdict(curve)
