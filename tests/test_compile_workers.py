"""Grammar compiles in killable worker processes (radixserve/grammar/compile_workers.py): the
same compiled grammars as in the calling thread, a compile past the timeout refused and its
process replaced, and, on a real server, an attacker's slow schemas (within every static bound
of spec.py) refused while an innocent client's schema is compiled and served beside them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_util import running_server
import xgrammar
from transformers import AutoTokenizer

from radixserve import AsyncEngine, Engine
from radixserve.grammar import GrammarError, GrammarSpec, Grammars
from radixserve.grammar import zygote
from radixserve.grammar import compile_workers
from radixserve.grammar.compile_workers import (
    CompileTimeout,
    CompileTooSlowToFollow,
    CompileWorkerLost,
    CompileWorkers,
)
from radixserve.models.demo import demo_checkpoint_dir
from radixserve.server import create_app

# Nested optional repetitions of a wide atom: within spec.py's bounds (counted repetitions 400
# of 2,048), and tens of seconds for xgrammar 0.2.9 to compile (`(.{0,30}){0,30}`: 9 s here).
SLOW_PATTERN = "(.{0,40}){0,40}"
TIMEOUT_S = 2.0


@pytest.fixture
def cpu_limit_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the CPU-time limit stops a compile: on a loaded machine the niced workers may pass
    the wall-clock limit first (a 503, the server too busy: the starved test below), and these
    tests are about a spec too slow for its CPU time."""
    from radixserve.grammar import compile_workers

    monkeypatch.setattr(compile_workers, "WALL_LIMIT_FACTOR", 10_000)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(demo_checkpoint_dir())


def specs() -> list[GrammarSpec]:
    schema = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                               "n": {"type": "integer"}}, "required": ["name"]}
    return [GrammarSpec.json_schema(schema, "response_format"), GrammarSpec.regex("(ab|cd)+e?", "guided_regex"),
            GrammarSpec.choice(["yes", "no", "🙂"], "guided_choice"), GrammarSpec("json_object", ""),
            GrammarSpec("ebnf", 'root ::= "x" [0-9]+'),
            GrammarSpec.tool_calls([("lookup", GrammarSpec.json_schema(schema, "tools")), ("any", None)],
                                   parallel=True, param="tools")]


@pytest.mark.parametrize("forked", [True, False], ids=["forked-by-the-zygote", "fresh-interpreters"])
def test_workers_compile_exactly_what_the_thread_compiles(tokenizer: Any, forked: bool,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers forked by the pool's zygote, and workers started as fresh interpreters (where
    there is no zygote: not Linux), compile what the calling thread compiles."""
    if not forked:
        monkeypatch.setattr(zygote, "SUPPORTED", False)
    in_thread = Grammars(tokenizer, 2048, [tokenizer.eos_token_id], compile_timeout_s=None)
    # (fresh interpreters in a pool of their own: the default timeout's pool may have a zygote)
    in_workers = Grammars(tokenizer, 2048, [tokenizer.eos_token_id], **({} if forked else {"compile_timeout_s": 9.5}))
    for spec in specs():
        assert in_workers.compile(spec).serialize_json() == in_thread.compile(spec).serialize_json(), spec.kind
    pool = in_workers._workers
    assert pool is not None and pool.standby is not None
    assert (pool._zygote is not None) == forked
    assert parent_pid(pool.standby.process.pid) == (pool._zygote.process.pid if forked else os.getpid())


def proc_stat(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields after the command name: [state, ppid, ...]."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()


def parent_pid(pid: int) -> int:
    return int(proc_stat(pid)[1])


def stopped(pid: int) -> None:
    """SIGSTOPs `pid` and waits until it is stopped: its CPU time stands still from then on."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while proc_stat(pid)[0] != "T":
        assert time.monotonic() < deadline
        time.sleep(0.01)


