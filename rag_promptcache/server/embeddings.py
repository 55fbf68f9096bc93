"""`/v1/embeddings` over the corpus's own embedder: the vectors its index was built with.

Token counts (OpenAI's `usage.prompt_tokens`) and the length limit come from the embedder's tokenizer
when it has one (sentence-transformers: `embedder.model.tokenizer`), read through the Rust tokenizer's
`encode_batch`, which changes no tokenizer state and so cannot race retrieval's own embedding in
another thread. An input longer than the embedder's `max_seq_length` is refused, where
sentence-transformers would silently embed only its start. An embedder without a tokenizer (tests'
tiny ones) counts whitespace words and has no limit.
Not here: the wire shapes (`protocol.py`), batching across requests (one request's inputs are one batch).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from rag_promptcache.rag.embed import EmbedderLike

MAX_INPUTS = 2048  # OpenAI's own limit per request


class Embeddings:
    def __init__(self, embedder: EmbedderLike) -> None:
        self.embedder = embedder
        self._lock = threading.Lock()  # one batch at a time: they share the model's threads anyway

    @property
    def name(self) -> str:
        return self.embedder.name

    def _tokenizer(self) -> tuple[object, int | None] | None:
        model = getattr(self.embedder, "model", None)
        tokenizer = getattr(getattr(model, "tokenizer", None), "backend_tokenizer", None)
        if tokenizer is None:
            return None
        return tokenizer, getattr(model, "max_seq_length", None)

    def count(self, texts: Sequence[str]) -> list[int]:
        """Tokens per input; ValueError naming the inputs the embedder would truncate."""
        found = self._tokenizer()
        if found is None:
            return [len(t.split()) for t in texts]
        tokenizer, limit = found
        encodings = tokenizer.encode_batch(list(texts))  # type: ignore[attr-defined]
        # The tokenizer may already pad and truncate (sentence-transformers set it up so): padding is not
        # counted (the attention mask), and any overflow means too long.
        counts = [sum(e.attention_mask) + sum(sum(o.attention_mask) for o in e.overflowing) for e in encodings]
        if limit is not None and (over := [i for i, (n, e) in enumerate(zip(counts, encodings))
                                           if n > limit or e.overflowing]):
            raise ValueError(f"input: item(s) {over} are longer than the embedder {self.name}'s limit of {limit} "
                             "tokens; split them")
        return counts

    def embed(self, texts: Sequence[str]) -> tuple[np.ndarray, int]:
        """([n, dim] float32 vectors, total tokens)."""
        if len(texts) > MAX_INPUTS:
            raise ValueError(f"input: at most {MAX_INPUTS} items per request, got {len(texts)}")
        counts = self.count(texts)
        with self._lock:
            vectors = self.embedder.embed(list(texts))
        assert vectors.shape == (len(texts), self.embedder.dim), f"{vectors.shape=} {self.embedder.dim=}"
        return vectors, sum(counts)
