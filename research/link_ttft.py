"""TTFT of one prompt whose modules sit in Redis behind a given link: loading them, recomputing them,
and the adaptive plan (engine/planning/plan.py `recompute_sooner`, on the link the Redis tier measured).

Point it at a Redis reached through the link to measure; docs/scale-out.md shows how a network
namespace with a tc shaper makes one on this machine:

    python -m research.link_ttft --redis-url redis://10.232.0.2:6390 --codec fp16

Each path runs `--repeats` times, interleaved, each time with a fresh memory tier (so "load" fetches
every module from Redis) and no prefix cache; the Redis tier (and its measured link) is the
process's, as a server's would be. Prints one JSON object: median TTFT per path and the link.

Not here: starting Redis or shaping the link (root, per machine), and several concurrent requests.
"""

from __future__ import annotations

import argparse
import json
import uuid

from rag_promptcache.bench.common import median, module_texts, schema_pml


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--redis-url", required=True)
    ap.add_argument("--codec", default="fp16")
    ap.add_argument("--modules", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256, help="per module")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--label", default="", help="the link's name in the output")
    args = ap.parse_args(argv)

    import torch

    from rag_promptcache.engine import PromptCache
    from rag_promptcache.model.loading import load_model
    from rag_promptcache.store import MemoryStore, NullStore, RedisStore, TieredStore

    torch.set_num_threads(args.threads)
    model, tok = load_model()
    names = [f"d{i}" for i in range(args.modules)]
    schema = schema_pml("link", dict(zip(names, module_texts(tok, args.modules, args.tokens), strict=True)))
    prompt = '<prompt schema="link">' + "".join(f"<{n}/>" for n in names) + "<user>What is this about?</user></prompt>"
    redis = RedisStore(args.redis_url, prefix=uuid.uuid4().hex, codec=args.codec)

    def engine(path: str) -> PromptCache:
        store = NullStore() if path == "recompute" else TieredStore([MemoryStore(), redis])
        pc = PromptCache(model, tok, store=store, recovery="none", prefix_cache_bytes=0,
                         fallback="auto" if path == "adaptive" else "never")
        pc.add_schema(schema)
        return pc

    engine("load").encode("link")  # every module into Redis
    engine("load").generate(prompt, max_new_tokens=1)  # warm-up: first samples of the link, the kernels
    engine("adaptive").generate(prompt, max_new_tokens=1)  # and the cost calibration (stored once per machine)
    ttft: dict[str, list[float]] = {p: [] for p in ("load", "recompute", "adaptive")}
    recomputed: list[int] = []
    for _ in range(args.repeats):
        for path in ttft:
            res = engine(path).generate(prompt, max_new_tokens=1)
            ttft[path].append(res.ttft_s)
            if path == "adaptive":
                recomputed.append(len(res.missed_modules))
    link = redis.link()
    out = {"label": args.label, "codec": args.codec, "modules": args.modules, "tokens": args.tokens,
           **{f"{p}_ttft_s": round(median(ts), 4) for p, ts in ttft.items()},
           "adaptive_recomputed_modules": recomputed,
           "link": {"latency_ms": round((link.latency_s or 0) * 1e3, 2),
                    "mbit_per_s": round((link.bytes_per_s or 0) * 8 / 1e6, 1),
                    "bytes_per_token": round(link.bytes_per_token or 0),
                    "decode_ms_per_module": round((link.decode_s_per_token or 0) * args.tokens * 1e3, 1)}}
    redis.close()
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
