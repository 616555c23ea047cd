"""Building an engine's cache (KV pools, host tier, radix tree, reuse history) and reading the
model's end tokens, from the loaded model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from radixserve.cache.adaptive import AdaptiveReuse
from radixserve.cache.events import CacheEventHub
from radixserve.cache.page_hash import PageHashing
from radixserve.cache.pool import PagePool
from radixserve.cache.radix import RadixTree
from radixserve.cache.reuse import ReuseHistory
from radixserve.cache.tiers import HostTier
from radixserve.engine.cgroup_memory import cgroup_available
from radixserve.models.loader import LoadedModel

DEFAULT_CPU_KV_GB = 0.5
DEFAULT_GPU_KV_FRACTION = 0.8
REUSE_WINDOW = 16  # reuse history length, in multiples of the cache's pages, both tiers (measured best)


@dataclass(frozen=True)
class EngineCache:
    """The cache an engine schedules over: device pool, optional host tier, the tree over
    both (publishing to `events`) and, for "adaptive" and "reuse-boost" eviction, the reuse
    history (adaptive: an `AdaptiveReuse`, which also teaches the tree's policy its lead)."""

    pool: PagePool
    host_tier: HostTier | None
    events: CacheEventHub
    tree: RadixTree
    reuse_history: ReuseHistory | AdaptiveReuse | None


def build_cache(loaded: LoadedModel, page_size: int, *, num_pages: int | None, kv_memory_gb: float | None,
                eviction_policy: str, prefix_cache: bool, host_num_pages: int | None,
                host_kv_memory_gb: float | None, host_write_policy: str,
                host_offload_min_priority: int, hashing: PageHashing | None = None) -> EngineCache:
    """The engine's cache as its arguments describe it (see Engine); without `prefix_cache`
    there is no host tier and no reuse history. `hashing` names pages in cache events."""
    pool = make_pool(loaded, page_size, num_pages, kv_memory_gb)
    host_tier = make_host_tier(loaded, pool, host_num_pages, host_kv_memory_gb, host_write_policy,
                               host_offload_min_priority) if prefix_cache else None
    reuse_boost = eviction_policy == "reuse-boost"
    events = CacheEventHub(page_size)
    tree = RadixTree(pool, eviction_policy="priority" if reuse_boost else eviction_policy,
                     events=events, host=host_tier, hashing=hashing)
    cache_pages = pool.num_pages + (host_tier.pool.num_pages if host_tier else 0)
    reuse_history: ReuseHistory | AdaptiveReuse | None = None
    if prefix_cache and reuse_boost:
        reuse_history = ReuseHistory(page_size, REUSE_WINDOW * cache_pages)
    elif prefix_cache and eviction_policy == "adaptive":
        reuse_history = AdaptiveReuse(tree, REUSE_WINDOW * cache_pages)
    return EngineCache(pool, host_tier, events, tree, reuse_history)


def _page_shape(loaded: LoadedModel) -> dict[str, Any]:
    cfg = loaded.model
    return dict(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                dtype=loaded.dtype)


def make_pool(loaded: LoadedModel, page_size: int, num_pages: int | None,
              kv_memory_gb: float | None) -> PagePool:
    """The device pool, sized by pages or by bytes; default: 0.5 GB on CPU, 80% of free
    memory on CUDA."""
    if num_pages is not None and kv_memory_gb is not None:
        raise ValueError("give num_pages or kv_memory_gb, not both")
    shape = dict(_page_shape(loaded), device=loaded.device)
    if num_pages is not None:
        if num_pages < 1:
            raise ValueError(f"num_pages: must be >= 1, got {num_pages}")
        check_fits(num_pages * bytes_per_page(loaded, page_size), loaded.device, "num_pages", f"{num_pages} pages")
        return PagePool(num_pages, page_size, **shape)
    if kv_memory_gb is None:
        if loaded.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(loaded.device)
            budget = int(free * DEFAULT_GPU_KV_FRACTION)
        else:
            budget = int(DEFAULT_CPU_KV_GB * 2**30)
    else:
        if kv_memory_gb <= 0:
            raise ValueError(f"kv_memory_gb: must be > 0, got {kv_memory_gb}")
        budget = int(kv_memory_gb * 2**30)
        check_fits(budget, loaded.device, "kv_memory_gb", f"{kv_memory_gb:g} GiB")
        holds_a_page(budget, loaded, page_size, "kv_memory_gb", kv_memory_gb)
    return PagePool.from_memory_budget(budget, page_size, **shape)


def holds_a_page(budget: int, loaded: LoadedModel, page_size: int, name: str, memory_gb: float) -> None:
    """Refuses a memory size (named `name`) too small for one page of this model."""
    per_page = bytes_per_page(loaded, page_size)
    if budget < per_page:
        raise ValueError(f"{name}: {memory_gb:g} GiB holds no page of {page_size} tokens of this model "
                         f"({per_page} bytes; at least {per_page / 2**30:.3g} GiB)")


def available_memory(device: torch.device) -> int | None:
    """Bytes that can still be allocated on `device` (free GPU memory; on the CPU the
    kernel's MemAvailable, or what the process's cgroup limit leaves when that is lower), or
    None where neither can be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    found = [x for x in (_mem_available(), cgroup_available()) if x is not None]
    return min(found) if found else None


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_fits(num_bytes: int, device: torch.device, name: str, asked: str) -> None:
    """Raises ValueError naming the flag when a pool of `num_bytes` cannot fit `device`'s
    available memory: better a one-line refusal than an allocator's traceback or a swap storm."""
    available = available_memory(device)
    if available is not None and num_bytes > available:
        raise ValueError(f"{name}: a KV cache of {asked} ({num_bytes / 2**30:.1f} GiB) does not fit in the "
                         f"{available / 2**30:.1f} GiB of {device.type} memory available")


def make_host_tier(loaded: LoadedModel, device_pool: PagePool, num_pages: int | None,
                   memory_gb: float | None, write_policy: str,
                   offload_min_priority: int) -> HostTier | None:
    """The host tier's pool (same page shape, in host memory, pinned on CUDA); None when
    neither size is given or it is zero."""
    if num_pages is not None and memory_gb is not None:
        raise ValueError("give host_num_pages or host_kv_memory_gb, not both")
    for name, value in (("host_num_pages", num_pages), ("host_kv_memory_gb", memory_gb)):
        if value is not None and value < 0:
            raise ValueError(f"{name}: must be >= 0, got {value}")
    if not num_pages and not memory_gb:
        return None
    shape = dict(_page_shape(loaded), device="cpu", pin_memory=loaded.device.type == "cuda")
    page_size = device_pool.page_size
    cpu = torch.device("cpu")
    if num_pages:
        check_fits(num_pages * bytes_per_page(loaded, page_size), cpu, "host_num_pages", f"{num_pages} pages")
        host_pool = PagePool(num_pages, page_size, **shape)
    else:
        check_fits(int(memory_gb * 2**30), cpu, "host_kv_memory_gb", f"{memory_gb:g} GiB")
        holds_a_page(int(memory_gb * 2**30), loaded, page_size, "host_kv_memory_gb", memory_gb)
        host_pool = PagePool.from_memory_budget(int(memory_gb * 2**30), page_size, **shape)
    return HostTier.over(device_pool, host_pool, write_policy=write_policy,
                         offload_min_priority=offload_min_priority)


def bytes_per_page(loaded: LoadedModel, page_size: int) -> int:
    """The bytes of K and V one page of `page_size` tokens holds over every layer."""
    m = loaded.model
    return PagePool.bytes_per_page(page_size, m.num_layers, m.num_kv_heads, m.head_dim, loaded.dtype)


def eos_token_ids(loaded: LoadedModel) -> set[int]:
    """The model's end tokens: its config's, its generation config's (generation_config.json,
    or a GGUF file's end-of-sequence/turn/message ids) and its tokenizer's."""
    ids: set[int] = set(loaded.generation_defaults.stop_token_ids)
    for source in (loaded.config, getattr(loaded.model, "generation_config", None)):
        eos = getattr(source, "eos_token_id", None)
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if loaded.tokenizer is not None and loaded.tokenizer.eos_token_id is not None:
        ids.add(loaded.tokenizer.eos_token_id)
    return ids


GENERATION_CONFIG_MODES = ("auto", "none")
_DEFAULTED_FIELDS = ("temperature", "top_p", "top_k")  # SamplingParams fields a checkpoint may set


def sampling_defaults(loaded: LoadedModel, mode: str) -> dict[str, float | int]:
    """The checkpoint's recommended temperature, top_p and top_k, for requests that leave them
    unset ("auto", as vLLM's `--generation-config auto`), or none ("none"). A repetition
    penalty it recommends is not applied: the sampler has none."""
    if mode not in GENERATION_CONFIG_MODES:
        raise ValueError(f"generation_config: unknown {mode!r}, expected one of {list(GENERATION_CONFIG_MODES)}")
    if mode == "none":
        return {}
    stated = loaded.generation_defaults
    return {name: getattr(stated, name) for name in _DEFAULTED_FIELDS if getattr(stated, name) is not None}


def runtime_summary(loaded: LoadedModel, attention: object) -> str:
    """One line for the start-up log: device, dtype, attention backend and, on the CPU,
    whether the C kernels run. Building them (a second or so the first time) happens here,
    so that the first request does not wait for the compiler."""
    dtype = str(loaded.dtype).removeprefix("torch.")
    parts = [f"device {loaded.device}", f"dtype {dtype}", f"attention backend {type(attention).__name__}"]
    if loaded.device.type == "cpu":
        from radixserve.native import build, paged_attention, sampling

        missing = {name: build.unavailable_reason(name) for name in (paged_attention.NAME, sampling.NAME)}
        missing = {name: why for name, why in missing.items() if why}
        if missing:
            parts.append("CPU kernels unavailable, torch path instead: "
                         + "; ".join(f"{name} ({why})" for name, why in missing.items()))
        else:
            parts.append(f"CPU kernels in use (paged attention, sampling; built in {build.kernel_dir()})")
    return ", ".join(parts)
