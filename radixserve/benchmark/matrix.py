"""The policy matrix (`radixserve bench matrix`): every workload x capacity x tiers x replicas,
the default eviction rule next to LRU, the best fixed rule and the offline optimum.

A cell is one workload at one device capacity, device only or with a host tier of
`host_tokens`, on one replica or on `replicas` replicas behind the cache-aware router (the
cluster simulation as it is: replicas run device only, capacity per replica). Each cell runs
the default rule (`adaptive`) and every rule of `fixed` (the rules one would otherwise pick
by hand). One replica runs sequentially (one request at a time in arrival order, the trace
README's setting: the eviction rule alone decides), several run the cluster's serving loop
(continuous batching; the cluster simulation has no sequential mode). The optimum is the offline bound at the cell's total
capacity (one cache of device + host, or of all replicas' memory). A cell is *below* when
the default's hit rate is under LRU's. A cell of several replicas also runs its *ideal*, the
default rule on one replica of their combined memory serving the same releases in the same
loop: what the replicas lose against it is the split alone (`routing_shares`).

The matrix is large, so it runs scaled: `scale` multiplies every capacity and every length
(prompt, message, document, tool output; the trace's 512-token blocks), not the counts, so
each cell keeps its shape — the same requests, the same cache-to-working-set ratio — in
fewer tokens: at 1/32 a trace block is one page. `count_scale` then takes that share of the
conversations, documents and requests (the first ones of the trace), with the capacities
multiplied by it too, for a matrix that runs in minutes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from radixserve.benchmark.cli_simulate import EVICTION_POLICIES
from radixserve.benchmark.cluster_sim import IMBALANCE_WINDOW, simulate_cluster
from radixserve.benchmark.families import FAMILIES
from radixserve.benchmark.mixes import HELD_OUT
from radixserve.benchmark.optimum import WorkloadBounds
from radixserve.benchmark.report import format_tokens, percent
from radixserve.benchmark.simulate import SimConfig, simulate
from radixserve.benchmark.suite import make_retention
from radixserve.benchmark.workloads import BenchRequest, Workload, make_workload
from radixserve.cache.tiers import WRITE_BACK

DEFAULT_RULE = "adaptive"  # the engine's default (EVICTION_POLICIES name)
FIXED_RULES = ("lru", "reuse-boost")
CAPACITIES = (500_000, 1_000_000, 2_000_000, 4_000_000, 8_000_000, 16_000_000)
HOST_TOKENS = 8_000_000
TRACE = Path(__file__).resolve().parents[2] / "bench" / "data" / "mooncake_synthetic_trace.jsonl"
TRACE_BLOCK_TOKENS = 512
GENERATED = ("gsp", "multiturn", "agent", "tools", "fewshot")
# The generated workloads were sized for small caches: 4 times their default count (so that
# they outgrow the smaller caches of the matrix), and their lengths, by name, to scale.
_COUNTS = {"gsp": ("num_groups", 256), "multiturn": ("num_clients", 128), "agent": ("num_agents", 64),
           "tools": ("num_agents", 64), "fewshot": ("questions_per_task", 256)}
_LENGTHS = {"gsp": dict(system_len=2048, question_len=128, output_len=256),
            "multiturn": dict(system_len=1024, message_len=128, output_len=128),
            "agent": dict(system_len=2048, task_len=256, tool_len=512, output_len=64),
            "tools": dict(system_len=512, tools_len=1024, task_len=128, call_len=48, result_len=256),
            "fewshot": dict(example_len=256, question_len=64, output_len=16)}


def matrix_workloads() -> list[str]:
    """Every workload of the matrix: the families, the trace, the older generated ones."""
    return [*FAMILIES, "mooncake", *GENERATED]


def known_workloads() -> list[str]:
    """The matrix's workloads and the held-out mixes (mixes.py), which run only when named."""
    return [*matrix_workloads(), *HELD_OUT]


def _scaled(length: int, scale: float) -> int:
    return max(1, int(round(length * scale)))


def scaled_trace(scale: float, path: Path = TRACE) -> Workload:
    """The Mooncake trace with every 512-token block as `512 * scale` tokens (at 1/32, one
    16-token page per block: the trace at its own block resolution) and arrivals kept."""
    from radixserve.workloads.mooncake import load_mooncake_trace

    block = _scaled(TRACE_BLOCK_TOKENS, scale)
    requests = []
    for i, t in enumerate(load_mooncake_trace(path)):
        ids = np.asarray(t.hash_ids, dtype=np.int64)
        tokens = (ids[:, None] * block + np.arange(block, dtype=np.int64)).ravel()[:_scaled(t.input_length, scale)]
        requests.append(BenchRequest(index=i, prompt_ids=tokens.astype(np.int32), output_len=_scaled(t.output_length, scale),
                                     arrival_time=t.timestamp_ms / 1000.0))
    return Workload("mooncake", requests, dict(path=str(path), token_scale=scale))


