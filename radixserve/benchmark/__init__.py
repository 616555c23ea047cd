"""The prefix-hit-rate benchmark: workloads, a cache simulator, offline bounds, an HTTP
client for a running server, and reports. Entry point: `radixserve bench ...`."""
