"""Last in the TP fork server's preload (processes.FORKSERVER_PRELOAD): gives SIGINT back
Python's default handler, which forkserver_env ignored while the preload ran. The fork server
then ignores SIGINT by itself and hands its children the handler it found here: without this
step every process it forked, the ranks' and any other code's in this process, ignored Ctrl-C
(the ranks ignore it on their own: worker.run_started_worker).

Only the fork server runs this (the check below).
"""

import signal
import sys

if "from multiprocessing.forkserver import main" in " ".join(sys.orig_argv):
    signal.signal(signal.SIGINT, signal.default_int_handler)
