"""The tiny corpus as LangChain documents, made once per test session with the process's one engine
(tests/adapter_shared.py); a module, because langchain-tests' standard suites take constructor params
from properties, where fixtures cannot reach."""

from __future__ import annotations

import functools

from tests.adapter_shared import FACTS, build_corpus, engine

__all__ = ["corpus", "engine"]


@functools.cache
def corpus():
    from langchain_core.documents import Document

    return build_corpus([Document(page_content=t, metadata={"source": f"fact{i}.txt"}) for i, t in enumerate(FACTS)],
                        "lc-corpus-")