def ended(pid: int, timeout_s: float = 30.0) -> bool:
    """Whether process `pid` is gone or a zombie within `timeout_s` (dead either way)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if proc_stat(pid)[0] in ("Z", "X"):
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.02)
    return False


def test_workers_are_forks_of_the_zygote_and_end_with_it(tokenizer: Any) -> None:
    """A replacement worker is another fork of the same zygote (no new interpreter); the zygote
    killed, its workers end with it and the next compile starts a new zygote; a zygote that
    stops answering is killed and replaced; the pool's end of its socket closed (the server
    ended), the zygote ends and its workers with it."""
    grammars = Grammars(tokenizer, 2048, [tokenizer.eos_token_id], compile_timeout_s=8.5)  # a pool of its own
    spec, other = specs()[0], specs()[1]
    grammars.compile(spec)
    pool = grammars._workers
    assert pool is not None and pool._zygote is not None and pool.standby is not None
    first_zygote, first = pool._zygote, pool.standby
    assert parent_pid(first.process.pid) == first_zygote.process.pid
    first.kill()  # as a worker killed past a limit
    assert first.process.poll() == -signal.SIGKILL
    grammars.compile(other)
    assert pool._zygote is first_zygote and pool.standby is not first
    assert parent_pid(pool.standby.process.pid) == first_zygote.process.pid

    second = pool.standby
    os.kill(first_zygote.process.pid, signal.SIGKILL)
    first_zygote.process.wait(30)
    assert ended(second.process.pid)  # PR_SET_PDEATHSIG
    assert second.process.poll() == -signal.SIGKILL  # as the pool reads it with the zygote gone
    grammars.compile(specs()[2])
    assert pool._zygote is not first_zygote and pool._zygote.alive()
    assert parent_pid(pool.standby.process.pid) == pool._zygote.process.pid

    stuck = pool._zygote  # stopped: a request past its timeout kills it, and another starts
    os.kill(stuck.process.pid, signal.SIGSTOP)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(zygote, "REQUEST_TIMEOUT_S", 0.5)
        grammars.compile(specs()[3])  # the standby's poll times out: the zygote is killed
    assert stuck.process.wait(30) == -signal.SIGKILL
    assert pool._zygote is not stuck and pool._zygote.alive()

    third, last_zygote = pool.standby, pool._zygote
    last_zygote._socket.close()  # all the zygote sees of a server ending, or killed
    assert last_zygote.process.wait(30) == 0
    assert ended(third.process.pid)


def test_a_zygote_slower_to_start_than_the_wait_is_kept_not_started_again(tokenizer: Any,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """On a loaded machine the zygote's niced imports can outlast the wait for them: that
    compile fails as the server's fault, but the zygote is kept, still starting, and the next
    compile finds it started (it was killed and started over, imports and all, on every
    compile: none could succeed, and each left a zygote behind)."""
    monkeypatch.setattr(compile_workers, "STARTUP_TIMEOUT_S", 0.05)  # shorter than any start
    grammars = Grammars(tokenizer, 2048, [tokenizer.eos_token_id], compile_timeout_s=8.7)  # a pool of its own
    with pytest.raises(CompileWorkerLost, match="no compiling process: the compile zygote has not started "
                                                "within 0.05 s; it is still starting"):
        grammars.compile(specs()[0])
    pool = grammars._workers
    assert pool is not None and pool._zygote is not None
    starting = pool._zygote
    assert starting.alive()
    monkeypatch.setattr(compile_workers, "STARTUP_TIMEOUT_S", 120.0)  # (the forked worker's wait too)
    monkeypatch.setattr(starting, "_startup_timeout_s", 120.0)  # now wait for it as the pool would
    grammars.compile(specs()[0])
    assert pool._zygote is starting and parent_pid(pool.standby.process.pid) == starting.process.pid


def test_a_zygote_that_makes_no_progress_in_its_start_is_killed_and_replaced(tokenizer: Any,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """... but one that used no CPU since the last wait ran out (stopped, blocked) is killed,
    and the next compile starts another (kept, it would fail every compile for good)."""
    monkeypatch.setattr(compile_workers, "STARTUP_TIMEOUT_S", 0.05)
    grammars = Grammars(tokenizer, 2048, [tokenizer.eos_token_id], compile_timeout_s=8.8)  # a pool of its own
    with pytest.raises(CompileWorkerLost, match="it is still starting"):
        grammars.compile(specs()[1])
    pool = grammars._workers
    assert pool is not None and pool._zygote is not None
    stuck = pool._zygote
    stopped(stuck.process.pid)
    monkeypatch.setattr(stuck, "_startup_timeout_s", 0.3)
    # The CPU it used between the last wait and the stop is progress (a loaded machine leaves
    # room for some): one more wait may call it still starting; the next sees none.
    said = []
    while not said or "still starting" in said[-1] and len(said) < 2:
        with pytest.raises(CompileWorkerLost) as lost:
            grammars.compile(specs()[1])
        said.append(str(lost.value))
    assert "the compile zygote did not start: no progress in its last 0.3 s" in said[-1], said
    assert stuck.process.wait(30) == -signal.SIGKILL and not stuck.alive()
    monkeypatch.setattr(compile_workers, "STARTUP_TIMEOUT_S", 120.0)
    grammars.compile(specs()[1])
    assert pool._zygote is not stuck and parent_pid(pool.standby.process.pid) == pool._zygote.process.pid


def test_a_compile_past_the_timeout_is_refused_and_its_worker_replaced(tokenizer: Any, cpu_limit_only: None) -> None:
    grammars = Grammars(tokenizer, 2048, [tokenizer.eos_token_id], compile_timeout_s=TIMEOUT_S)
    slow = GrammarSpec.json_schema({"type": "string", "pattern": SLOW_PATTERN}, "response_format")
    with pytest.raises(GrammarError) as refused:
        grammars.compile(slow)
    assert str(refused.value) == (f"response_format: its grammar took more than {TIMEOUT_S:g} s of CPU time to "
                                  "compile (nested or many optional repetitions, or many strict tools, say); simplify it")
    assert grammars.compile_timeouts == 1 and not grammars.is_cached(slow)
    for spec in specs():  # the next compiles run in the killed worker's replacement
        grammars.compile(spec)
    assert grammars.compile_timeouts == 1


def test_the_standby_outlives_its_idle_time_and_takes_the_next_compile(tokenizer: Any) -> None:
    """A worker takes seconds to start: one, the standby, stays however long it idles, so a
    new schema after a quiet spell does not wait for a start; the others end when idle, and
    a compile alone starts no other (it would take the standby's CPU)."""
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, stop_token_ids=[tokenizer.eos_token_id])
    pool = CompileWorkers(info.serialize_json(), workers=2, idle_exit_s=0.5)
    first = pool.compile("json_object", "")
    standby = pool.standby
    assert standby is not None and pool._idle == [standby]
    # Two at once (compiles of a second or so): the second finds no worker idle and starts one.
    slow = fat_grammar(300)

    def compile_slow(_: int) -> None:
        with contextlib.suppress(CompileTooSlowToFollow):  # its first steps may pass the fill budget: no matter here
            pool.compile(slow.kind, slow.source)

    with ThreadPoolExecutor(2) as both:
        list(both.map(compile_slow, range(2)))
    others = [worker for worker in pool._idle if worker is not standby]
    assert others and standby in pool._idle
    deadline = time.monotonic() + 120
    while any(w.process.poll() is None for w in others) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [w.process.poll() for w in others] == [0] * len(others)  # ended by themselves, idle
    time.sleep(1.0)  # twice the idle time more: the standby waits on
    assert standby.process.poll() is None
    idle_since = standby.last_used
    assert pool.compile("json_object", "") == first  # the standby compiles it, at once
    assert pool.standby is standby and standby.last_used > idle_since
    standby.kill()  # a standby that ended (past a limit, say) is replaced by the next worker
    pool.compile("json_object", "")
    assert pool.standby is not standby and pool.standby.process.poll() is None


