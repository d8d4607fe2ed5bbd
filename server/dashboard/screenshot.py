"""Serve the dashboard in a background thread and screenshot a run page with headless Chromium.

Used by ``fedla dashboard-screenshot`` (README image) and by the browser test. Needs Playwright's
Python package and a Chromium binary (Debian's ``chromium`` at /usr/bin/chromium, or $FEDLA_CHROMIUM).
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator
from urllib.parse import quote

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def find_chromium() -> str | None:
    """$FEDLA_CHROMIUM, else /usr/bin/chromium, else a chromium on PATH."""
    for candidate in (os.environ.get("FEDLA_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@contextmanager
def serve_in_thread(app, host: str = "127.0.0.1", port: int | None = None) -> Iterator[str]:
    """Run ``app`` with uvicorn on a loopback port in a daemon thread; yields its base URL; stops it after."""
    import uvicorn

    port = port or free_port(host)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, name="dashboard-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"dashboard did not start on {host}:{port}")
        time.sleep(0.05)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextmanager
def chromium_page(width: int = 1400, height: int = 900) -> Iterator:
    """A headless Chromium page (Playwright sync API) on the system Chromium."""
    from playwright.sync_api import sync_playwright

    executable = find_chromium()
    if executable is None:
        raise RuntimeError("no Chromium found: install Debian's chromium (/usr/bin/chromium) or set $FEDLA_CHROMIUM")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            yield page
        finally:
            browser.close()


def run_page_url(base_url: str, run_id: str, token: str | None = None) -> str:
    url = f"{base_url}/runs/{quote(run_id, safe='')}"
    return f"{url}?token={quote(token, safe='')}" if token else url


def screenshot_run(db: str | None, run_id: str, out: Path, *, width: int = 1400, timeout_s: float = 30) -> Path:
    """Render the run page of ``run_id`` from database ``db`` and save a full-page PNG at ``out``."""
    from server.dashboard.app import create_app
    from server.store.run_store import RunStore

    store = RunStore(db, read_only=True)  # refuses a missing store; never writes
    if store.get_run(run_id) is None:
        raise ValueError(f"unknown run id {run_id!r} in {store.url}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with serve_in_thread(create_app(store)) as base_url, chromium_page(width=width) as page:
        page.goto(run_page_url(base_url, run_id))
        page.wait_for_selector('body[data-ready="1"]', timeout=timeout_s * 1000)
        page.screenshot(path=str(out), full_page=True)
    store.close()
    return out
