"""Serving the dashboard: the bind check (a token beyond loopback), uvicorn, and no token in the access log."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from common.loopback import is_loopback
from server.dashboard.app import create_app

TOKEN_ENV = "FEDLA_DASHBOARD_TOKEN"
MIN_TOKEN_LENGTH = 16
log = logging.getLogger("fedla.dashboard")


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
