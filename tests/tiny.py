"""Tiny random-weight configs (2 layers, hidden 64) for exactness tests across architectures.

Adding an architecture to every contract test is one line in ARCHS.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    max_position_embeddings=2048,
)


def cfg(model_type: str, **overrides):
    return AutoConfig.for_model(model_type, **{**TINY, **overrides})


def gqa(model_type: str, **overrides):
    return cfg(model_type, num_key_value_heads=2, **overrides)


def windowed(model_type: str, **defaults):
    """An architecture with sliding-window layers; a test's overrides (a smaller window, other layer
    types) win over `defaults`."""
    return lambda **kw: gqa(model_type, **{**defaults, **kw})


def llama_scaled(**rope):
    return gqa("llama", rope_parameters={"rope_theta": 10000.0, **rope})


HALF = 8  # head_dim 16 -> 8 rotary frequencies
WINDOW = 16  # the `*_window` architectures' sliding window, in tokens
ARCHS = {
    "llama": lambda **kw: gqa("llama", **kw),
    "mistral": windowed("mistral", sliding_window=4096),
    "mixtral": windowed("mixtral", num_local_experts=2, sliding_window=4096),
    "qwen2": lambda **kw: gqa("qwen2", **kw),
    "qwen3": lambda **kw: gqa("qwen3", head_dim=16, **kw),
    "phi3_partial": lambda **kw: gqa("phi3", pad_token_id=0,
                                     rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.5}, **kw),
    "phi_partial": lambda **kw: cfg("phi", rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.5}, **kw),
    "gemma": lambda **kw: gqa("gemma", head_dim=16, **kw),
    "gemma2": windowed("gemma2", head_dim=16, sliding_window=4096, layer_types=["sliding_attention", "full_attention"]),
    "gemma3_text": windowed("gemma3_text", head_dim=16, sliding_window=4096,
                            layer_types=["sliding_attention", "full_attention"]),
    "gpt_neox_pct25": lambda **kw: cfg("gpt_neox", rope_parameters={"rope_theta": 10000.0,
                                                                    "partial_rotary_factor": 0.25}, **kw),
    "stablelm": lambda **kw: gqa("stablelm", **kw),
    "granite": lambda **kw: gqa("granite", **kw),
    "olmo2": lambda **kw: gqa("olmo2", **kw),
    "starcoder2": windowed("starcoder2", sliding_window=4096),
    "smollm3_nope": lambda **kw: gqa("smollm3", pad_token_id=0, no_rope_layers=[1, 0], **kw),
    "cohere_interleaved": lambda **kw: gqa("cohere", **kw),
    "cohere2_interleaved_nope": windowed("cohere2", sliding_window=4096, layer_types=["sliding_attention", "full_attention"]),
    # windows far shorter than a prompt: Gemma 3's five local layers to one global, kept to two of each
    "gemma3_window": windowed("gemma3_text", head_dim=16, sliding_window=WINDOW, num_hidden_layers=4,
                              layer_types=["sliding_attention", "full_attention"] * 2),
    "mistral_window": windowed("mistral", sliding_window=WINDOW),
    "qwen2_window": windowed("qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "gptj_interleaved": lambda **kw: cfg("gptj", n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=2048, **kw),
    "codegen_interleaved": lambda **kw: cfg("codegen", n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                                            n_positions=2048, **kw),
    "falcon_rope": lambda **kw: cfg("falcon", alibi=False, **kw),
    "falcon_rope_new_decoder": lambda **kw: cfg("falcon", alibi=False, new_decoder_architecture=True,
                                                num_kv_heads=2, **kw),
    "llama_linear": lambda **kw: llama_scaled(rope_type="linear", factor=2.0),
    "llama_dynamic": lambda **kw: llama_scaled(rope_type="dynamic", factor=2.0),
    "llama_yarn": lambda **kw: llama_scaled(rope_type="yarn", factor=4.0, original_max_position_embeddings=512),
    "llama_llama3": lambda **kw: llama_scaled(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                              high_freq_factor=4.0, original_max_position_embeddings=256),
    "llama_longrope": lambda **kw: llama_scaled(rope_type="longrope", original_max_position_embeddings=1024,
                                                short_factor=[1.0 + i / 10 for i in range(HALF)],
                                                long_factor=[2.0 + i for i in range(HALF)]),
    "bloom_alibi": lambda **kw: cfg("bloom", n_embed=64, n_layer=2, n_head=4, **kw),
    "mpt_alibi": lambda **kw: cfg("mpt", d_model=64, n_layers=2, n_heads=4, **kw),
    "falcon_alibi": lambda **kw: cfg("falcon", alibi=True, **kw),
    "gpt2": lambda **kw: cfg("gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=2048, **kw),
    "opt": lambda **kw: cfg("opt", ffn_dim=128, word_embed_proj_dim=64, **kw),
}


def build(name: str, device: str = "cpu", **overrides):
    """A tiny fp32 model of architecture `name` in eval mode on `device`, same weights every call (drawn
    on the CPU, so a CUDA model has the CPU model's weights)."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(ARCHS[name](**overrides), dtype=torch.float32).eval().to(device)
