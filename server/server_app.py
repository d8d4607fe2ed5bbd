"""The FedLookahead ServerApp: `flwr run .` runs it (component `server.server_app:app` in pyproject.toml).

All knobs come from the run config (`[tool.flwr.app.config]` plus `--run-config` overrides); the
federated loop itself is `server.federation.run_federation`.
"""

from __future__ import annotations

import logging

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from common.federation.config import FedConfig
from server.federation import run_federation

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = FedConfig.from_mapping(context.run_config)
    run_dir = run_federation(grid, context, config)
    logging.getLogger("flwr.fedla.server").info("run finished: %s", run_dir)
