"""First in the TP fork server's preload (processes.FORKSERVER_PRELOAD): the fork server's
own settings, before anything imports numpy or torch.

- numpy's OpenBLAS starts a pool of threads as wide as the machine when it loads, unless told
  not to; the fork server forks the ranks, and a fork copies only the calling thread, so a
  lock another thread held stays held in the child (Python 3.12 warns of it). The ranks
  compute with torch, which sets its own threads (parallel/worker.py).
- SIGTERM is ignored. A service manager's stop (systemd's default: SIGTERM to every process
  of the unit) reached the fork server too, which died of it; multiprocessing then reports
  every worker it forked as exited with code 255 (it learns exits from the fork server),
  rank 0 took the group for broken, and the streams in flight failed instead of draining.
  The fork server still ends with rank 0 (multiprocessing's pipe to it closes) and the
  ranks' own SIGTERM is ignored already (worker.run_started_worker); its children get
  SIGTERM's default back (`_child_defaults`). SIGINT too while the preload runs (the fork
  server ignores it by itself only once loaded; forkserver_ready gives it back first, for the
  children's sake): a terminal's Ctrl-C during a group's start printed its KeyboardInterrupt
  traceback. (A worker it forks after rank 0 has gone exits on its own:
  worker.exit_with_leader.) The package radixserve.parallel imports nothing on its own, so
  this runs before torch and numpy load.

Only the fork server runs this (the check below): anywhere else it would make a process deaf
to SIGTERM.
"""

import os
import signal
import sys

os.environ["OPENBLAS_NUM_THREADS"] = "1"


def _child_defaults() -> None:
    """In each process the fork server forks: SIGTERM back to its default. The fork server
    restores only SIGCHLD and SIGINT in its children, and it serves every forkserver-context
    process of this program, not only the ranks (which ignore SIGTERM on their own): left
    ignored, another's `terminate()` did nothing and multiprocessing's exit waited on it."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


if "from multiprocessing.forkserver import main" in " ".join(sys.orig_argv):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # until forkserver_ready, the preload's last
    os.register_at_fork(after_in_child=_child_defaults)
