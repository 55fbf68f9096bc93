"""Memory and store numbers: bytes per cached token per codec (measured against the formula
`layers × 2 × kv_heads × head_dim × bytes`), the store size of the demo modules, and how long one
module takes to load from each tier against recomputing it (the store crossover).

Reuses the module KV the earlier scenarios encoded (`bench.extras`); encodes a few modules itself
when run alone. Not here: quality per codec (quality.py carries codec rows).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from rag_promptcache.bench.common import (
    Bench,
    interleaved,
    median,
    module_texts,
    schema_pml,
)
from rag_promptcache.engine import PromptCache
from rag_promptcache.store import DiskStore, MemoryStore, ModuleKV, NullStore, decode, encode

SCHEMA = "bench_memory"
BYTES = {"fp16": 2.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5, "k8v4": 0.75, "k6v6": 0.75, "k7v5": 0.75, "k5v5": 0.625}  # cachegen: no formula, its size depends on the values


def _engine(bench: Bench) -> PromptCache:
    """The engine whose memory store holds the TTFT modules (or a few encoded here)."""
    pc = bench.extras.get("ttft_engine")
    if isinstance(pc, PromptCache):
        return pc
    pc = PromptCache(bench.model, bench.tokenizer, store=MemoryStore(), name=bench.model_name, prefix_cache_bytes=0)
    pc.add_schema(schema_pml(SCHEMA, {f"d{i}": t for i, t in enumerate(module_texts(bench.tokenizer, 4, 256))}))
    pc.encode(SCHEMA)
    bench.extras["ttft_engine"] = pc
    return pc


def run(bench: Bench) -> dict[str, object]:
    cfg = bench.config
    engine = _engine(bench)
    native = engine.store
    assert isinstance(native, MemoryStore), f"{type(native)=}"
    keys = native.keys()
    key = max(keys, key=lambda k: native.get(k).num_tokens)  # a module, not the shorter schema root
    sample: ModuleKV = native.get(key)
    layers, kv_heads, _, head_dim = sample.keys.shape
    per_elem = {"native": float(sample.keys.element_size()), **BYTES}
    rows = []
    with tempfile.TemporaryDirectory(prefix="rpc-bench-mem-") as tmp:
        for codec in cfg.codecs:
            mem = MemoryStore(codec=codec)
            disk = DiskStore(Path(tmp) / codec, codec=codec)
            for k in keys:
                kv = native.get(k)
                mem.put(k, kv)
                disk.put(k, kv)
            ms, ds = mem.stats(), disk.stats()
            on_disk = sum(f.stat().st_size for f in (Path(tmp) / codec).rglob("*") if f.is_file())
            enc_s, dec_s = _codec_times(bench, codec, sample)
            rows.append({
                "codec": codec,
                "bytes_per_token": ms.bytes_per_token,
                "formula_bytes_per_token": layers * 2 * kv_heads * head_dim * per_elem[codec] if codec in per_elem else None,
                "encode_s": enc_s,
                "decode_s": dec_s,
                "disk_bytes_per_token": on_disk / ds.num_tokens if ds.num_tokens else 0.0,
                "tokens": ms.num_tokens,
            })
            bench.log(f"memory {codec}: {rows[-1]['bytes_per_token']:.0f} B/token "
                      f"(formula {rows[-1]['formula_bytes_per_token']}, disk {rows[-1]['disk_bytes_per_token']:.0f}), "
                      f"encode {enc_s:.4f} s, decode {dec_s:.4f} s a module")
            disk.close()
        tiers = _tier_loads(bench, engine, key, Path(tmp) / "tiers")
    demo = _demo_store(bench, rows)
    return {"memory": rows, "store_tiers": tiers, "demo_store": demo,
            "geometry": {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim, "dtype": str(sample.keys.dtype)}}


def _codec_times(bench: Bench, codec: str, kv: ModuleKV) -> tuple[float, float]:
    """Median seconds to encode, and to decode, one module in `codec`."""
    coded = encode(kv, codec)
    times = interleaved({"encode": (lambda: encode(kv, codec), bench.config.store_repeats, 1),
                         "decode": (lambda: decode(coded), bench.config.store_repeats, 1)}, bench.device, bench.min_span_s)
    return median(times["encode"]), median(times["decode"])


def _tier_loads(bench: Bench, engine: PromptCache, key: str, root: Path) -> dict[str, object]:
    """Seconds to get one module from each tier against encoding a module of the same length."""
    kv = engine.store.get(key)
    tiers: dict[str, object] = {}
    for codec in ("native", "int8"):
        mem = MemoryStore(codec=codec)
        mem.put(key, kv)
        disk = DiskStore(root / codec, codec=codec)
        disk.put(key, kv)
        tiers[f"memory_{codec}"] = lambda s=mem: s.get(key)
        tiers[f"disk_{codec}"] = lambda s=disk: s.get(key)  # the warm-up read warms the page cache
    schema = _names(engine)[0]
    module = next(n for n in engine.schema(schema).modules if engine.is_cached(schema, n))
    recompute = PromptCache(bench.model, bench.tokenizer, store=NullStore(), name=bench.model_name, prefix_cache_bytes=0)
    recompute.add_schema(engine.schema(schema))
    tiers["recompute"] = lambda: recompute.encode(schema, [module])
    times = interleaved({name: (fn, bench.config.store_repeats, 1) for name, fn in tiers.items()}, bench.device,
                        bench.min_span_s)
    out: dict[str, object] = {f"{name}_s": median(ts) for name, ts in times.items()}
    out["module_tokens"] = kv.num_tokens
    for name in [n for n in out if n.endswith("_s") and n != "recompute_s"]:
        out[name.removesuffix("_s") + "_vs_recompute"] = out["recompute_s"] / out[name]
    bench.log("store tiers (one module): " + ", ".join(f"{k} {v:.4f}" for k, v in out.items() if k.endswith("_s")))
    return out


def _names(engine: PromptCache) -> list[str]:
    names = []
    for n in ("bench_ttft", SCHEMA):
        try:
            engine.schema(n)
        except ValueError:
            continue
        names.append(n)
    return names


def _demo_store(bench: Bench, rows: list[dict[str, object]]) -> dict[str, object]:
    """The demo modules' store size per codec, from the quality scenario's native store."""
    stores = bench.extras.get("quality_stores")
    if not isinstance(stores, dict) or not stores:
        return {"skipped": "the quality scenario did not run"}
    store = next(iter(stores.values()))
    st = store.stats()
    per_token = {r["codec"]: r["bytes_per_token"] for r in rows}
    return {"modules": st.num_entries, "tokens": st.num_tokens, "native_bytes": st.num_bytes,
            "bytes_by_codec": {c: round(b * st.num_tokens) for c, b in per_token.items()}}
