"""How `layerstream serve --ray` places replicas: the flags, and the checked options they become.

No Ray import here: the flags exist (and `LAYERSTREAM_NUM_REPLICAS`-style variables apply) in every
install, and Ray is needed only once `--ray` is given (`pip install 'layerstream[ray]'`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


def add_ray_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Ray Serve (--ray): replicas of this server behind one endpoint")
    g.add_argument("--ray", action="store_true",
                   help="serve through Ray Serve: each replica is this server with its own engine and model")
    g.add_argument("--ray-address", default=None,
                   help="Ray cluster to join, e.g. ray://head:10001 (default: $RAY_ADDRESS, or the cluster "
                        "`ray start` runs on this machine, or else a new local one)")
    g.add_argument("--num-replicas", type=int, default=1, help="fixed number of replicas (without autoscaling)")
    g.add_argument("--min-replicas", type=int, default=None,
                   help="autoscale between --min-replicas and --max-replicas (both needed)")
    g.add_argument("--max-replicas", type=int, default=None)
    g.add_argument("--target-ongoing-requests", type=float, default=None,
                   help="autoscaling target of requests in flight per replica (default: --max-num-seqs)")
    g.add_argument("--max-ongoing-requests", type=int, default=None,
                   help="requests the router sends one replica at once; more wait in Serve's queue "
                        "(default: 2 x --max-num-seqs)")
    g.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs reserved per replica")
    g.add_argument("--replica-gpus", type=float, default=None,
                   help="GPUs per replica (default: 1 with --device cuda, else 0)")


@dataclass(frozen=True)
class ReplicaOptions:
    """Serve deployment options, checked once; `deployment_options()` is what `.options()` takes."""

    num_replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = 16.0
    max_ongoing_requests: int = 32
    num_cpus: float = 1.0
    num_gpus: float = 0.0

    def __post_init__(self):
        if self.num_replicas < 1:
            raise ValueError(f"--num-replicas must be >= 1, got {self.num_replicas}")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError("autoscaling needs both --min-replicas and --max-replicas, got "
                             f"min {self.min_replicas}, max {self.max_replicas}")
        if self.autoscaling:
            if self.min_replicas < 0 or self.max_replicas < max(1, self.min_replicas):
                raise ValueError("need 0 <= --min-replicas <= --max-replicas and --max-replicas >= 1, got "
                                 f"min {self.min_replicas}, max {self.max_replicas}")
        if not self.target_ongoing_requests > 0:
            raise ValueError(f"--target-ongoing-requests must be > 0, got {self.target_ongoing_requests}")
        if self.max_ongoing_requests < 1:
            raise ValueError(f"--max-ongoing-requests must be >= 1, got {self.max_ongoing_requests}")
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise ValueError(f"--replica-cpus and --replica-gpus must be >= 0, got {self.num_cpus}, {self.num_gpus}")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> "ReplicaOptions":
        def given(value, default):
            return default if value is None else value

        # A GPU replica owns one device: its budget planner assumes the memory is its own.
        gpus = given(ns.replica_gpus, 1.0 if ns.device.startswith("cuda") else 0.0)
        return cls(num_replicas=ns.num_replicas, min_replicas=ns.min_replicas, max_replicas=ns.max_replicas,
                   target_ongoing_requests=given(ns.target_ongoing_requests, float(ns.max_num_seqs)),
                   max_ongoing_requests=given(ns.max_ongoing_requests, 2 * ns.max_num_seqs),
                   num_cpus=ns.replica_cpus, num_gpus=gpus)

    def deployment_options(self) -> dict:
        scale = ({"autoscaling_config": {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                                         "target_ongoing_requests": self.target_ongoing_requests}}
                 if self.autoscaling else {"num_replicas": self.num_replicas})
        return {**scale, "max_ongoing_requests": self.max_ongoing_requests,
                "ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}}
