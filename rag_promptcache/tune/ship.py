"""Ship a trained adapter as the default for its model: copy it into the package (`model/adapters/<model>/`)
with its weights in float16 (half the bytes, and the merge into float32 weights differs from the float32
LoRA's by float16 rounding of the LoRA's own factors only), the recovery it was chosen for, and what it
measured.

    python -m rag_promptcache.tune.ship DIR --recovery none|last:N [--model NAME] [--measured FILE.json] [--no-links]

`DIR` is what `tune.recipe` or `rag-promptcache tune` wrote (peft's files and `tune.json`). The recovery
becomes the engine's default for the model (model/adapter.py); choose it by the fidelity benchmark's
rule, against the base model's full prefill (docs/FIDELITY.md). `--measured`: a JSON object filed under
`tune.json`'s "metrics" (the benchmark's rows that chose it). `--no-links`: ship the LoRA of an adapter
trained with link tokens without its link table (the model then has no link tokens and a recovery of
`links:N` is refused for it).

Not here: training (`recipe.py`), loading (`model/adapter.py`).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from rag_promptcache.model import adapter as adapters
from rag_promptcache.model import links


def ship(source: Path, recovery: str, *, model: str | None = None, measured: dict[str, object] | None = None,
         into: Path = adapters.SHIPPED, with_links: bool = True) -> Path:
    """Write `source`'s adapter to `into/<model>/` (float16 weights, `recovery`, `measured` filed under
    metrics; its link table unless `with_links` is False) and return that directory. The adapter is read
    (and so checked) before anything is written."""
    from safetensors.torch import load_file, save_file

    from rag_promptcache.engine.planning.recovery import Recovery

    parsed = Recovery.parse(recovery)  # a recovery the engine knows, or a clear error
    found = adapters.read(source)
    if parsed.kind == "links" and not (with_links and found.num_links):
        raise ValueError(f"recovery {recovery!r} needs link tokens, and the adapter shipped would have none; "
                         "ship it with its links or choose another recovery")
    name = (model or found.base_model).strip().lower().replace("/", "--")
    target = into / name
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = json.loads((source / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = found.base_model  # not the trainer's local path
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    weights = load_file(str(source / "adapter_model.safetensors"))
    save_file({k: v.to(torch.float16) if v.is_floating_point() else v for k, v in weights.items()},
              str(tmp / "adapter_model.safetensors"))
    if with_links and (source / links.FILE).is_file():  # link embeddings stay float32: a few KB
        shutil.copyfile(source / links.FILE, tmp / links.FILE)
    tune = json.loads((source / adapters.TUNE_FILE).read_text())
    tune["recovery"] = recovery
    if not with_links and "links" in tune.get("recipe", {}):
        tune["recipe"]["links"] = 0  # trained with links; shipped without them
        tune["recipe"]["links_dropped"] = found.num_links
    tune["metrics"] = {**tune.get("metrics", {}), **({"shipped": measured} if measured else {})}
    (tmp / adapters.TUNE_FILE).write_text(json.dumps(tune, indent=1) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(prog="python -m rag_promptcache.tune.ship", description=__doc__.split("\n\n")[0])
    ap.add_argument("adapter", type=Path, help="the trained adapter directory")
    ap.add_argument("--recovery", required=True, help="the engine's default recovery with this adapter")
    ap.add_argument("--model", help="the model name it ships for [default: its tune.json's base_model]")
    ap.add_argument("--measured", type=Path, help="a JSON object filed under tune.json's metrics")
    ap.add_argument("--no-links", action="store_true", help="ship the LoRA without the link table it was trained with")
    args = ap.parse_args(argv)
    measured = json.loads(args.measured.read_text()) if args.measured else None
    target = ship(args.adapter, args.recovery, model=args.model, measured=measured, with_links=not args.no_links)
    print(f"shipped {adapters.read(target).digest} to {target}")
    return target


if __name__ == "__main__":
    main()
