"""The tensor-parallel group: which rank this process is, and the collectives the ranks share.

Ranks meet at a TCP store (torchrun's variables: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE;
see `Rendezvous`). Process groups are built directly over that store, not through
`torch.distributed.init_process_group`, so that an engine owns its group: two engines in
one process (tests) and an engine closed and built again never share global state.

Two groups over the one store:
- *compute*: the model's all-reduces and the logits gather (NCCL on CUDA, gloo on the CPU),
  with the group timeout, so a peer that hangs turns into an error, not a hang;
- *control*: rank 0's step plans (gloo, host memory). A worker waits for the next plan with
  no practical bound (a server may idle for days); a rank 0 that dies closes the sockets
  and the waiting worker's receive fails at once.
"""

from __future__ import annotations

import datetime
import errno
import math
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from radixserve.ports import free_port

DEFAULT_TIMEOUT_S = 120.0  # a collective that waits longer than this on a peer fails
START_TIMEOUT_S = 1800.0  # ranks joining and loading their shards (polled: a dead worker fails it at once)
TIMEOUT_ENV = "RADIXSERVE_TP_TIMEOUT_S"  # overrides it (a multi-node group on a slow network; tests)


def collective_timeout_s() -> float:
    """The collective timeout: $RADIXSERVE_TP_TIMEOUT_S, else DEFAULT_TIMEOUT_S."""
    text = os.environ.get(TIMEOUT_ENV)
    if text is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    # (inf overflowed torch's timedelta deep in a group's start; nan passed the bound)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{TIMEOUT_ENV}: must be a number of seconds > 0, got {text!r}")
    return value


_LISTEN_TRIES = 16  # binds of a free port for the rendezvous (another process may take one first)
_IDLE_WAIT = datetime.timedelta(days=365)  # a worker's wait for the next plan
_HEADER_INTS = 1


