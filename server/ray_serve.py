"""Replicas of the layerstream server on Ray Serve, behind Serve's one HTTP endpoint.

Each replica runs exactly the app `layerstream serve` runs (`server.launch.build_server`: same routes,
same flags, same `LAYERSTREAM_*` variables) through `serve.ingress`, with its own engine loop and
model. The replica's constructor returns only once its model has loaded, so Serve counts it ready
(and routes to it) only then; its health check fails once the engine is not ready, and Serve
replaces it. Every response names its replica in the `x-layerstream-replica` header.

Two ways to start it (pip install 'layerstream[ray]'):

    layerstream serve --ray --num-replicas 2 --model demo
    serve run server.ray_serve:app_builder model=demo num_replicas=2

The second takes `flag=value` pairs, each the `layerstream serve` flag without its dashes (e.g.
`max_device_memory=4GiB`, `min_replicas=1 max_replicas=4`); it is also the `import_path` of the
KubeRay RayService in deploy/.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time

from ray import serve

from .launch import build_server, parse_flags
from .ray_options import ReplicaOptions

log = logging.getLogger("layerstream.server")

REPLICA_HEADER = b"x-layerstream-replica"
APP_NAME = "layerstream"


class _NameReplica:
    """ASGI middleware: add the replica's id to every response's headers."""

    def __init__(self, app, replica_id: str):
        self.app, self.header = app, (REPLICA_HEADER, replica_id.encode())

    async def __call__(self, scope, receive, send):
        async def named(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, named)


@serve.deployment(name="layerstream", health_check_period_s=5, health_check_timeout_s=10,
                  graceful_shutdown_timeout_s=10)
@serve.ingress()
class LayerstreamReplica:
    async def __init__(self, ns: argparse.Namespace):
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.layerstream_app, self.engine = build_server(ns)  # `app` is Serve's own attribute
        self.engine.start()
        # Loading can take minutes: wait off the event loop, and only then return, so that Serve
        # routes nothing here before the model is in memory.
        if not await asyncio.to_thread(self.engine.wait_ready):
            error = self.engine.error
            self.engine.shutdown()
            raise RuntimeError(f"replica {self.replica_id}: the model failed to load: {error}")
        log.info("replica %s ready", self.replica_id)

    def __serve_build_asgi_app__(self):
        return _NameReplica(self.layerstream_app, self.replica_id)

    def check_health(self) -> None:
        if not self.engine.ready:  # e.g. an unrecoverable step failure: Serve replaces this replica
            raise RuntimeError(f"engine {self.engine.state}: {self.engine.error}")

    def __del__(self):
        if hasattr(self, "engine"):  # absent when the constructor failed before building it
            self.engine.shutdown()


def build_application(ns: argparse.Namespace) -> serve.Application:
    """The Serve application for parsed `layerstream serve` flags (ValueError on bad options)."""
    options = ReplicaOptions.from_namespace(ns)
    return LayerstreamReplica.options(**options.deployment_options()).bind(ns)


def app_builder(args: dict) -> serve.Application:
    """Entry point for `serve run server.ray_serve:app_builder key=value ...` and serveConfigV2."""
    return build_application(parse_flags(args))


def run(ns: argparse.Namespace) -> int:
    """`layerstream serve --ray`: join (or start) a Ray cluster, deploy, serve until Ctrl-C / SIGTERM."""
    import ray

    app = build_application(ns)  # bad options fail here, before a cluster starts
    ray.init(address=ns.ray_address, logging_level=logging.WARNING)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    try:
        serve.start(http_options={"host": ns.host, "port": ns.port})
        log.info("deploying %s replica(s) of %s; Serve routes to a replica once its model is loaded",
                 ns.num_replicas if ns.min_replicas is None else f"{ns.min_replicas}..{ns.max_replicas}",
                 ns.served_model_name or ns.model)
        serve.run(app, name=APP_NAME, route_prefix="/")
        log.info("listening on http://%s:%d (Ray Serve)", ns.host, ns.port)
        while not stop:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    except RuntimeError as e:  # the deployment failed, e.g. every replica failed to load its model
        log.error("%s", e)
        return 1
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
