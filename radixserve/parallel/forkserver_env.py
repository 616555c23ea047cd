"""First in the TP fork server's preload (processes.FORKSERVER_PRELOAD), before anything
imports numpy: the fork server forks the ranks, and a fork copies only the calling thread, so
a lock another thread held stays held in the child (Python 3.12 warns of it). numpy's
OpenBLAS starts a pool of threads as wide as the machine when it loads, unless told not to;
the ranks compute with torch, which sets its own threads (parallel/worker.py)."""

import os

os.environ["OPENBLAS_NUM_THREADS"] = "1"
