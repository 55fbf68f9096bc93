"""Which entropy coder the cachegen codec uses: rANS (constriction, what ships) against zstd and zlib
over the same quantized symbols, on SmolLM2's own KV; with int8 and int4 for scale.

    python -m rag_promptcache.bench.entropy --modules 4 --tokens 256

Prints one JSON object: per coder, bytes per token (the codec's other tensors, tables aside, added to
zstd's and zlib's streams), median encode and decode seconds a module, and the relative error of the
decoded keys and values. Not here: answer fidelity (bench/fidelity.py --codec).
"""

from __future__ import annotations

import argparse
import json
import time
import zlib

from rag_promptcache.bench.common import median, module_texts, schema_pml


def _timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modules", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    import numpy as np
    import torch
    import zstandard

    from rag_promptcache.engine import PromptCache
    from rag_promptcache.model.loading import load_model
    from rag_promptcache.store import MemoryStore, cachegen, decode, encode

    torch.set_num_threads(args.threads)
    model, tok = load_model()
    pc = PromptCache(model, tok, store=MemoryStore(), prefix_cache_bytes=0)
    names = [f"d{i}" for i in range(args.modules)]
    pc.add_schema(schema_pml("entropy", dict(zip(names, module_texts(tok, args.modules, args.tokens), strict=True))))
    pc.encode("entropy", names)
    kvs = [pc.store.get(k) for k in pc.store_keys("entropy", names).values()]

    rows: dict[str, dict[str, list[float]]] = {}

    def add(name: str, **values: float) -> None:
        for k, v in values.items():
            rows.setdefault(name, {}).setdefault(k, []).append(v)

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    for kv in kvs:
        n = kv.num_tokens
        for codec in ("int8", "int4", "cachegen"):
            enc_s, coded = _timed(lambda c=codec: encode(kv, c))
            dec_s, back = _timed(lambda: decode(coded))
            add("ans" if codec == "cachegen" else codec, bytes_per_token=coded.num_bytes / n, encode_s=enc_s,
                decode_s=dec_s, err_keys=err(back.keys, kv.keys), err_values=err(back.values, kv.values))
            if codec != "cachegen":
                continue
            g = cachegen.Geometry(*kv.keys.shape)
            symbols = b"".join(np.concatenate([a.numpy().ravel(), d.numpy().ravel()]).astype(np.uint8).tobytes()
                               for a, d, _ in (cachegen.quantize(x, g) for x in (kv.keys, kv.values)))
            params = sum(t.numel() * t.element_size() for name, t in coded.tensors.items()
                         if name not in ("stream", "anchor_table", "delta_tables"))
            coders = {"zstd-3": (zstandard.ZstdCompressor(level=3).compress, zstandard.ZstdDecompressor().decompress),
                      "zstd-19": (zstandard.ZstdCompressor(level=19).compress, zstandard.ZstdDecompressor().decompress),
                      "zlib-9": (lambda b: zlib.compress(b, 9), zlib.decompress)}
            for name, (comp, decomp) in coders.items():
                enc_s, blob = _timed(lambda c=comp: c(symbols))
                dec_s, _ = _timed(lambda d=decomp, b=blob: d(b))
                add(name, bytes_per_token=(len(blob) + params) / n, encode_s=enc_s, decode_s=dec_s)
    out = {"modules": len(kvs), "tokens": args.tokens, "layer_bits": list(cachegen.LAYER_BITS),
           "group": cachegen.GROUP, "dtype": str(kvs[0].keys.dtype),
           "coders": {name: {k: round(median(v), 5) for k, v in vals.items()} for name, vals in rows.items()}}
    print(json.dumps(out, indent=1), flush=True)
    return out


if __name__ == "__main__":
    main()
