"""A 2-layer random llama with SmolLM2's tokenizer, saved as a model directory: a real model that a
subprocess or a Ray actor loads in a second, for tests of processes rather than of text quality."""

from __future__ import annotations

from pathlib import Path

import torch


def save_tiny_llama(out: Path, max_positions: int = 2048) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from rag_promptcache.model.loading import DEFAULT_MODEL, _resolve_directory

    tokenizer = AutoTokenizer.from_pretrained(_resolve_directory(DEFAULT_MODEL))
    config = AutoConfig.for_model("llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=max_positions, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def build_tiny_corpus(tmp_path_factory, docs: dict[str, str], max_positions: int = 2048, corpus: str = "c") -> Path:
    """A corpus (directory `corpus`) of `docs` (file name -> text) over a fresh tiny Llama (its context window
    `max_positions`), built without Redis, so nothing is in Redis until something encodes it."""
    from rag_promptcache.rag.corpus import Corpus

    folder = tmp_path_factory.mktemp("docs")
    for name, text in docs.items():
        (folder / name).write_text(text)
    model = save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), max_positions)
    path = tmp_path_factory.mktemp("corpus") / corpus
    Corpus.build([folder], path, model=model, progress=False, redis_url="").close()
    return path



def tiny_llama_and_records(tmp_path_factory, topics: dict[str, str], records: int) -> tuple[str, Path, object]:
    """(a saved tiny Llama, a folder of one file per topic, each its sentence as `records` numbered records,
    the real MiniLM embedder): what the corpus tests over a tiny model and real retrieval build from."""
    from rag_promptcache.rag.models import load_embedder

    docs = tmp_path_factory.mktemp("docs")
    for name, sentence in topics.items():
        (docs / name).write_text(" ".join(f"{sentence.strip()[:-1]}, as noted in record {i}." for i in range(records)))
    return save_tiny_llama(tmp_path_factory.mktemp("tiny")), docs, load_embedder(None)
