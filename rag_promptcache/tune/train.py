"""Teach a model to read modules encoded on their own: LoRA, distilled from its own full prefill.

The student is the model with a LoRA adapter (peft) reading each sample under the engine's block
mask (`layout.py`: modules see the shared prefix and themselves, the question and answer see all).
The teacher is the same model with the adapter off, reading the same tokens with plain causal
attention: what a user gets without this library. The loss is KL(teacher ‖ student) on every
position the engine computes (the question, its chat markup, the answer) plus a small
cross-entropy on the answer; a share of samples is read with the causal mask by the student too, so
the adapter leaves full prefill as it was. With `links` > 0 the student also reads that many link
tokens after each module (model/links.py, laid out by `layout.py` as recovery `links:N` places them),
whose embeddings train with the LoRA; the teacher and the causal share read the prompt without them.
Data, model, loop, checkpoint in one file, nothing in callbacks (nanoGPT's train.py is the model).

Resumable: a checkpoint (adapter, optimizer, step, samples seen) is written every `save_every`
steps and on stop; `train` picks it up from `out`. Stops at `max_steps` or `max_seconds`.
Not here: making samples (`samples.py`), the CLI (`cli/tune_cmd.py`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from rag_promptcache.model import links
from rag_promptcache.model.adapter import peft_quiet
from rag_promptcache.tune.layout import Laid, batch_masks

TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CHECKPOINT = "checkpoint"
MAX_LEN = 3072  # tokens of the longest sample trained on, in the plain layout


@dataclass(frozen=True, slots=True)
class TuneConfig:
    rank: int = 16
    alpha: int = 32
    targets: tuple[str, ...] = TARGETS
    lr: float = 4e-4
    warmup: int = 20
    max_steps: int = 1000
    max_seconds: float = 3600.0
    tokens_per_batch: int = 4096  # padded tokens per optimizer step
    max_len: int | None = None  # longer samples are dropped; None: MAX_LEN (`max_len_for` after M neighbours)
    full_share: float = 0.15  # samples the student reads with the causal mask (keeps full prefill as it was)
    ce_weight: float = 0.1
    seed: int = 0
    save_every: int = 50
    autocast: bool = True  # bf16 autocast where the device has it
    init: str = ""  # an adapter directory the LoRA starts from (same rank and targets); empty: a fresh LoRA
    links: int = 0  # link tokens after each module (the samples must be laid out with as many); 0: none
    links_lr_scale: float = 5.0  # the link embeddings' learning rate against the LoRA's
    wrap: int = 0  # wrapper tokens on each side of every module (the samples laid out with them); 0: none
    freeze_lora: bool = False  # train the learned tokens alone, the LoRA as `init` left it (KV Packet's frozen model)


@dataclass(slots=True)
class Progress:
    step: int = 0
    samples: int = 0  # sample indices consumed
    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)


def max_len_for(neighbours: int, plain: int = MAX_LEN) -> int:
    """The longest sample to train on where every module is laid out after `neighbours` hidden copies
    (`layout.py`): a sample grows by about that many times its modules' tokens."""
    return plain * (1 + neighbours)


def batches(stream: Iterator[tuple[int, Laid]], cfg: TuneConfig) -> Iterator[tuple[list[Laid], int]]:
    """(samples, index after the last one read) by padded-token budget, sorted by length within windows of 64.
    A window whose every sample is longer than `cfg.max_len` raises: the stream would never yield."""
    limit = cfg.max_len or MAX_LEN
    while True:
        window = [next(stream) for _ in range(64)]
        after = window[-1][0] + 1
        kept = sorted((s for _, s in window if len(s) <= limit), key=len)
        if not kept:
            raise ValueError(f"all 64 samples of a window are longer than max_len = {limit} tokens (the "
                             f"shortest {min(len(s) for _, s in window)}): raise max_len or lay out fewer modules")
        group: list[Laid] = []
        for s in kept:
            if group and len(s) * (len(group) + 1) > cfg.tokens_per_batch:
                yield group, after
                group = []
            group.append(s)
        if group:
            yield group, after