def build_workload(name: str, scale: float, count_scale: float = 1.0) -> Workload:
    """Workload `name` with every length times `scale` and its number of conversations,
    documents or requests times `count_scale` (see the module docstring)."""
    if name in FAMILIES:
        return make_workload(name, token_scale=scale, scale=count_scale)
    if name in HELD_OUT:
        return HELD_OUT[name](scale, count_scale)
    if name == "mooncake":
        trace = scaled_trace(scale)
        return Workload(trace.name, trace.requests[:max(1, int(len(trace.requests) * count_scale))],
                        dict(trace.params, count_scale=count_scale))
    if name in _COUNTS:
        param, count = _COUNTS[name]
        lengths = {key: _scaled(value, scale) for key, value in _LENGTHS[name].items()}
        return make_workload(name, **{param: _scaled(count, count_scale)}, **lengths)
    raise ValueError(f"matrix workload: unknown {name!r}, expected one of {known_workloads()}")


@dataclass
class Cell:
    """One cell's configuration and hit rates (rule name -> hit rate)."""

    workload: str
    capacity_tokens: int
    host_tokens: int
    replicas: int
    rates: dict[str, float] = field(default_factory=dict)
    optimum: float | None = None
    # Several replicas: the default rule on one replica of their combined memory, run the same
    # way (the serving loop, the same releases): the routing target's ideal (`routing_shares`).
    ideal: float | None = None
    # Several replicas: the worst request imbalance (max / min per replica) of the default
    # rule's run over any IMBALANCE_WINDOW consecutive routings: the target's other half.
    imbalance: float | None = None

    @property
    def default(self) -> float:
        """The default rule's hit rate."""
        return self.rates[DEFAULT_RULE]

    def best_fixed(self) -> tuple[str, float]:
        """The fixed rule with the highest hit rate, and that rate."""
        name = max((r for r in self.rates if r != DEFAULT_RULE), key=lambda r: self.rates[r])
        return name, self.rates[name]

    @property
    def below_lru(self) -> bool:
        """Whether the default is under LRU here."""
        return self.default < self.rates["lru"]

    def to_dict(self) -> dict[str, object]:
        """JSON-ready."""
        name, best = self.best_fixed()
        return {"workload": self.workload, "capacity_tokens": self.capacity_tokens, "host_tokens": self.host_tokens,
                "replicas": self.replicas, "hit_rates": self.rates, "optimum": self.optimum, "ideal": self.ideal,
                "imbalance": self.imbalance,
                "best_fixed": name, "best_fixed_hit_rate": best, "below_lru": self.below_lru,
                "points_from_best_fixed": 100 * (self.default - best)}


def _config(rule: str, capacity: int, host: int, page_size: int, write_policy: str,
            sequential: bool = True) -> SimConfig:
    eviction, retention = EVICTION_POLICIES[rule]
    config = SimConfig(capacity, page_size=page_size, eviction_policy=eviction, host_capacity_tokens=host,
                       host_write_policy=write_policy, sequential=sequential)
    return replace(config, retention=make_retention(retention, page_size=page_size,
                                                    capacity_tokens=capacity + host))


def run_cell(workload: Workload, cell: Cell, bounds: WorkloadBounds, rules: list[str], page_size: int,
             write_policy: str = WRITE_BACK) -> Cell:
    """Fills `cell`'s hit rates (each rule), optimum and, on several replicas, the ideal; a
    host tier copies by `write_policy`."""
    total = cell.capacity_tokens * cell.replicas + cell.host_tokens
    cell.optimum = bounds.optimum(total).hit_rate
    for rule in rules:
        if cell.replicas == 1:
            cell.rates[rule] = simulate(workload, _config(rule, cell.capacity_tokens, cell.host_tokens,
                                                          page_size, write_policy)).hit_rate
        else:
            eviction, retention = EVICTION_POLICIES[rule]
            config = SimConfig(cell.capacity_tokens, page_size=page_size, eviction_policy=eviction)
            run = simulate_cluster(workload, config, cell.replicas, "cache-aware", retention=retention)
            cell.rates[rule] = run.result.hit_rate
            if rule == DEFAULT_RULE:
                cell.imbalance = run.windowed_imbalance
    if cell.replicas > 1:
        # Not the one-replica cell of that capacity: it runs sequentially, and a split cache
        # compared with it would also be charged for its serving loop (requests computing a
        # prefix at once, pages pinned by running ones), which one cache serving the same
        # releases pays as well.
        combined = _config(DEFAULT_RULE, cell.capacity_tokens * cell.replicas, 0, page_size, write_policy,
                           sequential=False)
        cell.ideal = simulate(workload, combined).hit_rate
    return cell