def test_a_standby_killed_past_the_timeout_has_a_successor_though_another_worker_idles(
        tokenizer: Any, cpu_limit_only: None) -> None:
    """An attack round's finding: the standby's successor was started only when no worker was
    idle, so a standby killed beside an idle worker left none once that one idled out."""
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, stop_token_ids=[tokenizer.eos_token_id])
    pool = CompileWorkers(info.serialize_json(), workers=2, timeout_s=1.0, idle_exit_s=60)
    pool.compile("json_object", "")
    standby = pool.standby
    slow = GrammarSpec.json_schema({"type": "string", "pattern": SLOW_PATTERN}, "response_format")
    refused: list[Exception] = []

    def compile_slow() -> None:
        try:
            pool.compile(slow.kind, slow.source)
        except CompileTimeout as exc:
            refused.append(exc)

    attack = threading.Thread(target=compile_slow)
    attack.start()
    time.sleep(0.3)  # the slow compile holds the standby: this one starts another worker
    pool.compile("json_object", "")
    attack.join(120)
    assert len(refused) == 1 and standby.process.poll() is not None
    others = [worker for worker in pool._idle if worker is not pool.standby]
    assert len(others) == 1 and others[0].process.poll() is None  # the other worker, idle
    assert pool.standby is not standby and pool.standby.process.poll() is None and pool.standby in pool._idle


