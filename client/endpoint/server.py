"""Serving the endpoint app with uvicorn on loopback, in a background thread (the daemon), kept in the
foreground by `fedla serve`."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from client.endpoint.api import create_endpoint_app
from client.endpoint.defaults import DEFAULT_MAX_QUEUE, DEFAULT_PORT
from common.errors import FedLookaheadError
from common.loopback import is_loopback
from common.model.base import Loading


def check_loopback(host: str) -> None:
    """Refuse any address other apps on the network could reach: the endpoint is for this device only."""
    if not is_loopback(host):
        raise FedLookaheadError(f"the generation endpoint listens on loopback only (127.0.0.1 or ::1), not {host!r}")


class EndpointServer:
    """uvicorn serving an endpoint app in a background thread (for the daemon and tests)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> None:
        check_loopback(host)
        self.app, self.host = app, host
        config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", lifespan="off", ws="none", timeout_graceful_shutdown=5
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="fedla-endpoint-http", daemon=True)

    def start(self, timeout: float = 30.0) -> EndpointServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise FedLookaheadError(
                    f"the generation endpoint could not listen on {self.host}:{self.server.config.port} (port in use?)"
                )
            time.sleep(0.02)
        return self

    @property
    def port(self) -> int:
        """The bound port (the real one when asked for port 0)."""
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.app.state.endpoint.close()


def start_endpoint(
    base_dir: Path,
    heads_dir: Path | None,
    *,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    loading: Loading = Loading(),
    max_queue: int = DEFAULT_MAX_QUEUE,
    datastore_dir: Path | None = None,
    datastore_cache: Path | None = None,
) -> EndpointServer:
    """Serve in a background thread (the daemon's hook); the host is checked before the base loads."""
    check_loopback(host)
    app = create_endpoint_app(
        base_dir,
        heads_dir,
        loading=loading,
        max_queue=max_queue,
        datastore_dir=datastore_dir,
        datastore_cache=datastore_cache,
    )
    return EndpointServer(app, host, port).start()


def serve_endpoint(server: EndpointServer) -> None:
    """Keep a started server in the foreground until Ctrl-C or SIGTERM (a standalone command), then stop it."""
    print(f"fedla serve: {server.url}/v1 ({server.app.state.endpoint.describe()}); Ctrl-C stops", flush=True)
    if threading.current_thread() is threading.main_thread():  # a service manager's stop is graceful too
        signal.signal(signal.SIGTERM, lambda *_: setattr(server.server, "should_exit", True))
    try:
        while server.thread.is_alive():
            server.thread.join(timeout=0.5)  # a timed join lets Ctrl-C through
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
