"""The worker processes rank 0 starts on its own host, and how they end."""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import multiprocessing.util
import threading
from collections.abc import Callable
from typing import Any

STOP_GRACE_S = 10.0  # a worker told to stop gets this long before it is terminated
# What the fork server imports before its first fork: a rank's code (worker.py imports torch
# and the loaders, which import transformers' configurations), none of it touching a device,
# after forkserver_env.py, which keeps numpy's BLAS from starting threads there and sets its
# signals (forkserver_ready.py, last, gives SIGINT back for the children).
FORKSERVER_PRELOAD = ("radixserve.parallel.forkserver_env", "radixserve.parallel.worker", "radixserve.models.loader",
                      "radixserve.parallel.forkserver_ready")
_RUNNING: list[WorkerProcesses] = []  # started here and not yet stopped: what `kill_all` ends


class WorkerProcesses:
    """Ranks 1..N-1 as child processes (none when another launcher, e.g. torchrun, starts
    them: `first_dead` then knows nothing and relies on the collectives failing)."""

    def __init__(self, processes: list[multiprocessing.process.BaseProcess] | None = None,
                 leader: multiprocessing.connection.Connection | None = None) -> None:
        self.processes = processes or []
        self._leader = leader  # the end of the workers' leader pipe rank 0 holds (see `start`)
        self._polling = threading.Lock()  # reading exit codes (first_dead)

    @classmethod
    def start(cls, target: Callable[..., Any], world_size: int, *args: Any, on_cpu: bool) -> WorkerProcesses:
        """Starts `target(rank, *args, leader)` for ranks 1..world_size-1, as daemons. `leader`
        is the read end of a pipe whose write end only rank 0 holds: it reads EOF once rank 0
        has exited or stopped the group, however that happened, and the worker then exits
        (worker.exit_with_leader). Being daemons ends them only when rank 0 exits through
        multiprocessing's handler: a rank 0 killed (SIGKILL) left its workers in a collective
        until the collective timeout, and one interrupted while its fork server was still
        loading (the first seconds of a start) never learnt its worker's pid, so the worker
        forked after it was gone lived on for minutes. On the CPU they are forks of multiprocessing's fork
        server, which imports the worker's code (torch, the model loaders) once per process:
        a group's first start pays that (8-9 s of CPU here, as a spawned rank did), later
        ones (an engine started again; the tests' many engines) fork in milliseconds and take
        1.7 s instead of 9. For CUDA they are spawned: a fresh interpreter is CUDA-safe
        whatever its imports do, and a fork server's preload on a GPU machine is unchecked."""
        if on_cpu:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(list(FORKSERVER_PRELOAD))
        else:
            context = multiprocessing.get_context("spawn")
        reader, writer = context.Pipe(duplex=False)
        processes = [context.Process(target=target, args=(rank, *args, reader), name=f"radixserve-tp-rank{rank}",
                                     daemon=True) for rank in range(1, world_size)]
        workers = cls(processes, writer)
        _RUNNING.append(workers)
        try:
            for process in processes:
                process.start()
        finally:
            reader.close()  # the workers hold theirs
        return workers

    def first_dead(self, wait_s: float = 0.0) -> str | None:
        """Why the first worker that has exited did, or None while all run; waiting up to
        `wait_s` for one to exit (after a collective failed: its peer's exit is seen a moment
        after the connection it held closed). Thread-safe: the engine's thread and the
        server's (/health, each request's admission) ask, and a fork server's child's exit
        code is read once from a pipe: read by two threads at once, one saw it closed (255)."""
        if wait_s > 0 and self.processes:
            multiprocessing.connection.wait([process.sentinel for process in self.processes], timeout=wait_s)
        with self._polling:
            for rank, process in enumerate(self.processes, start=1):
                if process.exitcode is not None:
                    return f"tensor-parallel worker rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
        return None

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Waits up to `grace_s` for the workers to exit, then kills the rest (a worker ignores
        SIGTERM: worker.run_started_worker)."""
        for process in self.processes:
            process.join(grace_s)
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join(2.0)
        if self._leader is not None:
            self._leader.close()  # a worker not started yet when a start failed exits on its own
            self._leader = None
        if self in _RUNNING:
            _RUNNING.remove(self)

    def kill(self) -> None:
        """SIGKILLs the workers still running, waiting for none (a process about to exit)."""
        for process in self.processes:
            if process.pid is not None and process.exitcode is None:
                process.kill()


def kill_all() -> None:
    """Kills every worker this process started and has not stopped: for a process that exits
    without closing its engines (os._exit runs neither close() nor multiprocessing's atexit
    terminate). A hung rank would otherwise outlive it, and with it the fork server, which
    serves while any of its children holds its descriptor."""
    for workers in list(_RUNNING):
        workers.kill()


# Before multiprocessing's own exit handler (atexit runs the last registered first; its module
# is imported above): that one terminates daemonic children and then joins them without a
# timeout, and a worker ignores SIGTERM, so an engine never closed (an exception out of main)
# would hold the exit until the group's collective timeout. Closed engines left _RUNNING.
atexit.register(kill_all)