def test_a_grammar_whose_first_steps_pass_the_fill_budget_is_refused_before_generation(tokenizer: Any) -> None:
    """xgrammar's fill cannot be interrupted: `(.+\\s?){0,1000}` after one long token takes a
    fill of seconds (11 s on SmolLM2's vocabulary), which stalled every stream at that step.
    The worker walks the first steps (grammar/probe.py) and refuses it, with the words the
    engine uses when it finds one later; real specs pass the walk."""
    grammars = Grammars(tokenizer, 2048, [tokenizer.eos_token_id])
    ambiguous = GrammarSpec.regex(r"(.+\s?){0,1000}", "guided_regex")
    with pytest.raises(GrammarError) as refused:
        grammars.compile(ambiguous, "guided_regex")
    message = str(refused.value)
    assert message.startswith("guided_regex: the request's output constraint took over 50 ms of CPU to compute "
                              "one step's allowed tokens (an ambiguous grammar or regex; one of its first steps took ")
    assert message.endswith(" ms of CPU, found before generation); simplify it") and refused.value.param == "guided_regex"
    assert not grammars.is_cached(ambiguous) and grammars.compile_timeouts == 0
    for spec in specs():
        grammars.compile(spec)


SERVER_TIMEOUT_S = 1.0  # CPU seconds: far above an in-limit compile (milliseconds), far below the attack's compiles


def fat_grammar(rules: int) -> GrammarSpec:
    """Cheap to compile, many rules, ambiguous: `root ::= r0 r1 ..`, each `rJ ::= "a"?` (300
    rules: its first steps take the probe a few hundred ms)."""
    return GrammarSpec("ebnf", "root ::= " + " ".join(f"r{i}" for i in range(rules)) + "\n"
                       + "\n".join(f'r{i} ::= "a"?' for i in range(rules)))


def many_rules(rules: int) -> GrammarSpec:
    """Cheap to compile, small in memory, large serialized: `root ::= r0 r1 ..`, each
    `rJ ::= "a" | "b"` (600 rules: 0.6 MB in memory, 20 MB serialized on the demo tokenizer)."""
    return GrammarSpec("ebnf", "root ::= " + " ".join(f"r{i}" for i in range(rules)) + "\n"
                       + "\n".join(f'r{i} ::= "a" | "b"' for i in range(rules)))


