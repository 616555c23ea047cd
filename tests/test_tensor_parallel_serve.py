"""`radixserve serve --tensor-parallel-size 2`: the server over a TP group, alone and on Ray Serve.

The server's tokens equal a TP=1 engine's; a terminal's Ctrl-C, which reaches every process of
the server's group, leaves the workers to finish the streams in flight; a killed worker turns
/health to 503 with the reason and requests are refused with a 503 naming it (engine_unavailable);
Ctrl-C ends the server and every worker. On Ray Serve
(marked `cluster`: the session's cluster, joined as a second app), one replica is one TP group
of two ranks; the driver catches both stop signals its parent ignored or blocked, and SIGTERM
stops it cleanly.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import httpx
import psutil
import pytest
from cluster_util import REPLICA_CPUS, STARTUP_TIMEOUT_S

from radixserve import Engine, SamplingParams
from radixserve.ports import free_port
from tests.server_util import wait_for
from tests.stop_util import (
    EXIT_GUARD_S,
    health_status,
    kill_tree,
    start_hardened,
    stop_signal_dispositions,
    stops_cleanly,
)
from tests.test_server_cli import start_serve, stop

TP_APP = "tp"
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
MAX_TOKENS = 6


def expected_tokens(ckpt: Path) -> list[int]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return Engine(str(ckpt), page_size=16, num_pages=32).generate([PROMPT], params)[0].token_ids


def post_completion(url: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "logprobs": 0, "return_tokens_as_token_ids": True})


def completion(url: str, model: str) -> tuple[list[int], str]:
    """(the generated token ids, finish_reason) of a greedy completion of PROMPT."""
    r = post_completion(url, model)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    tokens = (choice.get("logprobs") or {}).get("tokens") or []
    return [int(t.removeprefix("token_id:")) for t in tokens], choice["finish_reason"]


def stream_completion(url: str, model: str, max_tokens: int, first_chunk: threading.Event) -> dict[str, object]:
    """A greedy streamed completion of PROMPT: its chunks' count, finish_reason and error
    event, if any; `first_chunk` is set once one has arrived (or the stream has ended)."""
    got: dict[str, object] = {"chunks": 0, "finish_reason": None, "error": None}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
                "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    got["error"] = event["error"]
                    continue
                got["chunks"] = int(got["chunks"]) + 1
                got["finish_reason"] = event["choices"][0].get("finish_reason") or got["finish_reason"]
                first_chunk.set()
    except httpx.HTTPError as error:
        got["error"] = repr(error)
    finally:
        first_chunk.set()
    return got


def test_serve_over_a_tp_group_then_a_killed_worker_and_ctrl_c(tiny_llama_dir: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    expected = expected_tokens(tiny_llama_dir)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # Its own process group, as a shell's job: a terminal's Ctrl-C goes to every process in it.
    monkeypatch.setattr(subprocess, "Popen", functools.partial(subprocess.Popen, start_new_session=True))
    process = start_serve(port, "--model", str(tiny_llama_dir), "--device", "cpu", "--tensor-parallel-size", "2")
    monkeypatch.undo()
    children: list[psutil.Process] = []
    try:
        # the fork server, rank 1 (its child), multiprocessing's resource tracker
        children = psutil.Process(process.pid).children(recursive=True)
        assert all(os.getpgid(p.pid) == process.pid for p in children)
        assert completion(url, str(tiny_llama_dir)) == (expected, "length")
        # Ctrl-C's SIGINT and a service manager's SIGTERM as the rest of the group gets them, a
        # stream in flight: the workers and their fork server carry on (the server's own
        # SIGINT, its drain, comes last, as a real os.killpg).
        first_chunk, streamed = threading.Event(), {}
        streaming = threading.Thread(target=lambda: streamed.update(
            stream_completion(url, str(tiny_llama_dir), 200, first_chunk)), daemon=True)
        streaming.start()
        assert first_chunk.wait(EXIT_GUARD_S)
        assert streaming.is_alive(), streamed  # still in flight when the signal lands
        for child in children:
            os.kill(child.pid, signal.SIGINT)
            os.kill(child.pid, signal.SIGTERM)
        streaming.join(EXIT_GUARD_S)
        assert streamed["error"] is None and streamed["finish_reason"] == "length", streamed
        assert all(p.is_running() for p in children) and health_status(url) == 200
        rank1 = next(p for p in children if p.ppid() != process.pid and "forkserver" in " ".join(p.cmdline()))
        rank1.kill()  # a zombie until the server reaps it: wait for /health, not for the pid
        assert wait_for(lambda: health_status(url) == 503, EXIT_GUARD_S)
        assert "rank 1" in httpx.get(f"{url}/health", timeout=30).json()["reason"]
        failed = post_completion(url, str(tiny_llama_dir))  # refused at once, naming the fault
        assert failed.status_code == 503, failed.text
        error = failed.json()["error"]
        assert error["code"] == "engine_unavailable" and "rank 1" in error["message"]
        assert "until it is restarted" in error["message"]
        os.killpg(process.pid, signal.SIGINT)  # a terminal's Ctrl-C
        process.wait(EXIT_GUARD_S)
        assert process.returncode == 0
        _, alive = psutil.wait_procs(children, timeout=EXIT_GUARD_S)
        assert not alive
    finally:
        stop(process)
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.kill()


@pytest.mark.cluster
@pytest.mark.timeout(900)  # a TP start on Ray, on a loaded machine
def test_a_tp_group_joins_the_session_cluster_as_a_second_app_and_stops_on_a_blocked_sigterm(
        tiny_llama_dir: Path, ray_cluster: SimpleNamespace) -> None:
    """`serve --ray-address` joins the session's cluster (the local Ray that `serve --replicas`
    started: cluster_util) as a second app, under its own name and route prefix; its one
    replica is one TP group of two ranks, whose tokens equal TP=1's. Started as a careless
    parent leaves it (SIGINT ignored, both stop signals blocked: tests/stop_util.py), the
    driver catches SIGINT and SIGTERM once serving (joining, ray.init replaces the SIGTERM
    handler too); SIGTERM then deletes its app alone: its replica and rank end, the session's
    app serves on. What each signal does once caught, hung teardowns included, is
    test_cluster_signals.py's, without Ray."""
    from ray import serve

    expected = expected_tokens(tiny_llama_dir)
    # Not start_serve: a replica's start on a loaded machine can take longer than its 2 minutes.
    process = start_hardened(
        [sys.executable, "-m", "radixserve", "serve", "--ray-address", "auto",  # the session's: cluster_util
         "--port", str(ray_cluster.port), "--app-name", TP_APP, "--route-prefix", f"/{TP_APP}",
         "--model", str(tiny_llama_dir), "--device", "cpu", "--tensor-parallel-size", "2",
         "--replica-cpus", str(REPLICA_CPUS), "--num-pages", "32", "--shutdown-timeout-s", str(EXIT_GUARD_S / 2)])
    try:
        url = f"{ray_cluster.url}/{TP_APP}"
        assert wait_for(lambda: health_status(url) == 200, STARTUP_TIMEOUT_S)
        assert completion(url, str(tiny_llama_dir)) == (expected, "length")
        both = {signal.SIGINT, signal.SIGTERM}
        assert stop_signal_dispositions(process.pid) == {"blocked": set(), "ignored": set(), "caught": both}
        (replica,) = [p for p in psutil.process_iter(["cmdline"])
                      if " ".join(p.info["cmdline"] or ()).startswith(f"ray::ServeReplica:{TP_APP}:EngineReplica")]
        group = [replica, *replica.children(recursive=True)]  # the fork server, and rank 1 its child
        assert any("forkserver" in " ".join(p.cmdline()) and p.ppid() != replica.pid for p in group)
    except BaseException:
        kill_tree(process)
        raise
    stops_cleanly(process, signal.SIGTERM)
    assert TP_APP not in serve.status().applications
    _, alive = psutil.wait_procs(group, timeout=EXIT_GUARD_S)
    assert not alive, [p.pid for p in alive]
    assert completion(ray_cluster.url, "demo")[1] == "length"  # the session's app carries on
