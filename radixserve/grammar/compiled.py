"""Specs → compiled grammars for one tokenizer, cached by spec; a fresh Matcher per sequence.

Compilation is the expensive part (milliseconds for a JSON Schema, more for large ones) and is
done once per distinct spec: the server compiles on the request's way in (so a bad schema is
a 400 before the engine sees it), and the engine's matchers reuse the cached result. The
compile itself runs in a worker process that a CPU-time limit can stop (compile_workers.py),
unless `compile_timeout_s` is None; a grammar too large to send back serialized is compiled
again here, on threads at the workers' niceness. Thread safe: the server's threads and the
engine thread share one instance.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import json
import os
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable

import xgrammar
from transformers import PreTrainedTokenizerBase

from radixserve.grammar.compile_workers import (
    COMPILE_NICENESS,
    DEFAULT_COMPILE_TIMEOUT_S,
    CompileFailed,
    CompileTimeout,
    CompileTooLarge,
    CompileTooSlowToFollow,
    CompileWorkers,
    shared_workers,
)
from radixserve.grammar.matcher import FILL_BUDGET_S, Matcher
from radixserve.grammar.spec import GrammarError, GrammarSpec

CACHE_ENTRIES = 256
CACHE_BYTES = 256 * 2**20  # and at most this much of compiled grammars (xgrammar's own measure)
REFUSED_CHARS = 16 * 2**20  # refused specs kept, by their sources' and reasons' characters
COMPILE_THREADS = 2
# xgrammar 0.2.9 writes the characters of a string with minLength/maxLength as any character
# but quote, backslash, CR and LF: raw control characters would get through, and JSON forbids
# them (its unbounded strings already exclude them). Swapped in the grammar's text.
_LENGTH_BOUNDED_CHARACTER = '[^\\"\\\\\\r\\n]'
_JSON_CHARACTER = '[^\\0-\\x1f\\"\\\\]'
_SOURCE_PLACE = re.compile(r"^\S+\.(?:cc|h|cpp):\d+: ")


class _Refused(Exception):
    """A spec the request is at fault for: `reason` is the error after the field's name."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Grammars:
    """The grammar engine for one tokenizer and logits width: compile (cached) and match."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: Iterable[int],
                 *, compile_timeout_s: float | None = DEFAULT_COMPILE_TIMEOUT_S,
                 textless_token_ids: Iterable[int] = ()) -> None:
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=self._stop_token_ids or None)
        textless = set(textless_token_ids) - set(info.special_token_ids)
        if textless:
            # Tokens the output's text leaves out (special tokens, decoded with
            # skip_special_tokens) must not spell grammar text: xgrammar read SmolLM2's none
            # as special, so "<|im_start|>" could stand inside a JSON string or as a choice
            # (the reply then "stop"ped with text that matched nothing). A token that
            # decodes to nothing is special to xgrammar: never allowed, stop tokens apart.
            vocab = [b"" if i in textless else token for i, token in enumerate(info.decoded_vocab)]
            info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=vocab_size,
                                          stop_token_ids=self._stop_token_ids or None,
                                          add_prefix_space=info.add_prefix_space)
        self._info = info
        # Compiles run in worker processes that a timeout can stop (compile_workers.py);
        # None: in the calling thread, unbounded (for callers that trust their specs).
        self.compile_timeout_s = compile_timeout_s
        # In this process: every compile without a timeout, and a grammar the workers compiled
        # but found too large to send (built on first use).
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._workers: CompileWorkers | None = None
        if compile_timeout_s is not None:
            self._workers = shared_workers(info.serialize_json(), compile_timeout_s)
        self._cache: OrderedDict[GrammarSpec, xgrammar.CompiledGrammar] = OrderedDict()
        self._cache_bytes = 0
        # Every compiled grammar something still holds (a request in the engine, a server's
        # request between its compile and the engine): found here after the cache evicted
        # it, so that no other client's flood of specs can send it back to the compiler, and
        # the engine thread never compiles what the server compiled off it.
        self._live: weakref.WeakValueDictionary[GrammarSpec, xgrammar.CompiledGrammar] = weakref.WeakValueDictionary()
        self._refused: OrderedDict[GrammarSpec, str] = OrderedDict()  # spec -> why (a request's fault)
        self._refused_chars = 0
        self._lock = threading.Lock()
        self.compiles = 0  # specs run through the compiler (cache misses), failed ones included
        self.refusals_repeated = 0  # refusals answered from the cache

    def compile(self, spec: GrammarSpec, param: str = "response_format") -> xgrammar.CompiledGrammar:
        """The compiled grammar of `spec` (cached); GrammarError naming `param` if it cannot be.
        A refusal is cached too (its reason, by the whole spec, scope included): a client
        sending a refused spec again is answered at once, not with another worker's compile or
        walk (up to the compile timeout of CPU each)."""
        compiled = self.cached(spec)
        if compiled is not None:
            return compiled
        self.raise_if_refused(spec, param)
        with self._lock:
            self.compiles += 1
        try:
            compiled = self._compile_or_refuse(spec)
        except _Refused as exc:
            with self._lock:
                if spec not in self._refused:  # (two threads may refuse it at once: counted once)
                    self._refused[spec] = exc.reason
                    self._refused_chars += len(spec.source) + len(exc.reason)
                while self._refused and (len(self._refused) > CACHE_ENTRIES or self._refused_chars > REFUSED_CHARS):
                    dropped, reason = self._refused.popitem(last=False)
                    self._refused_chars -= len(dropped.source) + len(reason)
            raise GrammarError(f"{param}: {exc.reason}", param) from None
        with self._lock:
            self._keep_locked(spec, compiled)
        return compiled

    def cached(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar | None:
        """`spec`'s compiled grammar if the cache has it, or something still holds it (then it
        is cached again); None if only a compile would give it."""
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                return compiled
            compiled = self._live.get(spec)
            if compiled is not None:
                self._keep_locked(spec, compiled)
            return compiled

    def _keep_locked(self, spec: GrammarSpec, compiled: xgrammar.CompiledGrammar) -> None:
        if spec in self._cache:  # compiled twice side by side (waiters of a failed shared compile)
            self._cache.move_to_end(spec)
            return
        self._cache[spec] = compiled
        self._live[spec] = compiled
        self._cache_bytes += compiled.memory_size_bytes
        # The newest stays, whatever its size: the request that compiled it is about to use it.
        while len(self._cache) > 1 and (len(self._cache) > CACHE_ENTRIES or self._cache_bytes > CACHE_BYTES):
            _, dropped = self._cache.popitem(last=False)
            self._cache_bytes -= dropped.memory_size_bytes

    def raise_if_refused(self, spec: GrammarSpec, param: str) -> None:
        """GrammarError naming `param` if `spec` was refused before (its cached reason), at
        once: no compile slot, thread or worker is needed to say it again."""
        with self._lock:
            refused = self._refused.get(spec)
            if refused is None:
                return
            self._refused.move_to_end(spec)
            self.refusals_repeated += 1
        raise GrammarError(f"{param}: {refused}", param)

    def _compile_or_refuse(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        """`spec` compiled, or _Refused with the reason the request is at fault."""
        try:
            compiled = self._compile(spec)
        except CompileTimeout:
            raise _Refused(f"its grammar took more than {self.compile_timeout_s:g} s of CPU time to compile "
                           "(nested or many optional repetitions, or many strict tools, say); simplify it") from None
        except CompileTooLarge as exc:
            raise _Refused(f"its grammar is too large: {exc} (many optional properties or alternatives, "
                           "say); simplify it") from None
        except CompileTooSlowToFollow as exc:  # (the same words as when the engine finds it: matcher.py)
            raise _Refused(f"the request's output constraint took over {FILL_BUDGET_S * 1000:g} ms of CPU to "
                           f"compute one step's allowed tokens (an ambiguous grammar or regex; {exc}, found before "
                           "generation); simplify it") from None
        except (RuntimeError, ValueError, CompileFailed) as exc:  # the library reports bad input as either
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            # xgrammar's messages start "[time] /project/cpp/file.cc:line: ": its own source, not the request's
            reason = _SOURCE_PLACE.sub("", reason.split("] ", 1)[-1])
            raise _Refused(f"cannot compile this {spec.kind.replace('_', ' ')}: {reason[:300]}") from None
        if not self._allows_a_first_token(compiled):
            # `root ::= root`, `[^\s\S]`: every token masked, so the engine could only fail the
            # request (a 500) at its first step; the request is at fault, not the server.
            raise _Refused(f"this {spec.kind.replace('_', ' ')} matches no text at all (not even an empty output)")
        return compiled

    def is_cached(self, spec: GrammarSpec) -> bool:
        """Whether `spec` is compiled already (`compile` would return at once)."""
        with self._lock:
            return spec in self._cache or spec in self._live

    def _allows_a_first_token(self, compiled: xgrammar.CompiledGrammar) -> bool:
        """Whether a sequence at the start of `compiled` may take any token (a stop token counts)."""
        matcher = xgrammar.GrammarMatcher(compiled, override_stop_tokens=self._stop_token_ids or None)
        bitmask = xgrammar.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        return bool(bitmask.any())

    def _compile(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        if self._workers is None:
            return compile_spec(self._local_compiler(), spec.kind, spec.source)
        serialized = self._workers.compile(spec.kind, spec.source)
        if serialized is not None:
            return xgrammar.CompiledGrammar.deserialize_json(serialized, self._info)
        # Its serialized form would be large (compile_workers.MAX_SENT_BYTES): compiled again
        # here, in about the time the worker's compile took within its limit, on a thread as
        # low in priority as the workers (serving goes first: the engine's steps, the loop).
        return _niced_compiles().submit(lambda: compile_spec(self._local_compiler(), spec.kind, spec.source)).result()

    def _local_compiler(self) -> xgrammar.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                self._compiler = xgrammar.GrammarCompiler(self._info, max_threads=COMPILE_THREADS,
                                                          cache_enabled=False)
            return self._compiler

    @property
    def compile_timeouts(self) -> int:
        """Compiles refused for their time (their workers killed), in this tokenizer's pool."""
        return self._workers.timeouts if self._workers is not None else 0

    def matcher(self, spec: GrammarSpec) -> Matcher:
        """A matcher at the start of `spec`'s grammar (compiled if it must be)."""
        return self.matcher_of(self.compile(spec))

    def matcher_of(self, compiled: xgrammar.CompiledGrammar) -> Matcher:
        """A matcher at the start of a compiled grammar (`compile`'s); it accepts a stop token
        once complete."""
        return Matcher(xgrammar.GrammarMatcher(compiled, override_stop_tokens=self._stop_token_ids or None),
                       self.vocab_size)