def test_a_grammar_large_serialized_is_compiled_again_here_and_one_large_in_memory_is_refused(
        tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """xgrammar's serialized form grows with the square of the rules (a second attack round's
    132 MB ones filled the server's memory; 128 strict tools took 31 s to serialize): such a
    grammar is not sent; the caller compiles it itself, the worker having shown it compiles in
    time. Past MAX_COMPILED_BYTES in memory it is refused, and past MAX_WORKER_RSS_BYTES of
    compiling the worker is killed mid-compile."""
    grammars = Grammars(tokenizer, 2048, [tokenizer.eos_token_id], compile_timeout_s=30.0)
    workers = grammars._workers
    assert workers is not None
    assert workers.compile("ebnf", many_rules(600).source) is None  # too large to send
    assert isinstance(workers.compile(specs()[0].kind, specs()[0].source), str)  # small: sent
    fat = grammars.compile(many_rules(600), "guided_grammar")
    matcher = grammars.matcher_of(fat)
    assert all(matcher.accept(token) for token in tokenizer.encode("ab" * 300, add_special_tokens=False))
    # compiled here on a thread as low in priority as the workers: serving goes first
    (compiler,) = [t for t in threading.enumerate() if t.name.startswith("radixserve-compile")]
    stat = Path(f"/proc/self/task/{compiler.native_id}/stat").read_text()
    assert int(stat.rsplit(")", 1)[1].split()[16]) == compile_workers.COMPILE_NICENESS  # field 19: nice
    monkeypatch.setattr(compile_workers, "MAX_COMPILED_BYTES", 2**18)  # read by the parent on each reply
    with pytest.raises(GrammarError, match=r"guided_grammar: its grammar is too large: the compiled grammar takes "
                                           r"[\d.]+ MB of memory, more than 0.25 MB"):
        grammars.compile(many_rules(601), "guided_grammar")
    monkeypatch.setattr(compile_workers, "MAX_WORKER_RSS_BYTES", 1)  # read by the parent at each poll
    with pytest.raises(GrammarError, match="too large: compiling took more than 0 MB of memory"):
        grammars.compile(many_rules(602), "guided_grammar")
    monkeypatch.undo()
    assert grammars.compile(specs()[0]) is not None  # the killed worker's replacement serves


def test_a_hundred_and_twenty_eight_distinct_tools_compile_required_or_strict(tokenizer: Any) -> None:
    """OpenAI's limit of tools, each with its own schema: their grammar is over 100 MB
    serialized on the demo tokenizer (88 MB strict under "auto", 135 MB under "required"; a
    400 "too large" before), 1-2 MB in memory: compiled again here, not sent."""
    import msgspec

    from radixserve.server.protocol import ChatCompletionRequest
    from radixserve.server.tools import plan_tools

    tools = [{"type": "function", "function": {"name": f"tool_{i}", "strict": True, "parameters": {
        "type": "object", "properties": {f"p{i}": {"type": "integer", "minimum": 0, "maximum": 9},
                                         f"q{i}": {"type": "string", "maxLength": 4}},
        "required": [f"p{i}", f"q{i}"]}}} for i in range(128)]
    grammars = Grammars(tokenizer, 2048, [tokenizer.eos_token_id], compile_timeout_s=30.0)
    for choice in ("required", "auto"):
        request = msgspec.json.decode(json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                                  "tool_choice": choice}), type=ChatCompletionRequest)
        plan = plan_tools(request, "hermes")
        spec = plan.grammar[0] if plan.grammar else plan.auto_calls.constraint(None)[0]
        matcher = grammars.matcher(spec)
        call = '{"name": "tool_77", "arguments": {"p77": 7, "q77": "ab"}}'
        text = f"[{call}]" if choice == "required" else f"<tool_call>\n{call}\n</tool_call>"
        assert all(matcher.accept(token) for token in tokenizer.encode(text, add_special_tokens=False)), choice
        assert matcher.accept(tokenizer.eos_token_id), choice
        wrong = grammars.matcher(spec)  # a tool's arguments are held to its own schema
        assert not all(wrong.accept(token) for token in tokenizer.encode(text.replace("q77", "q78"),
                                                                         add_special_tokens=False)), choice


