"""Llama, the default model's architecture, without transformers' model code.

Why: importing transformers' model classes (`modeling_utils`, and `LlamaConfig`'s module with them) imports
torch.distributed.tensor, dynamo, sympy and transformers' FP8 and kernel-hub integrations: 1.7-2.3 s of
every command that loads a model on this project's 2-core machine, most of what kept `ask` over 5 s.
Here are transformers' `LlamaForCausalLM` module tree and parameter names with the forward the engine runs
on them (SDPA attention; a 4D mask, or causality from the cache), on transformers' config, cache and
output classes, which import none of that. tests/test_llama.py holds its logits and KV equal to
transformers' (`torch.equal`), with and without a cache, a mask and grouped-query attention.

`supports(directory)` says where it loads: one safetensors file of a `LlamaForCausalLM` with the default
rotary embedding, SiLU, no biases and no tensor-parallel split, which is the default model's weights with
its adapter merged (model/loading.py keeps them so). Everything else loads with transformers.

Not here: training (dropout, gradient checkpointing), 2D padding masks, sharded checkpoints, other rotary
types. What only transformers' class offers (`generate`, what its pipelines call) is that class's, made on
first use over the same weights (`LlamaForCausalLM.transformers_model`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, GenerationConfig, PretrainedConfig
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from rag_promptcache.model import assigned
from rag_promptcache.model.rotary import apply_rotary_pos_emb  # noqa: F401 - recovery reads it off this module

if TYPE_CHECKING:
    from transformers import PreTrainedModel

WEIGHTS = "model.safetensors"
_FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"  # engine/compute/runner.py sets it around CPU forwards


def supports(directory: str | os.PathLike[str]) -> bool:
    """Whether `directory` holds a model this module loads exactly as transformers would."""
    root = Path(directory)
    try:
        cfg = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        return False
    rope = cfg.get("rope_parameters") or {}
    return (
        (root / WEIGHTS).is_file() and not (root / f"{WEIGHTS}.index.json").exists()
        and cfg.get("architectures") == ["LlamaForCausalLM"] and cfg.get("model_type") == "llama"
        and cfg.get("hidden_act") == "silu" and not cfg.get("attention_bias") and not cfg.get("mlp_bias")
        and cfg.get("pretraining_tp", 1) == 1 and rope.get("rope_type", "default") == "default"
        and "rope_theta" in rope and not cfg.get("layer_types")
    )


def load(directory: str | os.PathLike[str], device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """The model in `directory` (`supports` it), in eval mode without gradients, its weights used where the
    file is mapped when they are stored at `dtype` on the CPU (copied to `dtype` and `device` otherwise)."""
    from safetensors.torch import load_file

    config = PretrainedConfig.from_json_file(str(Path(directory) / "config.json"))
    config._name_or_path = str(directory)  # as from_pretrained sets it
    config._attn_implementation = "sdpa"  # what LlamaAttention runs
    model = LlamaForCausalLM(config)  # its weights not yet set: the file's are assigned next
    state = load_file(str(Path(directory) / WEIGHTS))
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    missing = set(dict(model.named_parameters())) - set(state) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if missing:
        raise ValueError(f"{directory}/{WEIGHTS} lacks {len(missing)} weights of this Llama, e.g. {sorted(missing)[:3]}")
    model.generation_config = GenerationConfig.from_pretrained(str(directory))
    model = model.to(device=device, dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    return model


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(dtype)


class LlamaRotaryEmbedding(nn.Module):
    """The default rotary embedding; `rope_type`, `inv_freq`, `original_inv_freq` and `attention_scaling`
    as transformers names them (model/positions.py reads them to relocate keys)."""

    rope_type = "default"

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.max_seq_len_cached = self.original_max_seq_len = config.max_position_embeddings
        self.attention_scaling = 1.0
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        base = config.rope_parameters["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.gate_proj = assigned.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = assigned.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = assigned.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def _sdpa(module: LlamaAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          mask: torch.Tensor | None) -> torch.Tensor:
    """transformers' SDPA attention (integrations/sdpa_attention.py) for this module, on a CPU or CUDA:
    grouped-query attention left to SDPA where it may, the KV heads repeated where it may not. → [B, N, H, D]"""
    n, groups, kwargs = q.shape[2], module.num_key_value_groups, {}
    if groups > 1:
        if os.environ.get(_FORCE_GQA, "0") == "1" or (mask is None and k.shape[-1] == v.shape[-1] <= 256):
            kwargs["enable_gqa"] = True
        elif n == 1:
            b, h, _, d = q.shape
            q = q.reshape(b, h // groups, groups, d)  # one query: its heads attend the KV heads in place
            mask = mask if mask is None or mask.shape[1] == 1 else mask.reshape(b, h // groups, groups, -1)
        else:
            k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=module.scaling,
                                         is_causal=n > 1 and mask is None, **kwargs)
    return out.reshape(out.shape[0], -1, n, v.shape[-1]).transpose(1, 2).contiguous()


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = config.num_key_value_heads or config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // kv_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        self.q_proj = assigned.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = assigned.Linear(config.hidden_size, kv_heads * self.head_dim, bias=False)
        self.v_proj = assigned.Linear(config.hidden_size, kv_heads * self.head_dim, bias=False)
        self.o_proj = assigned.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None = None, cache: DynamicCache | None = None,
                **_: object) -> tuple[torch.Tensor, None]:
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        out = _sdpa(self, q, k, v, attention_mask)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), None


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: DynamicCache | None = None,
                use_cache: bool | None = False, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                **_: object) -> torch.Tensor:
        # keywords, as transformers calls it: recovery's pre-hooks read `hidden_states` and `position_embeddings`
        attended, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask,
                                     position_ids=position_ids, cache=cache, use_cache=use_cache,
                                     position_embeddings=position_embeddings)
        hidden_states = hidden_states + attended
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


def causal_mask(mask: torch.Tensor | None, batch: int, num_new: int, num_cached: int,
                device: torch.device) -> torch.Tensor | None:
    """The mask transformers' `create_causal_mask` gives SDPA: a 4D one as it is; None (SDPA's own causal
    mask, or none for one token) where nothing is cached or one token is new; else boolean [B, 1, N, C + N]."""
    if mask is not None and mask.dim() == 4:
        return mask
    if mask is not None and not bool(mask.all()):
        raise ValueError("this Llama takes a 4D attention mask or none; a 2D padding mask is not supported")
    if num_new == 1 or num_cached == 0:
        return None
    q = torch.arange(num_new, device=device)[:, None] + num_cached
    allowed = torch.arange(num_cached + num_new, device=device)[None, :] <= q
    return allowed[None, None].expand(batch, 1, num_new, num_cached + num_new)


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = assigned.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: DynamicCache | None = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                past_key_values: DynamicCache | None = None, **_: object) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cache = cache if cache is not None else past_key_values
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        num_cached = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = (torch.arange(x.shape[1], device=x.device) + num_cached)[None]
        mask = causal_mask(attention_mask, x.shape[0], x.shape[1], num_cached, x.device)
        position_embeddings = self.rotary_emb(x, position_ids)
        for layer in self.layers[: self.config.num_hidden_layers]:
            x = layer(x, attention_mask=mask, position_ids=position_ids, cache=cache, use_cache=use_cache,
                      position_embeddings=position_embeddings)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(x), cache=cache)


class LlamaForCausalLM(nn.Module):
    """transformers' class of the same name as the engine uses it: `config`, `generation_config`, `model`
    (`base_model`), `lm_head`, the input embeddings' getter and setter, `device` and `dtype`; the rest of
    transformers' class (`generate`, what its pipelines call) from that class on the same weights."""

    base_model_prefix = "model"
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.generation_config: GenerationConfig | None = None
        self.model = LlamaModel(config)
        self.lm_head = assigned.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def base_model(self) -> LlamaModel:
        return self.model

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def __getattr__(self, name: str) -> object:
        """What transformers' class offers and this one does not (`generate`, `can_generate`, what pipelines
        call): `transformers_model()`'s, made on first use. Private names are not looked up there."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_"):
                raise
            return getattr(self.transformers_model(), name)

    def transformers_model(self) -> PreTrainedModel:
        """transformers' LlamaForCausalLM on these very weights (shared, not copied), for what only it offers
        (`generate`, pipelines); made on first use, when it costs the import this class avoids. It shares the
        weights as they are then: moved to another device or dtype after, this model's are not its."""
        made = self.__dict__.get("_transformers")  # not a submodule: it would be saved and moved twice
        if made is None:
            from transformers import LlamaConfig
            from transformers import LlamaForCausalLM as Theirs

            config = LlamaConfig.from_dict(self.config.to_dict(), attn_implementation="sdpa")
            with torch.device("meta"):
                made = Theirs(config)
            layers = {k: v for k, v in self.state_dict().items() if k.startswith(("model.layers.", "model.norm."))}
            made.load_state_dict(layers, assign=True, strict=False)
            # the very modules: the input embedding may be wrapped with link rows (model/links.py)
            made.model.embed_tokens, made.lm_head = self.model.embed_tokens, self.lm_head
            made.model.rotary_emb = self.model.rotary_emb
            made.generation_config = self.generation_config
            made.eval()
            self.__dict__["_transformers"] = made
        return made

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embed_tokens = value

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: DynamicCache | None = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                logits_to_keep: int = 0, past_key_values: DynamicCache | None = None,
                **_: object) -> CausalLMOutputWithPast:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=cache if cache is not None else past_key_values, inputs_embeds=inputs_embeds,
                         use_cache=use_cache)
        logits = self.lm_head(out.last_hidden_state[:, -logits_to_keep:])
        return CausalLMOutputWithPast(logits=logits, cache=out.cache)
