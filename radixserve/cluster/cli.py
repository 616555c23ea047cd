"""`radixserve serve --replicas N [--ray-address ADDR] [--router NAME]`: serve on Ray Serve."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Any

INSTALL_HINT = "pip install -e '.[cluster]' (or pip install 'ray[serve]')"


def serve_cluster(args: argparse.Namespace, engine_options: dict[str, Any]) -> int:
    """Deploys the replicas and the ingress, serves until Ctrl-C, then tears the app down."""
    try:
        import ray  # noqa: F401
    except ImportError:
        _say(f"error: --replicas and --ray-address need Ray Serve: {INSTALL_HINT}")
        return 2
    from ray import serve

    from radixserve.cluster.deploy import ClusterOptions, deploy, start_ray

    replicas = args.replicas if args.replicas is not None else 1
    if replicas < 1:
        _say(f"error: --replicas must be >= 1, got {replicas}")
        return 2
    options = ClusterOptions(replicas=replicas, router=args.router, engine_options=engine_options,
                             replica_cpus=args.replica_cpus, served_model_name=args.served_model_name,
                             api_key=args.api_key, admin_api_key=args.admin_api_key,
                             tenant_keys=getattr(args, "tenant_keys", {}))
    # A local cluster gets enough logical CPUs for every replica, however few cores there are.
    group = max(1, args.tensor_parallel_size)  # a replica reserves a bundle per tensor-parallel rank
    local_cpus = max(os.cpu_count() or 1, int(replicas * group * args.replica_cpus + 0.999))
    start_ray(args.ray_address, num_cpus=None if args.ray_address else local_cpus)
    _say(f"deploying {replicas} replica(s) of {args.model!r}, router {args.router} "
         f"({'cluster ' + args.ray_address if args.ray_address else 'local Ray'}) ...")
    try:
        deploy(options, host=args.host, port=args.port)
    except Exception as exc:  # a replica that cannot load its model fails the deployment
        _say(f"error: deployment failed: {exc}")
        serve.shutdown()
        return 2
    _say(f"serving at http://{args.host}:{args.port}/v1 with {replicas} replica(s) "
         f"(per-replica routing at /cluster/replicas; Ctrl-C to stop)")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    _say("stopping ...")
    serve.shutdown()
    ray.shutdown()
    _say("stopped")
    return 0


def _say(message: str) -> None:
    print(f"radixserve: {message}", file=sys.stderr, flush=True)