@functools.cache
def _niced_compiles() -> concurrent.futures.ThreadPoolExecutor:
    """Threads of this process that compile at the workers' niceness (on Linux a thread's nice
    value is its own, and the threads xgrammar starts from one inherit it)."""
    return concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="radixserve-compile",
                                                 initializer=_lower_priority)


def _lower_priority() -> None:
    with contextlib.suppress(OSError, AttributeError):  # (elsewhere than Linux: the process, or nothing)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)


def compile_spec(compiler: xgrammar.GrammarCompiler, kind: str, source: str) -> xgrammar.CompiledGrammar:
    """A spec's `kind` and `source` compiled by `compiler` (in this process, or a compile worker's)."""
    if kind == "tool_calls":
        return compiler.compile_structural_tag(_tool_calls_tag(json.loads(source)))
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(source)
    return compiler.compile_grammar(_ebnf(kind, source))


def _ebnf(kind: str, source: str) -> str:
    """The EBNF text of a spec of kind json_schema, json_object, choice or ebnf."""
    if kind == "json_schema":
        return _schema_ebnf(source)
    if kind == "json_object":
        return _schema_ebnf('{"type": "object"}')
    if kind == "choice":
        # Raw characters, not \u escapes: xgrammar reads a surrogate pair's two escapes as two
        # lone surrogates, so an option past the BMP (an emoji) could never be produced.
        return "root ::= " + " | ".join(json.dumps(option, ensure_ascii=False) for option in json.loads(source))
    return source