def test_a_compile_starved_of_cpu_is_the_servers_fault_and_not_remembered(tokenizer: Any,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A compile that gets too little CPU (a stopped worker here; a loaded machine in life, the
    workers being niced) is stopped by the wall-clock limit: the server's fault, so not a
    refusal of the spec, and the same spec compiles when the machine has room again."""
    from radixserve.grammar import compile_workers

    timeout_s = 0.3  # a pool of its own; the wall-clock limit is 4 times this here (12 in the server)
    grammars = Grammars(tokenizer, 2048, [tokenizer.eos_token_id], compile_timeout_s=timeout_s)
    send = compile_workers._Worker.send
    # A stopped worker gets no CPU at all, however long the limit: the factor only sets how long
    # this test waits for the wall-clock limit (12 times: 3.6 s of waiting, 1.2 s here).
    monkeypatch.setattr(compile_workers, "WALL_LIMIT_FACTOR", 4)

    def send_then_stop(worker: Any, job: tuple[str, str]) -> None:
        send(worker, job)
        os.kill(worker.process.pid, signal.SIGSTOP)  # it gets no CPU at all until killed

    monkeypatch.setattr(compile_workers._Worker, "send", send_then_stop)
    spec = specs()[0]
    with pytest.raises(compile_workers.CompileStarved, match=r"less than 0.3 s of CPU in 1.2 s: the server is busy"):
        grammars.compile(spec)
    monkeypatch.undo()
    assert grammars.compile_timeouts == 0 and grammars.refusals_repeated == 0
    assert grammars.compile(spec).serialize_json() == Grammars(
        tokenizer, 2048, [tokenizer.eos_token_id], compile_timeout_s=None).compile(spec).serialize_json()


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    engine = AsyncEngine(Engine(model="demo", page_size=16, num_pages=256, grammar_compile_timeout_s=SERVER_TIMEOUT_S))
    with running_server(create_app(engine)) as url:
        yield url


def chat(url: str, schema: dict[str, Any], salt: str, source: str = "127.0.0.1") -> httpx.Response:
    with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=300) as client:
        return client.post(f"{url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 24, "temperature": 0, "cache_salt": salt,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})


def test_slow_schemas_are_refused_while_another_clients_schema_is_served(server_url: str,
                                                                         cpu_limit_only: None) -> None:
    """Four requests of the slow pattern from one address (no keys: the slots go round client
    addresses), each under its own salt (four compiles); another address's small schema is
    compiled in the slot kept for clients holding none, and answered before any of the four,
    which are 400s naming the timeout."""
    small = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    warm = [threading.Thread(target=chat, args=(server_url, small, f"warm{i}")) for i in range(4)]
    for thread in warm:  # four workers started and idle: the attack's compiles take three
        thread.start()
    for thread in warm:
        thread.join(300)
    slow = {"type": "object", "properties": {"code": {"type": "string", "pattern": SLOW_PATTERN}}, "required": ["code"]}
    answers: list[tuple[str, httpx.Response]] = []
    attackers = [threading.Thread(target=lambda i=i: answers.append(("slow", chat(server_url, slow, f"s{i}", "127.0.0.2"))))
                 for i in range(4)]
    for thread in attackers:
        thread.start()
    answers.append(("innocent", chat(server_url, small, "innocent")))
    for thread in attackers:
        thread.join(300)
    assert [name for name, _ in answers] == ["innocent"] + ["slow"] * 4
    innocent = answers[0][1]
    assert innocent.status_code == 200, innocent.text
    assert set(json.loads(innocent.json()["choices"][0]["message"]["content"])) == {"ok"}
    for _, answer in answers[1:]:
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == "response_format.json_schema.schema"
        assert f"took more than {SERVER_TIMEOUT_S:g} s of CPU time to compile" in error["message"]


def test_a_lost_compile_worker_is_the_servers_503_not_the_requests_400(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that cannot start (here: one that exits at once; in the attack round, workers of
    a server whose code was updated under it) is the server's fault."""
    from radixserve.grammar import compile_workers

    monkeypatch.setattr(compile_workers, "_CHILD", "import sys; sys.exit(3)")
    monkeypatch.setattr(zygote, "_ZYGOTE", "import sys; sys.exit(3)")
    engine = AsyncEngine(Engine(model="demo", page_size=16, num_pages=64, grammar_compile_timeout_s=7.25))
    with running_server(create_app(engine)) as url:
        answer = chat(url, {"type": "object", "properties": {"ok": {"type": "boolean"}}}, "lost")
        plain = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert answer.status_code == 503 and answer.headers["retry-after"] == "1", answer.text
    assert answer.json()["error"] == {"message": "the grammar compiler is unavailable; retry", "type": "server_error",
                                      "param": None, "code": "grammar_compiler_unavailable"}
    assert plain.status_code == 200
