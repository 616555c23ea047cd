"""The Mooncake FAST'25 trace format: requests as chains of 512-token block hashes.

Each line is `{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}`;
two requests whose `hash_ids` start with the same k ids share their first k*512 input tokens.
No text is included, so `expand_tokens` turns each id into 512 token ids that depend only on
the id: equal ids give equal tokens, different ids different tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from os import PathLike

import numpy as np

BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRequest:
    """One request of a Mooncake trace."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_mooncake_trace(path: str | PathLike[str]) -> list[TraceRequest]:
    """Reads a Mooncake JSONL trace; requests come back in timestamp order (stable)."""
    requests = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            req = TraceRequest(int(row["timestamp"]), int(row["input_length"]),
                               int(row["output_length"]), tuple(int(h) for h in row["hash_ids"]))
            blocks = -(-req.input_length // BLOCK_TOKENS)
            if len(req.hash_ids) != blocks:
                raise ValueError(f"{path}:{line_no}: {len(req.hash_ids)} hash ids for "
                                 f"{req.input_length} tokens, expected {blocks}")
            requests.append(req)
    requests.sort(key=lambda r: r.timestamp_ms)
    return requests


def expand_tokens(req: TraceRequest) -> np.ndarray:
    """The request's input as int64 token ids: block id `h` becomes `h*512 .. h*512+511`,
    the last block cut to `input_length`."""
    ids = np.asarray(req.hash_ids, dtype=np.int64)
    tokens = (ids[:, None] * BLOCK_TOKENS + np.arange(BLOCK_TOKENS, dtype=np.int64)).ravel()
    return tokens[: req.input_length]