class TensorParallelFault(RuntimeError):
    """The tensor-parallel group is broken (a worker died or hangs, at start-up or in a step);
    the engine cannot step."""


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one group meet: rank 0 hosts a TCP store at `host:port`.

    `from_env` reads torchrun's variables, so ranks started by torchrun (or by hand on
    several nodes) find each other; for a single host `local` picks a free port.
    """

    host: str
    port: int
    world_size: int

    @classmethod
    def local(cls, world_size: int) -> tuple[Rendezvous, socket.socket]:
        """A rendezvous on this host, with the socket rank 0's store is to serve on (give it
        to rank 0's TensorParallelGroup): listening on 127.0.0.1 alone, since the store
        authenticates nobody (a store bound by port listens on every interface), and held
        from here on, so that no other process takes the port before the store starts."""
        for _ in range(_LISTEN_TRIES):
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                listener.bind(("127.0.0.1", free_port()))
                listener.listen(world_size * 4)
            except OSError as error:
                listener.close()
                if error.errno != errno.EADDRINUSE:
                    raise
                continue  # taken between the probe and the bind
            return cls("127.0.0.1", listener.getsockname()[1], world_size), listener
        raise OSError(errno.EADDRINUSE, "no free port on 127.0.0.1 for the tensor-parallel rendezvous")

    @classmethod
    def from_env(cls, world_size: int | None = None) -> Rendezvous | None:
        """The rendezvous torchrun's MASTER_ADDR / MASTER_PORT / WORLD_SIZE name, or None
        when MASTER_PORT is unset."""
        port = os.environ.get("MASTER_PORT")
        if not port:
            return None
        size = int(os.environ.get("WORLD_SIZE", world_size or 0))
        if world_size is not None and size != world_size:
            raise ValueError(f"WORLD_SIZE={size} differs from tensor_parallel_size={world_size}")
        return cls(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(port), size)


class TensorParallelGroup:
    """One rank's view of its group: rank, size, and the collectives (see module docstring).

    All tensors passed to the compute collectives live on `device`; plans are int32 numpy
    arrays.
    """

    def __init__(self, rendezvous: Rendezvous, rank: int, device: torch.device, *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, peers_failed: Callable[[], str | None] = lambda: None,
                 listener: socket.socket | None = None) -> None:
        """Joins the group (blocks until every rank has). `peers_failed`: rank 0 polls it
        while waiting, so a worker that dies at start-up fails the join at once. `listener`:
        rank 0's store serves on it (`Rendezvous.local`; the store takes it over), else it
        binds the rendezvous port on every interface (several nodes)."""
        if not 0 <= rank < rendezvous.world_size:
            raise ValueError(f"rank {rank} is not in 0..{rendezvous.world_size - 1}")
        self.rank = rank
        self.world_size = rendezvous.world_size
        self.device = device
        self.timeout_s = timeout_s
        timeout = datetime.timedelta(seconds=timeout_s)
        # Under torchrun its agent already hosts the store at MASTER_PORT: every rank is a client.
        hosts_store = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        listen = {"master_listen_fd": listener.fileno()} if hosts_store and listener is not None else {}
        try:
            tcp_store = dist.TCPStore(rendezvous.host, rendezvous.port, rendezvous.world_size, hosts_store,
                                      timeout=timeout, wait_for_workers=False, **listen)
        except BaseException:
            if listener is not None:
                listener.close()
            raise
        if listen:
            listener.detach()  # the store closes it
        store = dist.PrefixStore("radixserve-tp", tcp_store)
        self._store = store
        self.peers_failed = peers_failed
        self.announce("joined")
        if rank == 0:
            self.wait_for_all("joined")
        self._control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, self.world_size, timeout)
        compute_store = dist.PrefixStore("compute", store)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            self._compute = dist.ProcessGroupNCCL(compute_store, rank, self.world_size)
        else:
            self._compute = dist.ProcessGroupGloo(compute_store, rank, self.world_size, timeout)

    def announce(self, stage: str) -> None:
        """Tells rank 0 that this rank has reached `stage` (start-up only)."""
        self._store.set(f"{stage}/{self.rank}", "1")

    def wait_for_all(self, stage: str, timeout_s: float = START_TIMEOUT_S) -> None:
        """Rank 0: waits until every rank has announced `stage`; TensorParallelFault at once when
        `peers_failed` reports a failure, or after `timeout_s` (start-up: a worker importing
        torch or loading a large shard may take minutes, longer than any collective should)."""
        keys = [f"{stage}/{rank}" for rank in range(self.world_size)]
        deadline = time.monotonic() + timeout_s
        while not self._store.check(keys):
            failed = self.peers_failed()
            if failed is not None:
                raise TensorParallelFault(f"tensor-parallel start-up ({stage}) failed: {failed}")
            if time.monotonic() > deadline:
                raise TensorParallelFault(f"tensor-parallel start-up: not every rank reached {stage!r} "
                                          f"within {timeout_s:g} s")
            time.sleep(0.05)

    @property
    def is_driver(self) -> bool:
        """Rank 0: it schedules and sends the plans."""
        return self.rank == 0

    # ---------------------------------------------------------------- compute
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums `tensor` over the ranks, in place; returns it."""
        self._compute.allreduce([tensor]).wait()
        return tensor

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0: every rank's `tensor` joined along the last dimension (rank order); the
        other ranks get their own `tensor` back. Each rank's tensor has the same shape."""
        opts = dist.GatherOptions()
        opts.rootRank = 0
        tensor = tensor.contiguous()
        if self.rank == 0:
            parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
            self._compute.gather([parts], [tensor], opts).wait()
            return torch.cat(parts, dim=-1)
        self._compute.gather([], [tensor], opts).wait()
        return tensor

    def gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's `values` (same length on each), on every rank, in rank order."""
        local = torch.tensor(values, dtype=torch.int64)
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        self._control.allgather([parts], [local]).wait()
        return [part.tolist() for part in parts]

    # ---------------------------------------------------------------- control
    def send_plan(self, plan: np.ndarray) -> int:
        """Rank 0: broadcasts the int32 `plan` (its length first); returns the bytes sent."""
        body = torch.from_numpy(np.ascontiguousarray(plan, dtype=np.int32))
        header = torch.tensor([body.numel()], dtype=torch.int32)
        self._broadcast(header, None)
        if body.numel():
            self._broadcast(body, None)
        return header.numel() * 4 + body.numel() * 4

    def receive_plan(self) -> np.ndarray:
        """A worker: waits (without a practical bound) for rank 0's next plan."""
        header = torch.zeros(_HEADER_INTS, dtype=torch.int32)
        self._broadcast(header, _IDLE_WAIT)
        body = torch.empty(int(header[0]), dtype=torch.int32)
        if body.numel():
            self._broadcast(body, None)
        return body.numpy()

    def _broadcast(self, tensor: torch.Tensor, timeout: datetime.timedelta | None) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        if timeout is not None:
            opts.timeout = timeout
        self._control.broadcast([tensor], opts).wait()

    def close(self) -> None:
        """Ends the group's connections (peers' pending collectives fail) and releases its
        sockets, the store's included: they stayed open as long as the group was referenced
        (an engine closed but kept). No collective may run after (the runner's fault state
        sees to that on rank 0)."""
        for group in (self._compute, self._control):
            try:
                if group is not None:
                    group.abort()
            except (RuntimeError, AttributeError):
                pass
        self._compute = self._control = self._store = None  # type: ignore[assignment]


