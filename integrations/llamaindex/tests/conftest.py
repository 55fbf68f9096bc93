import pytest

from tests.adapter_shared import FACTS, asked, build_corpus, engine_fixture

__all__ = ["asked", "corpus", "engine_fixture"]  # the fixtures: engine, asked (tests/adapter_shared.py), corpus


@pytest.fixture(scope="session")
def corpus(engine):
    """Four of the facts as LlamaIndex nodes."""
    from llama_index.core.schema import TextNode

    return build_corpus([TextNode(text=t, metadata={"source": f"fact{i}.txt"}) for i, t in enumerate(FACTS[:4])],
                        "li-corpus-")