def _schema_ebnf(schema: str) -> str:
    """The EBNF of the values valid under JSON Schema text `schema`. No free whitespace: a small
    model left to choose it may indent until max_tokens."""
    grammar = str(xgrammar.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True))
    return grammar.replace(_LENGTH_BOUNDED_CHARACTER, _JSON_CHARACTER)


# A Hermes tool-call block, as the templates that speak it ask for it (tool_parsers.HermesParser).
HERMES_CALL_OPENING = "<tool_call>"
HERMES_CALL_CLOSING = "}\n</tool_call>"


def _tool_calls_tag(plan: dict) -> str:
    """xgrammar's structural tag for a GrammarSpec.tool_calls plan. Without an answer: any text
    until the opening of a call; then the call of one of the tools, its arguments under the
    tool's schema; then any text again (or nothing more, for a single call). With one: the
    answer, or a reply that opens with a call (a Hermes block, or Llama 3's JSON calls)."""
    answer = plan.get("answer")
    arguments = [{"type": "grammar", "grammar": _schema_ebnf(json.dumps(schema or {"type": "object"}))}
                 for _, schema in plan["tools"]]
    if plan.get("format") == "llama3":
        calls: dict = {"type": "tags_with_separator", "separator": "; ", "at_least_one": True,
                       "stop_after_first": not plan["parallel"],
                       "tags": [{"type": "tag", "begin": f'{{"name": {json.dumps(name)}, "parameters": ',
                                 "content": content, "end": "}"}
                                for (name, _), content in zip(plan["tools"], arguments)]}
    else:
        calls = {"type": "triggered_tags", "triggers": [HERMES_CALL_OPENING], "stop_after_first": not plan["parallel"],
                 # beside an answer a reply of calls opens with one: a free-text start could
                 # take any turn, the answer's JSON left unfinished
                 "at_least_one": answer is not None,
                 "tags": [{"type": "tag", "begin": f'{HERMES_CALL_OPENING}\n{{"name": {json.dumps(name)}, "arguments": ',
                           "content": content, "end": HERMES_CALL_CLOSING}
                          for (name, _), content in zip(plan["tools"], arguments)]}
    if answer is not None:
        kind, source = answer
        reply = {"type": "regex", "pattern": source} if kind == "regex" else {"type": "grammar", "grammar": _ebnf(kind, source)}
        calls = {"type": "or", "elements": [reply, calls]}
    return json.dumps({"type": "structural_tag", "format": calls})
