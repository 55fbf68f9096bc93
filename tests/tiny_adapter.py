"""A random LoRA for a model directory, saved as an adapter directory (peft's files and `tune.json`):
what the adapter tests load, merge and fingerprint. Random, not zero: peft starts `lora_B` at zero,
which would merge to the base weights and hide every difference."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def save_random_lora(model_dir: str, out: Path, *, recovery: str | None = "none", seed: int = 0, scale: float = 0.05,
                     rank: int = 4, targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")) -> Path:
    from peft import LoraConfig, get_peft_model

    from rag_promptcache.model.loading import load_model, model_fingerprint

    model, _ = load_model(model_dir, device="cpu", dtype="float32", adapter="none")
    base_fingerprint = model_fingerprint(model)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets), lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    peft_model.save_pretrained(out)
    tune = {"format": 1, "base_model": model_dir, "base_fingerprint": base_fingerprint, "mode": "shared_prefix",
            "recovery": recovery, "recipe": {"seed": seed, "random": True}, "metrics": {}}
    (out / "tune.json").write_text(json.dumps(tune, indent=1))
    return out
