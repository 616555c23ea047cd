"""Tensor parallelism (radixserve/parallel) on the CPU with gloo, two ranks.

TP=2 must give exactly TP=1's tokens (and transformers'), cold and warm, under eviction,
preemption, the host tier and beam search; every rank's pool must hold its heads of every
cached page under the same page ids; a killed worker must fail the engine cleanly.
One engine start per scenario (a start spawns a process and loads a shard: seconds).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import random
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
from transformers import Qwen3Config

from radixserve import AsyncEngine, Engine, SamplingParams, cli_serve
from radixserve.cli import build_parser, engine_options, main
from radixserve.engine.engine_setup import bytes_per_page
from radixserve.models.demo import build_tokenizer
from radixserve.parallel.layers import vocab_rows
from radixserve.parallel.plan import STEP, KvOpLog, PlanBuilder, StepPlan, TableReplica
from radixserve.parallel.processes import WorkerProcesses
from radixserve.parallel.sharding import HeadLayout, parameter_bytes
from radixserve.ports import free_port
from tests.engine_util import cached_paths
from tests.server_util import wait_for
from tests.gguf_helpers import write_gguf
from tests.model_helpers import load_reference, save_random_checkpoint, write_tiny_checkpoint
from tests.test_beam_search import beam_params
from tests.test_engine import random_prompts

HANG_GUARD_S = 300.0  # generous: turns a hang into a failure, never a timing assertion
TIGHT = dict(page_size=4, num_pages=24, max_batch_tokens=64, host_num_pages=48, debug_checks=True)


def mixed_params(n: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=random.Random(i).randrange(2, 10), temperature=0.0, ignore_eos=True)
            for i in range(n)]


def tokens(outs) -> list[list[int]]:
    return [o.token_ids for o in outs]


# ---------------------------------------------------------------- plans (no processes)
def _chunk(seq_id: int, table: list[int], computed: int, new: int, total: int) -> SimpleNamespace:
    seq = SimpleNamespace(seq_id=seq_id, num_computed=computed, token_ids=list(range(total)),
                          block_table=table, pages_out_of_window=0)
    return SimpleNamespace(seq=seq, num_new=new)


def test_plans_carry_table_changes_only_and_replicas_follow() -> None:
    builder, replica = PlanBuilder(KvOpLog()), TableReplica()

    def step(chunks) -> StepPlan:
        plan = StepPlan.decode(builder.plan(chunks).encode())
        for chunk, table in zip(chunks, replica.apply(plan)):
            assert table == chunk.seq.block_table
        return plan

    long_table = list(range(100, 612))  # 2k tokens at page size 4
    first = step([_chunk(1, long_table, 0, 2048, 2048)])
    assert first.kind == STEP and len(first.tails) == 512 and first.input_ids.tolist() == list(range(2048))
    decode = step([_chunk(1, long_table, 2048, 1, 2049)])  # no new page yet
    assert len(decode.tails) == 0 and decode.logits_indices.tolist() == [0]
    long_table.append(7)  # appended in place: one entry travels
    assert step([_chunk(1, long_table, 2049, 1, 2050)]).tails.tolist() == [7]
    replaced = long_table[:300] + [9, 10]  # a new list (e.g. restored after preemption)
    plan = step([_chunk(1, replaced, 0, 1, 1200)])
    assert plan.sequences[0, 4] == 300 and plan.tails.tolist() == [9, 10]
    short = [5]
    short_decode = step([_chunk(2, short, 0, 1, 1)])
    assert (builder.plan([_chunk(2, short, 1, 1, 2)]).encode().nbytes
            == builder.plan([_chunk(1, replaced, 1200, 1, 1201)]).encode().nbytes)  # independent of context
    assert len(short_decode.tails) == 1


def test_debug_checks_catch_a_block_table_changed_in_place() -> None:
    builder = PlanBuilder(KvOpLog(), verify=True)
    table = [3, 4, 5]
    builder.plan([_chunk(1, table, 0, 12, 12)])
    table[1] = 9  # breaks the contract: only appends may change a list in place
    with pytest.raises(AssertionError, match="changed in place"):
        builder.plan([_chunk(1, table, 12, 1, 13)])


def test_head_layout_replicates_kv_heads_and_pads_the_vocabulary() -> None:
    layouts = [HeadLayout.of(8, 2, 16, 4, rank) for rank in range(4)]
    assert [lay.num_kv_heads for lay in layouts] == [1, 1, 1, 1]
    assert [lay.kv_rows.start // 16 for lay in layouts] == [0, 0, 1, 1]  # query heads 0-3 use KV head 0
    assert [lay.q_rows.start // 16 for lay in layouts] == [0, 2, 4, 6]
    assert [(r.start, r.stop, r.length) for r in (vocab_rows(321, 2, 0), vocab_rows(321, 2, 1))] == [
        (0, 161, 161), (161, 321, 161)]
    with pytest.raises(ValueError, match="divisible"):
        HeadLayout.of(6, 2, 16, 4, 0)


def test_a_size_that_does_not_divide_the_heads_is_refused_before_any_worker_starts(
        tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One error naming the heads: every worker raised it too, each with its own traceback (23
    to 110 lines from `serve`), and rank 0's named the product num_attention_heads * head_dim."""
    def no_workers(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(WorkerProcesses, "start", no_workers)
    with pytest.raises(ValueError, match=r"^num_attention_heads: 4 is not divisible by tensor_parallel_size 3$"):
        Engine(str(tiny_llama_dir), page_size=4, num_pages=16, tensor_parallel_size=3)


def test_an_engine_refused_after_its_group_started_ends_the_workers(
        tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Options checked once the model is loaded (a pool too small, a policy's name): the
    workers lived on until rank 0's half-built engine was collected, then each died with a
    gloo traceback."""
    started: list[WorkerProcesses] = []
    start = WorkerProcesses.start

    def recorded(*args, **kwargs) -> WorkerProcesses:
        started.append(start(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(WorkerProcesses, "start", recorded)
    with pytest.raises(ValueError, match="schedule"):
        Engine(str(tiny_llama_dir), page_size=4, num_pages=16, tensor_parallel_size=2, schedule_policy="nonsense")
    (workers,) = started
    assert workers.processes and not any(p.is_alive() for p in workers.processes)


def test_a_worker_dying_at_start_up_is_a_one_line_load_error(
        tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """As the OOM killer ends a rank loading a large shard: `serve` printed a traceback and
    exited 1 where rank 0's own load errors are one line and status 2."""
    start = WorkerProcesses.start

    def killed(*args, **kwargs) -> WorkerProcesses:
        workers = start(*args, **kwargs)
        for process in workers.processes:
            process.kill()
        return workers

    monkeypatch.setattr(WorkerProcesses, "start", killed)
    code = main(["serve", "--port", str(free_port()), "--model", str(tiny_llama_dir), "--device", "cpu",
                 "--tensor-parallel-size", "2", "--num-pages", "16"])
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    assert "Traceback" not in stderr
    (error,) = [line for line in stderr.splitlines() if "error" in line]
    assert error.startswith(f"radixserve: error: cannot load {str(tiny_llama_dir)!r}: tensor-parallel start-up")
    assert "rank 1" in error


@pytest.mark.parametrize("value", ["inf", "nan", "abc", "0", "-1"])
def test_a_collective_timeout_that_is_not_a_positive_number_names_the_variable(
        value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`inf` overflowed torch's timedelta deep in a group's start (a traceback), `nan` passed
    the bound, and `abc` was float()'s message, naming no variable."""
    from radixserve.parallel.group import collective_timeout_s

    monkeypatch.setenv("RADIXSERVE_TP_TIMEOUT_S", value)
    with pytest.raises(ValueError, match=rf"^RADIXSERVE_TP_TIMEOUT_S: must be a number of seconds > 0, got '{value}'$"):
        collective_timeout_s()
    monkeypatch.setenv("RADIXSERVE_TP_TIMEOUT_S", "2.5")
    assert collective_timeout_s() == 2.5


def test_serve_has_the_flag() -> None:
    args = build_parser().parse_args(["serve", "--tensor-parallel-size", "2"])
    assert engine_options(args)["tensor_parallel_size"] == 2
    assert engine_options(build_parser().parse_args(["serve"]))["tensor_parallel_size"] == 1


# ---------------------------------------------------------------- one TP=2 engine, tight pool
@pytest.fixture(scope="module")
def engines(tiny_llama_dir: Path):
    tp = Engine(str(tiny_llama_dir), tensor_parallel_size=2, **TIGHT)
    single = Engine(str(tiny_llama_dir), **TIGHT)
    yield SimpleNamespace(tp=tp, single=single, ckpt=tiny_llama_dir)
    tp.close()


def test_greedy_equals_tp1_cold_and_warm_under_eviction_preemption_and_host_tier(engines) -> None:
    prompts = random_prompts(60, seed=5)
    params = mixed_params(len(prompts))
    ample = Engine(str(engines.ckpt), page_size=4, num_pages=1024).generate(prompts, params)
    expected = tokens(engines.single.generate(prompts, params))
    assert expected == tokens(ample)
    cold = engines.tp.generate(prompts, params)
    assert tokens(cold) == expected
    stats = engines.tp.stats()
    assert stats["preemptions"] > 0 and stats["kv_offloaded_bytes"] > 0 and stats["kv_loaded_bytes"] > 0
    warm = engines.tp.generate(prompts, params)
    assert tokens(warm) == expected
    assert engines.tp.stats()["cached_tokens"] > stats["cached_tokens"]


def test_beam_search_equals_tp1(engines) -> None:
    prompt = random_prompts(1, seed=9)[0][:10]  # three beams must fit the tight pool
    params = beam_params(3, 3, max_new=6)
    expected = engines.single.generate([prompt], params)
    got = engines.tp.generate([prompt], params)
    assert tokens(got) == tokens(expected)
    assert [o.score for o in got] == pytest.approx([o.score for o in expected], abs=1e-4)


def test_every_rank_holds_its_heads_of_every_cached_page_under_the_same_ids(engines) -> None:
    engine = engines.tp
    engine.generate(random_prompts(12, seed=13), mixed_params(12))
    engine.check_invariants()  # the structural checker, rank 0
    checked = 0
    for toks, device_first, host_first in cached_paths(engine):
        for pages in (device_first, host_first):
            assert engine.runner.check_kv(toks, pages) == [None, None], f"pages {pages} of {toks}"
            checked += 1
    assert checked


def test_greedy_equals_transformers(engines) -> None:
    reference = load_reference(engines.ckpt)
    prompts = random_prompts(3, seed=21)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    got = engines.tp.generate(prompts, params)
    for prompt, out in zip(prompts, got):
        hf = reference.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
        assert out.token_ids == hf[0, len(prompt):].tolist()


def test_each_rank_holds_half_the_weights_and_half_the_kv(engines) -> None:
    full_sharded, full_replicated = parameter_bytes(engines.single.loaded.model)
    rank_sharded, rank_replicated = parameter_bytes(engines.tp.loaded.model)
    assert rank_replicated == full_replicated
    assert rank_sharded * 2 == full_sharded
    assert bytes_per_page(engines.tp.loaded, 4) * 2 == bytes_per_page(engines.single.loaded, 4)


def group_sockets(worker_pid: int) -> list:
    """This process's sockets of the group whose rank 1 is `worker_pid`: those listening on a
    port rank 1 is connected to (the store, gloo's), and those connected to rank 1's ports."""
    theirs = psutil.Process(worker_pid).net_connections("inet")
    connected_to = {c.raddr.port for c in theirs if c.raddr}
    their_ports = {c.laddr.port for c in theirs}
    return [c for c in psutil.Process().net_connections("inet")
            if (c.status == psutil.CONN_LISTEN and c.laddr.port in connected_to)
            or (c.raddr and c.raddr.port in their_ports)]


def test_the_start_up_line_names_the_ranks_and_a_kv_pool_per_rank(engines) -> None:
    assert engines.tp.describe().endswith("; tensor parallel: 2 ranks, KV pool per rank")
    assert "tensor parallel" not in engines.single.describe()


def test_rank0_listens_on_loopback_only(engines) -> None:
    """Its store (unauthenticated) listened on every interface, whatever the rendezvous host."""
    listening = [c.laddr for c in group_sockets(engines.tp.runner.workers.processes[0].pid)
                 if c.status == psutil.CONN_LISTEN]
    assert listening and all(ip == "127.0.0.1" for ip, _ in listening), listening


def test_the_workers_outlive_stop_signals_sent_to_the_whole_group(engines) -> None:
    """A terminal's Ctrl-C (SIGINT) and a service manager's stop (SIGTERM to every process of
    the unit) reach the workers and their fork server as well as the server, whose drain
    needs them: a rank that died of either failed the streams in flight, and so did the fork
    server's death (multiprocessing then reports every worker it forked as exited, code 255).
    Rank 0 ends its workers itself."""
    processes = engines.tp.runner.workers.processes
    fork_server = psutil.Process(processes[0].pid).parent()
    assert fork_server is not None and fork_server.pid != os.getpid()
    for pid in [fork_server.pid, *(process.pid for process in processes)]:
        os.kill(pid, signal.SIGINT)
        os.kill(pid, signal.SIGTERM)
    assert fork_server.is_running() and fork_server.status() != psutil.STATUS_ZOMBIE
    prompts = random_prompts(3, seed=23)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert tokens(engines.tp.generate(prompts, params)) == tokens(engines.single.generate(prompts, params))
    assert all(p.is_alive() for p in processes) and engines.tp.fault() is None


def ignored_signals(pid: int) -> int:
    """The signal mask a process ignores (/proc's SigIgn: bit n - 1 is signal n)."""
    line = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigIgn:"))
    return int(line.split()[1], 16)


def test_other_forkserver_children_keep_the_default_stop_signals(engines) -> None:
    """The fork server (radixserve's preload, which ignores SIGTERM and, while it loads,
    SIGINT) serves every forkserver-context process of this program: another's `terminate()`
    must still end it, and its Ctrl-C still raise KeyboardInterrupt (exit code 1)."""
    context = multiprocessing.get_context("forkserver")
    sleeper = context.Process(target=time.sleep, args=(600,), daemon=True)
    sleeper.start()
    # (its SIGTERM is given back in the child after the fork, while the fork server already
    # told this process its pid: a SIGTERM sent before that would find it still ignored)
    assert wait_for(lambda: not ignored_signals(sleeper.pid) & (1 << (signal.SIGTERM - 1)), 60)
    sleeper.terminate()
    sleeper.join(60)
    interrupted = context.Process(target=signal.raise_signal, args=(signal.SIGINT,), daemon=True)
    interrupted.start()
    interrupted.join(60)
    assert (sleeper.exitcode, interrupted.exitcode) == (-signal.SIGTERM, 1)


def test_workers_end_once_rank_0_is_gone(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 holds the only write end of its workers' leader pipe, which closes however rank
    0 ends (a SIGKILL too; closed here by hand, as its exit would): a worker then exits at
    once, here one waiting in a collective for its next plan. Before, a worker in a
    collective when rank 0 was killed waited out the collective timeout, and one forked
    after rank 0 was gone (interrupted while its fork server loaded) lived on for minutes."""
    monkeypatch.setenv("RADIXSERVE_TP_TIMEOUT_S", "5")  # the close below meets no worker
    engine = Engine(str(tiny_llama_dir), page_size=4, num_pages=16, tensor_parallel_size=2)
    try:
        workers = engine.runner.workers
        assert workers.processes and all(p.is_alive() for p in workers.processes)
        workers._leader.close()
        for process in workers.processes:
            process.join(60.0)  # generous: the exit follows the pipe's EOF at once
        assert [p.exitcode for p in workers.processes] == [0]
    finally:
        engine.close()


def test_close_ends_every_worker(engines) -> None:
    """... and the workers are forks of the fork server (on the CPU), not children of this
    process; close() releases the group's sockets (they stayed open until the engine was
    garbage-collected)."""
    processes = engines.tp.runner.workers.processes
    ports = {c.laddr.port for c in group_sockets(processes[0].pid)}
    assert ports
    assert processes and all(p.is_alive() for p in processes)
    for process in processes:
        parent = int(Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        assert parent != os.getpid() and b"forkserver" in Path(f"/proc/{parent}/cmdline").read_bytes()
        # It forks with one thread: a fork copies only the caller, and a lock another thread
        # held stays held in the child (Python 3.12 warns of it). Its preload (torch, numpy's
        # OpenBLAS, the loaders) must start none (parallel/forkserver_env.py).
        assert len(list(Path(f"/proc/{parent}/task").iterdir())) == 1
    engines.tp.close()
    assert all(not p.is_alive() for p in processes)
    assert not [c for c in psutil.Process().net_connections("inet") if c.laddr.port in ports]
    (out,) = engines.tp.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    assert out.finish_reason == "error" and "shut down" in engines.tp.fault()


# ---------------------------------------------------------------- replicated KV heads, padded vocabulary
def test_replicated_kv_heads_and_padded_vocabulary_equal_tp1_and_transformers(tmp_path: Path) -> None:
    tokenizer = build_tokenizer(320, max_length=512)
    config = Qwen3Config(vocab_size=321, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
                         rms_norm_eps=1e-6, tie_word_embeddings=False)
    ckpt = save_random_checkpoint(config, tokenizer, tmp_path / "qwen3_mqa", seed=3)
    prompts = random_prompts(8, seed=2)
    params = mixed_params(len(prompts))
    expected = Engine(str(ckpt), page_size=4, num_pages=128).generate(prompts, params)
    tp = Engine(str(ckpt), page_size=4, num_pages=128, debug_checks=True, tensor_parallel_size=2)
    try:
        assert tp.loaded.model.num_kv_heads == 1
        assert tokens(tp.generate(prompts, params)) == tokens(expected)
    finally:
        tp.close()
    reference = load_reference(ckpt)
    hf = reference.generate(torch.tensor([prompts[0]]), max_new_tokens=params[0].max_tokens, do_sample=False)
    assert expected[0].token_ids == hf[0, len(prompts[0]):].tolist()


def test_sliding_window_model_equals_tp1(tmp_path: Path) -> None:
    """Mistral with every layer windowed: leading pages are released (out of window) while
    sequences decode, and their block tables change as new lists."""
    ckpt = write_tiny_checkpoint("mistral_window", tmp_path / "window", window=10)
    prompts = [p + p for p in random_prompts(6, seed=8)]  # past the window
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    options = dict(page_size=4, num_pages=96, max_batch_tokens=16, debug_checks=True)
    expected = Engine(str(ckpt), **options).generate(prompts, params)
    tp = Engine(str(ckpt), tensor_parallel_size=2, **options)
    try:
        assert tokens(tp.generate(prompts, params)) == tokens(expected)
        assert tokens(tp.generate(prompts, params)) == tokens(expected)  # warm
    finally:
        tp.close()


# ---------------------------------------------------------------- GGUF, then a killed worker
def test_gguf_shards_then_a_killed_worker_fails_cleanly(tiny_llama_dir: Path, tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    gguf = write_gguf(tiny_llama_dir, tmp_path / "tiny.gguf")
    prompts = random_prompts(6, seed=4)
    params = mixed_params(len(prompts))
    expected = Engine(str(gguf), page_size=4, num_pages=128).generate(prompts, params)
    tp = Engine(str(gguf), page_size=4, num_pages=128, tensor_parallel_size=2)
    try:
        assert tokens(tp.generate(prompts, params)) == tokens(expected)
        assert tp.fault() is None
        worker = tp.runner.workers.processes[0]
        # Killed and the step sent at once: the collective fails on the closed connection
        # before the exit is seen (the fault named gloo's "Connection closed by peer", no
        # rank), and each request of the batch logged a traceback.
        os.kill(worker.pid, signal.SIGKILL)
        result: dict[str, object] = {}
        runner = threading.Thread(target=lambda: result.update(outs=tp.generate(prompts[:3], params[:3])),
                                  daemon=True)
        with caplog.at_level(logging.ERROR):
            runner.start()
            runner.join(HANG_GUARD_S)
        assert not runner.is_alive(), "a dead worker hung the engine"
        assert [o.finish_reason for o in result["outs"]] == ["error"] * 3
        assert f"rank 1 (pid {worker.pid}) exited with code -9" in tp.fault()
        assert [r.getMessage().split(":")[0] for r in caplog.records if r.exc_info] == []

        async def health() -> str | None:
            server_side = AsyncEngine(tp)
            await server_side.start()
            try:
                return server_side.health()
            finally:
                await server_side.shutdown()

        assert "rank 1" in asyncio.run(health())
    finally:
        tp.close()
    assert not any(p.is_alive() for p in tp.runner.workers.processes)


def test_a_hung_worker_fails_the_engine_after_the_collective_timeout_and_dies_with_a_server_exiting_now(
        tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """... and a server that exits at once (`_exit_now`: a step stuck, a second Ctrl-C, the
    shutdown overdue) kills it first: os._exit runs no close and no atexit, and the hung rank
    (and the fork server, which lives while a child holds its fd) outlived the server."""
    monkeypatch.setenv("RADIXSERVE_TP_TIMEOUT_S", "5")
    tp = Engine(str(tiny_llama_dir), page_size=4, num_pages=64, tensor_parallel_size=2)
    worker = tp.runner.workers.processes[0]
    try:
        os.kill(worker.pid, signal.SIGSTOP)
        result: dict[str, object] = {}
        runner = threading.Thread(target=lambda: result.update(outs=tp.generate([[5, 6, 7, 8]], mixed_params(1))),
                                  daemon=True)
        runner.start()
        runner.join(HANG_GUARD_S)
        assert not runner.is_alive(), "a hung worker hung the engine"
        assert [o.finish_reason for o in result["outs"]] == ["error"]
        assert tp.fault().endswith("(a worker did not answer within the collective timeout, 5 s "
                                   "($RADIXSERVE_TP_TIMEOUT_S): it hangs, or its machine is overloaded)"), tp.fault()

        def exit_now(status: int) -> None:
            raise SystemExit(status)

        monkeypatch.setattr(os, "_exit", exit_now)  # what cli_serve._exit_now ends with
        with pytest.raises(SystemExit):
            cli_serve._exit_now(1)
        monkeypatch.undo()
        worker.join(HANG_GUARD_S)  # killed: no close() has run
        assert not worker.is_alive()
    finally:
        tp.close()
    assert not worker.is_alive()
