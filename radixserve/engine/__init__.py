"""The engine: scheduling, batching, sampling and the request lifecycle."""
