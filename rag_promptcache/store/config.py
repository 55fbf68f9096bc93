"""Store configuration: one frozen dataclass per tier, one table of keys, one env prefix, a factory.

A spec string names the tiers, fastest first, joined by "+":
    "memory" | "disk:/path" | "redis://host:port/db" | "memory+disk:/path" | "memory+redis://…"
    "gpu+memory" (a device tier, device.py, in front: "gpu" or "gpu:cuda:1")
    "off" (or "none") -> NullStore;  None -> $RAG_PROMPTCACHE_STORE, else "memory".
Options come from keyword arguments, then `RAG_PROMPTCACHE_STORE_<OPTION>` environment variables,
then the defaults; the keys are those of `OPTIONS`. An unknown key, as an argument or as a variable
under `RAG_PROMPTCACHE_STORE_`, raises. Sizes accept suffixes: "512MiB", "2G", "100k".

Out of scope: the engine's own settings (they live with the engine under their own prefix).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .base import Store
from .codecs import check_codec
from .device import DeviceStore
from .disk import DiskStore
from .eviction import make_policy
from .memory import MemoryStore
from .null import NullStore
from .redis import RedisStore
from .tiered import WRITE_POLICIES, TieredStore

ENV_PREFIX = "RAG_PROMPTCACHE_STORE"


@dataclass(frozen=True, slots=True)
class MemoryConfig:
    max_bytes: int | None = None
    codec: str = "native"
    device: str = "cpu"
    policy: str = "lru"


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    max_bytes: int | None = None  # None: device.DEFAULT_FRACTION of the device's memory
    device: str = "cuda"
    policy: str = "lru"


@dataclass(frozen=True, slots=True)
class DiskConfig:
    path: str | None = None
    max_bytes: int | None = None
    codec: str = "native"
    policy: str = "lru"


@dataclass(frozen=True, slots=True)
class RedisConfig:
    url: str = "redis://127.0.0.1:6379/0"
    prefix: str = "rpc"
    ttl_s: float | None = None
    codec: str = "native"
    chunk_bytes: int = 8 * 2**20
    retry_after_s: float = 2.0
    max_bytes: int | None = None  # this prefix's entries (store/redis_budget.py); None: Redis' own maxmemory
    policy: str = "lru"


@dataclass(frozen=True, slots=True)
class StoreConfig:
    spec: str = "memory"
    write: str = "through"
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    disk: DiskConfig = field(default_factory=DiskConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    gpu: DeviceConfig = field(default_factory=DeviceConfig)
    # the engine's prefix cache of recent requests' KV (engine/prefix/prefix_cache.py), in bytes; 0 turns it off
    prefix_cache_bytes: int = 256 * 2**20


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(value: str | int | None) -> int | None:
    if value is None or isinstance(value, int):
        return value
    if value.strip().lower() in ("", "none", "unbounded"):
        return None
    m = _SIZE.match(value)
    if not m:
        raise ValueError(f"cannot read size {value!r}; write e.g. 1048576, 512MiB, 2G")
    unit = 1024 ** ("kmgt".index(m[2].lower()) + 1) if m[2] else 1
    return int(float(m[1]) * unit)


def _byte_budget(value: str | int) -> int:
    size = parse_size(value)
    if size is None or size < 0:
        raise ValueError(f"prefix_cache_bytes must be a size >= 0 (0 turns the prefix cache off), got {value!r}")
    return size


def _opt_float(value: str | float | None) -> float | None:
    if value is None or isinstance(value, float | int):
        return value
    return None if value.strip().lower() in ("", "none") else float(value)


# option -> (component, field, parser). "codec" sets every tier's codec at once.
OPTIONS: dict[str, tuple[str, str, Callable[..., object]]] = {
    "spec": ("", "spec", str),
    "write": ("", "write", str),
    "codec": ("*", "codec", check_codec),
    "memory_max_bytes": ("memory", "max_bytes", parse_size),
    "memory_codec": ("memory", "codec", check_codec),
    "memory_device": ("memory", "device", str),
    "memory_policy": ("memory", "policy", str),
    "disk_path": ("disk", "path", str),
    "disk_max_bytes": ("disk", "max_bytes", parse_size),
    "disk_codec": ("disk", "codec", check_codec),
    "disk_policy": ("disk", "policy", str),
    "redis_url": ("redis", "url", str),
    "redis_prefix": ("redis", "prefix", str),
    "redis_ttl_s": ("redis", "ttl_s", _opt_float),
    "redis_codec": ("redis", "codec", check_codec),
    "redis_chunk_bytes": ("redis", "chunk_bytes", parse_size),
    "redis_retry_after_s": ("redis", "retry_after_s", float),
    "redis_max_bytes": ("redis", "max_bytes", parse_size),
    "redis_policy": ("redis", "policy", str),
    "prefix_cache_bytes": ("", "prefix_cache_bytes", _byte_budget),
    "gpu_max_bytes": ("gpu", "max_bytes", parse_size),
    "gpu_device": ("gpu", "device", str),
    "gpu_policy": ("gpu", "policy", str),
}


def env_name(option: str) -> str:
    return ENV_PREFIX if option == "spec" else f"{ENV_PREFIX}_{option.upper()}"


def load_config(spec: str | None = None, env: Mapping[str, str] | None = None, **options: object) -> StoreConfig:
    """Defaults, then environment, then `options`, then `spec`; unknown keys raise ValueError."""
    env = os.environ if env is None else env
    unknown = [k for k in options if k not in OPTIONS]
    known_env = {env_name(k) for k in OPTIONS}
    unknown += [k for k in env if k.startswith(ENV_PREFIX + "_") and k not in known_env]
    if unknown:
        valid = ", ".join(f"{k} (${env_name(k)})" for k in OPTIONS)
        raise ValueError(f"unknown store option(s) {', '.join(unknown)}; valid options: {valid}")
    values = {k: env[env_name(k)] for k in OPTIONS if env_name(k) in env}
    values |= {k: v for k, v in options.items() if v is not None}
    if spec is not None:
        values["spec"] = spec
    cfg = StoreConfig()
    parts: dict[str, dict[str, object]] = {"": {}, "memory": {}, "disk": {}, "redis": {}, "gpu": {}}
    for option, raw in values.items():
        component, name, parse = OPTIONS[option]
        value = parse(raw)
        for c in ("memory", "disk", "redis") if component == "*" else (component,):
            parts[c][name] = value
    # A per-tier codec beats the shared one whichever came first.
    for option in ("memory_codec", "disk_codec", "redis_codec"):
        if option in values:
            parts[option.split("_")[0]]["codec"] = check_codec(str(values[option]))
    return dataclasses.replace(
        cfg,
        **parts[""],
        memory=dataclasses.replace(cfg.memory, **parts["memory"]),
        disk=dataclasses.replace(cfg.disk, **parts["disk"]),
        redis=dataclasses.replace(cfg.redis, **parts["redis"]),
        gpu=dataclasses.replace(cfg.gpu, **parts["gpu"]),
    )


def build_store(cfg: StoreConfig) -> Store:
    if cfg.write not in WRITE_POLICIES:
        raise ValueError(f"unknown write policy {cfg.write!r}; valid policies: {', '.join(WRITE_POLICIES)}")
    spec = cfg.spec.strip()
    if spec.lower() in ("off", "none", "null"):
        return NullStore()
    tiers: list[Store] = [_tier(part.strip(), cfg) for part in spec.split("+")]
    return tiers[0] if len(tiers) == 1 else TieredStore(tiers, write=cfg.write)


def _tier(part: str, cfg: StoreConfig) -> Store:
    if part == "memory":
        m = cfg.memory
        make_policy(m.policy)
        return MemoryStore(max_bytes=m.max_bytes, codec=m.codec, device=m.device, policy=m.policy)
    if part == "gpu" or part.startswith("gpu:"):
        g = cfg.gpu
        make_policy(g.policy)
        return DeviceStore(max_bytes=g.max_bytes, device=part.removeprefix("gpu").removeprefix(":") or g.device,
                           policy=g.policy)
    if part == "disk" or part.startswith("disk:"):
        d = cfg.disk
        path = part.removeprefix("disk").removeprefix(":") or d.path
        if not path:
            raise ValueError(f"a disk tier needs a path: 'disk:/path' or ${env_name('disk_path')}")
        return DiskStore(path, max_bytes=d.max_bytes, codec=d.codec, policy=d.policy)
    if part == "redis" or part.startswith(("redis://", "rediss://", "unix://")):
        r = cfg.redis
        make_policy(r.policy)
        url = r.url if part == "redis" else part
        return RedisStore(url, r.prefix, r.ttl_s, r.codec, r.chunk_bytes, r.retry_after_s, max_bytes=r.max_bytes,
                          policy=r.policy)
    raise ValueError(
        f"unknown store tier {part!r}; valid tiers: gpu[:device], memory, disk:/path, redis://host:port/db "
        "(joined by '+'), or off"
    )


def make_store(spec: str | None = None, *, env: Mapping[str, str] | None = None, **options: object) -> Store:
    """A store from a spec string and options, e.g. `make_store("memory+disk:/var/cache/rpc", codec="int8")`."""
    return build_store(load_config(spec, env, **options))