def run_matrix(workloads: list[str], capacities: list[int], *, scale: float, count_scale: float, host_tokens: int,
               replicas: list[int], fixed: list[str], page_size: int = 16, write_policy: str = WRITE_BACK,
               on_cell: Callable[[Cell], None] | None = None) -> list[Cell]:
    """Every cell of the matrix (capacities and host_tokens unscaled: `scale` applies)."""
    rules = [DEFAULT_RULE, *[r for r in fixed if r != DEFAULT_RULE]]
    if "lru" not in rules:
        rules.append("lru")
    cells: list[Cell] = []
    for name in workloads:
        workload = build_workload(name, scale, count_scale)
        bounds = WorkloadBounds(workload)
        for capacity in capacities:
            scaled = max(page_size * 4, int(capacity * scale * count_scale))
            host = int(host_tokens * scale * count_scale)
            shapes = [(0, n) for n in replicas] + ([(host, 1)] if host_tokens else [])
            for host, n in shapes:
                cell = run_cell(workload, Cell(name, scaled, host, n), bounds, rules, page_size, write_policy)
                cells.append(cell)
                if on_cell is not None:
                    on_cell(cell)
    return cells


def matrix_table(cells: list[Cell]) -> str:
    """Markdown: one row per cell; **below LRU** marks a cell where the default is under LRU."""
    lines = ["| workload | capacity | tiers | replicas | default (adaptive) | LRU | best fixed rule | "
             "default - best fixed | optimum | |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        name, best = c.best_fixed()
        tiers = "device" if not c.host_tokens else f"device + {format_tokens(c.host_tokens)} host"
        lines.append(f"| {c.workload} | {format_tokens(c.capacity_tokens)} | {tiers} | {c.replicas} | "
                     f"{percent(c.default)} | {percent(c.rates['lru'])} | {percent(best)} ({name}) | "
                     f"{100 * (c.default - best):+.2f} | {percent(c.optimum)} | "
                     f"{'**below LRU**' if c.below_lru else ''} |")
    return "\n".join(lines)


ROUTING_TARGET = 0.95  # N replicas of C tokens against one replica of N x C (issue 23)
IMBALANCE_TARGET = 1.5  # ... with at most this request imbalance over any IMBALANCE_WINDOW routings


def routing_shares(cells: list[Cell]) -> list[tuple[Cell, float]]:
    """Each cell of several replicas with the share of its ideal's hit rate (one replica of
    their combined memory, the same serving loop: `Cell.ideal`) the default rule reaches on
    the replicas; cells whose ideal hits nothing are left out."""
    return [(cell, cell.default / cell.ideal) for cell in cells
            if cell.replicas > 1 and cell.ideal is not None and cell.ideal > 0]


def matrix_summary(cells: list[Cell]) -> str:
    """One paragraph: cells below LRU, the largest gap to the best fixed rule, replicas
    against one cache of their combined memory (ROUTING_TARGET) and their request balance
    (IMBALANCE_TARGET)."""
    below = [c for c in cells if c.below_lru]
    gaps = [100 * (c.best_fixed()[1] - c.default) for c in cells]
    worst = max(gaps, default=0.0)
    within = sum(1 for g in gaps if g <= 2.0)
    summary = (f"{len(cells)} cells: default below LRU in {len(below)} (largest shortfall "
               f"{max((100 * (c.rates['lru'] - c.default) for c in below), default=0.0):.2f} points); "
               f"within 2 points of the best fixed rule in {within}; largest gap {worst:.2f} points.")
    shares = routing_shares(cells)
    if shares:
        met = sum(1 for _, share in shares if share >= ROUTING_TARGET)
        cell, share = min(shares, key=lambda item: item[1])
        summary += (f" Replicas against one replica of their combined memory serving the same requests: at "
                    f"least {ROUTING_TARGET:.0%} of its hit rate in {met} of {len(shares)} cells; lowest "
                    f"{share:.1%} ({cell.workload} {format_tokens(cell.capacity_tokens)} x {cell.replicas}: "
                    f"{percent(cell.default)} vs {percent(cell.ideal)}).")
    measured = [c for c in cells if c.imbalance is not None]
    if measured:
        uneven = max(measured, key=lambda c: c.imbalance)
        met = sum(1 for c in measured if c.imbalance <= IMBALANCE_TARGET)
        summary += (f" Request imbalance (max/min per replica) over any {IMBALANCE_WINDOW:,} routings at most "
                    f"{IMBALANCE_TARGET:g} in {met} of {len(measured)} cells; worst {uneven.imbalance:.2f} "
                    f"({uneven.workload} {format_tokens(uneven.capacity_tokens)} x {uneven.replicas}).")
    return summary
