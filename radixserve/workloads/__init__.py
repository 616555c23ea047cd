"""Request traces and synthetic workloads that drive the cache, the simulator and benchmarks."""

from radixserve.workloads.mooncake import TraceRequest, expand_tokens, load_mooncake_trace

__all__ = ["TraceRequest", "expand_tokens", "load_mooncake_trace"]
