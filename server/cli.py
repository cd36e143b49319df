"""`layerstream serve`: uvicorn first (so /health answers 503 at once), the model loads on the
engine thread meanwhile; with --ray, replicas of the same server on Ray Serve. The server itself
(flags, LAYERSTREAM_<FLAG> variables, app and engine loop) is built by server.launch."""

from __future__ import annotations

import argparse
import asyncio
import logging
import time

from .launch import add_arguments, build_server
from .ray_options import ReplicaOptions

__all__ = ["add_arguments", "run"]

log = logging.getLogger("layerstream.server")


def run(ns: argparse.Namespace) -> int:
    import uvicorn

    if ns.ray:
        return _serve_on_ray(ns)
    from .http_protocol import guarded_protocol

    config = uvicorn.Config(None, host=ns.host, port=ns.port, log_config=None, access_log=False,
                            timeout_graceful_shutdown=ns.shutdown_grace + 5, limit_concurrency=ns.limit_concurrency,
                            timeout_keep_alive=ns.timeout_keep_alive,
                            h11_max_incomplete_event_size=ns.max_header_bytes,
                            http=guarded_protocol(ns.header_timeout))

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            # While requests are in flight, and at most for the grace period, the listener stays
            # open: new requests get 503 + Retry-After and /health 503, so a load balancer drains
            # this replica rather than meeting refused connections. The engine ends the requests
            # still running at the end of the grace period (an error event + [DONE] for a stream);
            # then uvicorn stops listening and closes the connections.
            engine.drain(ns.shutdown_grace)
            deadline = time.monotonic() + ns.shutdown_grace
            while self.server_state.tasks and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await super().shutdown(sockets)

    server = Server(config)

    def on_failed(_e: BaseException) -> None:
        server.should_exit = True  # nothing to serve: stop with a non-zero status

    config.app, engine = build_server(ns, on_failed=on_failed)
    log.info("listening on http://%s:%d (model %s loading in the background; /health is 503 until ready)",
             ns.host, ns.port, ns.served_model_name or ns.model)
    engine.start()
    try:
        server.run()
    finally:
        engine.shutdown()
    return 1 if engine.state == "failed" else 0


def _serve_on_ray(ns: argparse.Namespace) -> int:
    """`layerstream serve --ray`: bad options and a missing Ray fail here, in one line each."""
    ReplicaOptions.from_namespace(ns)
    try:
        from .ray_serve import run as run_on_ray
    except ImportError as e:
        raise ValueError(f"--ray needs Ray Serve, which is not installed ({e}): pip install 'layerstream[ray]'") from e
    return run_on_ray(ns)
