"""A worker rank: load its shard, build its pool, then run rank 0's plans until told to stop.

Started by rank 0 (`run_started_worker`: spawned on CUDA, forked by a fork server on the CPU) or by
an external launcher such as torchrun on another node (`python -m radixserve.parallel.worker --model M --tensor-parallel-size N`
with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set; LOCAL_RANK picks the GPU). A worker
holds no scheduler, tree or sampler: plans tell it everything (plan.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from radixserve.attention.base import create_backend
from radixserve.attention.metadata import MetadataBuilder
from radixserve.cache.pool import PagePool
from radixserve.parallel.executor import PlanExecutor
from radixserve.parallel.group import (
    DEFAULT_TIMEOUT_S,
    Rendezvous,
    TensorParallelGroup,
    collective_timeout_s,
)
from radixserve.parallel.loading import load_shard
from radixserve.parallel.plan import CHECK, SETUP, STEP, STOP, StepPlan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker needs to join rank 0's group and load its shard."""

    model: str
    dtype: str | torch.dtype | None
    device_type: str  # "cpu" or "cuda"
    backend: str | None
    rendezvous: Rendezvous
    timeout_s: float = DEFAULT_TIMEOUT_S
    threads: int | None = None  # CPU threads per rank (None: torch's default)


def worker_device(device_type: str, rank: int) -> torch.device:
    """The device of rank `rank`: the CPU, or the GPU LOCAL_RANK names (default: rank modulo
    the GPUs visible)."""
    if device_type != "cuda":
        return torch.device("cpu")
    local = os.environ.get("LOCAL_RANK")
    return torch.device("cuda", int(local) if local is not None else rank % torch.cuda.device_count())


def run_started_worker(rank: int, spec: WorkerSpec, leader: Connection) -> None:
    """The life of a worker that rank 0 started (its process's target): `run_worker`, deaf to
    SIGINT and SIGTERM, ending when rank 0 is gone (`exit_with_leader`). A terminal's Ctrl-C
    goes to the whole process group, and a service manager's stop (systemd's default,
    `kill -TERM -PGID`) sends SIGTERM to every process of the unit, the workers included (a
    fork server's child gets Python's handlers back): a rank that died of either broke the
    group, and the server's streams in flight failed instead of draining. Rank 0 ends its
    workers itself (STOP at close, its sockets closing, SIGKILL, or its end of `leader`
    closing: processes.py)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    exit_with_leader(leader, rank)
    run_worker(rank, spec)


def exit_with_leader(leader: Connection, rank: int) -> None:
    """Exits this process once `leader` reads EOF: rank 0 holds the only write end, which
    closes when it stops the group or exits in any way (a SIGKILL too). Before, a worker in a
    collective when rank 0 was killed waited out the collective timeout (120 s), and one
    forked after rank 0 was gone (interrupted while its fork server was loading) waited for
    minutes to join a group that no longer existed. A thread, since the main one may wait in
    torch's store or a collective (both release the GIL)."""
    def watch() -> None:
        try:
            leader.recv_bytes()  # nothing is ever sent
        except (EOFError, OSError):
            pass
        logger.warning("rank 0 is gone; exiting")
        os._exit(0)

    threading.Thread(target=watch, name=f"radixserve-tp-rank{rank}-leader", daemon=True).start()


def run_worker(rank: int, spec: WorkerSpec) -> None:
    """A worker's whole life: joins the group, loads its shard, serves plans until STOP."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{rank} %(levelname)s %(message)s")
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    device = worker_device(spec.device_type, rank)
    group = TensorParallelGroup(spec.rendezvous, rank, device, timeout_s=spec.timeout_s)
    try:
        loaded = load_shard(spec.model, group, dtype=spec.dtype, device=device, with_tokenizer=False)
        setup = group.receive_plan()
        if int(setup[0]) != SETUP:
            return  # rank 0 stopped before the pools were sized
        num_pages, page_size, host_pages, verify = setup[1:5].tolist()
        shape = dict(num_layers=loaded.model.num_layers, num_kv_heads=loaded.model.num_kv_heads,
                     head_dim=loaded.model.head_dim, dtype=loaded.dtype)
        pool = PagePool(num_pages, page_size, device=device, **shape)
        host_pool = (PagePool(host_pages, page_size, device="cpu", pin_memory=device.type == "cuda", **shape)
                     if host_pages else None)
        backend = create_backend(spec.backend, device, loaded.dtype)
        executor = PlanExecutor(loaded.model, pool, backend, loaded.dtype,
                                MetadataBuilder(page_size, device, verify=bool(verify)), host_pool)
        group.announce("ready")
        serve_plans(executor, group)
    finally:
        group.close()


def serve_plans(executor: PlanExecutor, group: TensorParallelGroup) -> None:
    """Runs plans until STOP; returns early (the group is broken) when rank 0 is gone."""
    while True:
        message = group.receive_plan()
        kind = int(message[0])
        if kind == STOP:
            return
        plan = StepPlan.decode(message)
        executor.apply_kv_ops(plan.kv_ops)
        if kind == CHECK:
            executor.check_pages(group, plan.input_ids.tolist(), plan.tails.tolist())
            continue
        if kind != STEP:
            raise ValueError(f"unknown plan kind {kind}")
        try:
            prepared = executor.prepare(plan)
        except Exception:  # rank 0 raised the same on the same plan (the engine fails those
            # requests and retries the rest) and runs no forward: neither does this rank
            logger.exception("a plan could not be prepared; rank 0 skips it too")
            continue
        executor.forward(*prepared)


def main(argv: list[str] | None = None) -> None:
    """A worker started by an external launcher (torchrun's variables name its rank)."""
    parser = argparse.ArgumentParser(description="a radixserve tensor-parallel worker rank (rank >= 1)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--tensor-parallel-size", type=int, required=True)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--backend", default=None)
    parser.add_argument("--tp-timeout-s", type=float, default=None,
                        help="collective timeout (default: $RADIXSERVE_TP_TIMEOUT_S, else 120)")
    args = parser.parse_args(argv)
    rendezvous = Rendezvous.from_env(args.tensor_parallel_size)
    rank = int(os.environ.get("RANK", "-1"))
    if rendezvous is None or rank < 1:
        raise SystemExit("set MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK (>= 1), as torchrun does")
    device_type = torch.device(args.device).type if args.device else ("cuda" if torch.cuda.is_available() else "cpu")
    timeout_s = args.tp_timeout_s if args.tp_timeout_s is not None else collective_timeout_s()
    run_worker(rank, WorkerSpec(args.model, args.dtype, device_type, args.backend, rendezvous, timeout_s))


if __name__ == "__main__":
    main()
