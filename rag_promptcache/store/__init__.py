"""Where module KV lives: tiers (memory, disk, Redis), their composition, codecs and eviction.

    store = TieredStore([MemoryStore(max_bytes=2**30), DiskStore("/var/cache/rpc", max_bytes=20 * 2**30)])
    store = make_store("memory+disk:/var/cache/rpc", codec="int8")

Every tier implements the `Store` protocol and turns a missing, corrupt or foreign entry into a
miss (`None`). Importing this package does not import the redis client; `RedisStore` does.
"""

from .admin import describe, evict_to, verify
from .base import FORMAT_VERSION, ModuleKV, Store, StoreStats, VerifyReport, module_key
from .codecs import CODEC_VERSIONS, CODECS, EncodedKV, check_codec, decode, encode
from .config import DeviceConfig, DiskConfig, MemoryConfig, RedisConfig, StoreConfig, load_config, make_store
from .device import DeviceStore
from .disk import DiskStore
from .eviction import BudgetIndex, CostAwarePolicy, Entry, LRUPolicy, make_policy
from .memory import MemoryStore
from .null import NullStore
from .redis import RedisStore
from .serialize import CorruptEntry, dumps, loads
from .tiered import TieredStore

__all__ = [
    "FORMAT_VERSION",
    "CODECS",
    "CODEC_VERSIONS",
    "BudgetIndex",
    "CorruptEntry",
    "CostAwarePolicy",
    "DeviceConfig",
    "DeviceStore",
    "DiskConfig",
    "DiskStore",
    "EncodedKV",
    "Entry",
    "LRUPolicy",
    "MemoryConfig",
    "MemoryStore",
    "ModuleKV",
    "NullStore",
    "RedisConfig",
    "RedisStore",
    "Store",
    "StoreConfig",
    "StoreStats",
    "TieredStore",
    "VerifyReport",
    "check_codec",
    "decode",
    "describe",
    "dumps",
    "encode",
    "evict_to",
    "load_config",
    "loads",
    "make_policy",
    "make_store",
    "module_key",
    "verify",
]