def loss_terms(student: torch.Tensor, teacher: torch.Tensor, samples: Sequence[Laid],
               plain: Sequence[Laid] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL(teacher ‖ student) per computed position, CE on the answer) for right-padded logits [B, S, V];
    the teacher read `plain[b]` (sample b without its link tokens; None: the samples themselves), whose
    question and answer are the student's, `num_links` tokens earlier."""
    plain = samples if plain is None else plain
    rows, cols, teacher_cols, answer = [], [], [], []
    for b, (s, p) in enumerate(zip(samples, plain)):
        shift = s.loss_from - p.loss_from
        for t in range(s.loss_from, len(s) - 1):  # logits at t predict token t + 1
            rows.append(b)
            cols.append(t)
            teacher_cols.append(t - shift)
            answer.append(t >= s.answer_from - 1)
    r, c = torch.tensor(rows, device=student.device), torch.tensor(cols, device=student.device)
    st = student[r, c].float().log_softmax(-1)  # [N, V]
    te = teacher[r, torch.tensor(teacher_cols, device=student.device)].float().log_softmax(-1)
    kl = F.kl_div(st, te, log_target=True, reduction="none").sum(-1).mean()
    targets = torch.tensor([samples[b].ids[t + 1] for b, t in zip(rows, cols)], device=student.device)
    keep = torch.tensor(answer, device=student.device)
    ce = F.nll_loss(st[keep], targets[keep]) if keep.any() else st.new_zeros(())
    return kl, ce


def bf16_autocast(device: torch.device) -> bool:
    """Whether bf16 autocast pays here: a GPU, or a CPU with bf16 units (model/loading.py)."""
    from rag_promptcache.model.loading import cpu_has_bf16

    return device.type == "cuda" or (device.type == "cpu" and cpu_has_bf16())


def attach(model, cfg: TuneConfig):
    """The model with a fresh LoRA adapter (peft) and, with `cfg.links`, fresh link embeddings; only
    those trainable (the embeddings alone with `cfg.freeze_lora`)."""
    from peft import LoraConfig, get_peft_model

    if cfg.freeze_lora and not (cfg.links or cfg.wrap):
        raise ValueError("freeze_lora trains the link or wrapper tokens alone: set links or wrap")
    for p in model.parameters():
        p.requires_grad_(False)
    if cfg.links or cfg.wrap:
        links.install(model, links.fresh(model, 2 * cfg.wrap + cfg.links, cfg.seed), cfg.wrap)
    lora = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, target_modules=list(cfg.targets), lora_dropout=0.0,
                      bias="none", task_type="CAUSAL_LM")
    with peft_quiet():
        peft_model = get_peft_model(model, lora)
    if cfg.freeze_lora:
        for p in peft_model.parameters():
            p.requires_grad_(False)
    if cfg.links or cfg.wrap:
        links.of(model).links.requires_grad_(True)
    return peft_model


def param_groups(peft_model, cfg: TuneConfig) -> list[dict]:
    """The LoRA's parameters, and the link embeddings at their own learning rate scale."""
    table = links.of(peft_model.get_base_model())
    link_params = [table.links] if table is not None and table.links.requires_grad else []
    lora = [p for p in peft_model.parameters() if p.requires_grad and all(p is not q for q in link_params)]
    groups = [{"params": lora, "scale": 1.0}] if lora else []
    if link_params:
        groups.append({"params": link_params, "scale": cfg.links_lr_scale})
    return groups


