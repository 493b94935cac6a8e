"""The gateway's own HTTP listener: the gateway's FastAPI app served from inside its replica.

Why: behind Serve's HTTP proxy every request crosses one more process (proxy -> gateway replica,
plus the replica fetching the body back from the proxy). On a small CPU host that hop costs more
proxy and gateway CPU per request than vLLM's whole frontend (docs/BENCHMARKS.md, generation). Serving the same app on
`generator.direct_http_port` from the
gateway replica removes the hop; routes, validation, 503 backpressure and metrics are the app's
own, so both endpoints behave the same.

Owns: binding the port, running uvicorn as a task on the replica's event loop, stopping it.
Must never: install signal handlers (they belong to the Ray worker) or swallow a bind failure
(the replica must fail to start, naming the port).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Any

logger = logging.getLogger(__name__)


def _uvicorn_server(app: Any, host: str, port: int) -> Any:
    """A uvicorn server without its signal handling (the Ray worker owns the process's signals)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # type: ignore[override]
            yield

    return Server(uvicorn.Config(app, host=host, port=port, lifespan="off", access_log=False, log_config=None,
                                 log_level="warning", timeout_keep_alive=60))


class DirectIngress:
    """One uvicorn server for `app` on host:port, as a task of the running event loop."""

    def __init__(self, app: Any, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._server = _uvicorn_server(app, host, port)
        self._task: asyncio.Task | None = None

    async def start(self, timeout_s: float = 30.0) -> None:
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as err:
            sock.close()
            raise RuntimeError(f"generator.direct_http_port: cannot bind {self.host}:{self.port}: {err} "
                               "(one gateway replica per host; the port must differ from Serve's http port)") from None
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]), name="direct-ingress")
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the server's error
                raise RuntimeError(f"direct ingress on {self.host}:{self.port} exited before it started")
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"direct ingress on {self.host}:{self.port} did not start in {timeout_s} s")
            await asyncio.sleep(0.05)
        logger.info("gateway serving its API directly on %s:%d", self.host, self.port)

    def stop(self) -> None:
        self._server.should_exit = True
