"""`PromptCacheQueryEngine`: a `RetrieverQueryEngine` over a corpus whose response synthesizer hands
the retrieved nodes' module ids (with their text, as a fallback) to `PromptCacheLLM`, instead of
pasting their text into a prompt. Translation only."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.response_synthesizers import BaseSynthesizer
from llama_index.core.schema import MetadataMode, NodeWithScore

from llama_index.llms.rag_promptcache.base import PromptCacheLLM


def _refs(nodes: Sequence[NodeWithScore]) -> list[tuple[str, str]]:
    return [(n.node.node_id, n.node.get_content(metadata_mode=MetadataMode.NONE)) for n in nodes]


class ModuleSynthesizer(BaseSynthesizer):
    """The question is the user turn; the nodes become module imports (a node the corpus lacks: its text)."""

    def _get_prompts(self) -> dict[str, Any]:
        return {}

    def _update_prompts(self, prompts: dict[str, Any]) -> None:
        pass

    def synthesize(self, query: Any, nodes: list[NodeWithScore], additional_source_nodes: Any = None, **kwargs: Any) -> Any:
        return super().synthesize(query, nodes, additional_source_nodes, module_ids=_refs(nodes), **kwargs)

    async def asynthesize(self, query: Any, nodes: list[NodeWithScore], additional_source_nodes: Any = None, **kwargs: Any) -> Any:
        return await super().asynthesize(query, nodes, additional_source_nodes, module_ids=_refs(nodes), **kwargs)

    def get_response(self, query_str: str, text_chunks: Sequence[str], module_ids: Sequence[Any] = (), **kwargs: Any) -> Any:
        if self._streaming:
            return (r.delta for r in self._llm.stream_complete(query_str, module_ids=module_ids, **kwargs) if r.delta)
        return self._llm.complete(query_str, module_ids=module_ids, **kwargs).text

    async def aget_response(self, query_str: str, text_chunks: Sequence[str], module_ids: Sequence[Any] = (), **kwargs: Any) -> Any:
        if self._streaming:
            responses = await self._llm.astream_complete(query_str, module_ids=module_ids, **kwargs)
            return (r.delta async for r in responses if r.delta)
        return (await self._llm.acomplete(query_str, module_ids=module_ids, **kwargs)).text


class PromptCacheQueryEngine(RetrieverQueryEngine):
    """`PromptCacheQueryEngine(corpus=corpus, similarity_top_k=4, streaming=False)`; `llm=` to reuse one."""

    def __init__(self, corpus: Any, similarity_top_k: int = 4, streaming: bool = False,
                 llm: PromptCacheLLM | None = None, **llm_kwargs: Any) -> None:
        from llama_index.retrievers.rag_promptcache import PromptCacheRetriever

        llm = llm or PromptCacheLLM(corpus=corpus, **llm_kwargs)
        super().__init__(retriever=PromptCacheRetriever(corpus, similarity_top_k=similarity_top_k),
                         response_synthesizer=ModuleSynthesizer(llm=llm, streaming=streaming))