def train(model, stream: Callable[[int], Iterator[tuple[int, Laid]]], out: str | Path, cfg: TuneConfig = TuneConfig(),
          progress: Callable[[Progress, dict[str, float]], None] | None = None):
    """Train a LoRA on `model` (a plain transformers causal LM) over `stream(start)`, which yields
    (index, sample) from sample `start` on; the adapter and a checkpoint go to `out`. Resumes from
    `out/checkpoint`. Returns (the peft model, where it stopped)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    device = next(model.parameters()).device
    peft_model = attach(model, cfg)
    groups = param_groups(peft_model, cfg)
    params = [p for g in groups for p in g["params"]]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=0.0)
    state = Progress()
    ckpt = out / CHECKPOINT
    if (ckpt / "state.json").exists():
        state = _resume(peft_model, opt, ckpt)
    elif cfg.init:
        _start_from(peft_model, Path(cfg.init), cfg)
    use_autocast = cfg.autocast and bf16_autocast(device)
    gen = torch.Generator().manual_seed(cfg.seed + state.step)
    t0 = time.perf_counter() - state.seconds
    peft_model.train()
    try:
        for group, next_index in batches(stream(state.samples), cfg):
            if state.step >= cfg.max_steps or time.perf_counter() - t0 >= cfg.max_seconds:
                break
            done = min(1.0, max(state.step / cfg.max_steps, (time.perf_counter() - t0) / cfg.max_seconds))
            lr = cfg.lr * min(1.0, (state.step + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * done))
            for g in opt.param_groups:
                g["lr"] = lr * g.get("scale", 1.0)
            full = (torch.rand(len(group), generator=gen) < cfg.full_share).tolist()
            plain = [s.plain() for s in group]
            read = [p if f else s for s, p, f in zip(group, plain, full)]  # a causal read has no links
            ids, pos, block = batch_masks(read, full, device)
            plain_ids, plain_pos, causal = batch_masks(plain, [True] * len(group), device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
                with torch.no_grad(), peft_model.disable_adapter():
                    teacher = peft_model(input_ids=plain_ids, position_ids=plain_pos, attention_mask=causal).logits
                student = peft_model(input_ids=ids, position_ids=pos, attention_mask=block).logits
            kl, ce = loss_terms(student, teacher, read, plain)
            loss = kl + cfg.ce_weight * ce
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            state.step += 1
            state.samples = next_index
            state.seconds = time.perf_counter() - t0
            state.losses.append(loss.item())
            if progress is not None:
                progress(state, {"kl": kl.item(), "ce": ce.item(), "lr": lr, "tokens": int(ids.numel())})
            if state.step % cfg.save_every == 0:
                _save(peft_model, opt, state, ckpt)
    except KeyboardInterrupt:
        _save(peft_model, opt, state, ckpt)  # an interrupted run resumes from the last finished step
        raise
    _save(peft_model, opt, state, ckpt)
    peft_model.save_pretrained(str(out))
    _save_links(peft_model, out)
    (out / "train.json").write_text(json.dumps({"config": asdict(cfg), "step": state.step, "samples": state.samples,
                                                "seconds": state.seconds, "losses": state.losses[-200:]}, indent=1))
    peft_model.eval()
    return peft_model, state


def _save(peft_model, opt, state: Progress, ckpt: Path) -> None:
    tmp = ckpt.with_name(ckpt.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(str(tmp))
    _save_links(peft_model, tmp)
    torch.save(opt.state_dict(), tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps(asdict(state)))
    if ckpt.exists():
        import shutil

        shutil.rmtree(ckpt)
    tmp.rename(ckpt)  # a stop mid-save leaves the previous checkpoint whole


def _save_links(peft_model, directory: Path) -> None:
    table = links.of(peft_model.get_base_model())
    if table is not None:
        links.save(table.links, directory, table.wrap)


def _load_links(peft_model, directory: Path) -> None:
    """Take the link embeddings saved in `directory`, where it has as many as this run trains."""
    table, saved = links.of(peft_model.get_base_model()), links.load(directory)
    if table is None or saved is None:
        return
    if saved.shape != table.links.shape or links.wrap_of(directory) != table.wrap:
        raise ValueError(f"{directory} holds {saved.shape[0]} learned tokens ({links.wrap_of(directory)} wrappers a "
                         f"side), this run trains {table.num_rows} ({table.wrap} a side)")
    with torch.no_grad():
        table.links.copy_(saved)


def can_start_from(adapter: str | Path, cfg: TuneConfig) -> bool:
    """Whether a run of `cfg` can start from the adapter's weights: the same rank on the same projections."""
    config = json.loads((Path(adapter) / "adapter_config.json").read_text())
    return config.get("r") == cfg.rank and set(config.get("target_modules") or ()) == set(cfg.targets)


def _start_from(peft_model, adapter: Path, cfg: TuneConfig) -> None:
    """Load another adapter's LoRA weights (a shipped one, maybe in float16) as the starting point."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    if not can_start_from(adapter, cfg):
        config = json.loads((adapter / "adapter_config.json").read_text())
        raise ValueError(f"cannot start from {adapter}: rank {config.get('r')} on {config.get('target_modules')}, "
                         f"this run trains rank {cfg.rank} on {list(cfg.targets)}")
    weights = {k: v.float() for k, v in load_file(str(adapter / "adapter_model.safetensors")).items()}
    set_peft_model_state_dict(peft_model, weights)
    _load_links(peft_model, adapter)


def _resume(peft_model, opt, ckpt: Path) -> Progress:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    set_peft_model_state_dict(peft_model, load_file(str(ckpt / "adapter_model.safetensors")))
    _load_links(peft_model, ckpt)
    opt.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True))
    return Progress(**json.loads((ckpt / "state.json").read_text()))
