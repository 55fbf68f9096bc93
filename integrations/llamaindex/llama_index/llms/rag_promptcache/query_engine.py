"""`PromptCacheQueryEngine`: a `RetrieverQueryEngine` over a corpus whose response synthesizer hands
the retrieved nodes' module ids (with their text, as a fallback) to `PromptCacheLLM`, instead of
pasting their text into a prompt. `Response.metadata` holds the sources' metadata and the engine's
statistics under the names the LangChain adapter uses (`ttft_s`, `cached_tokens`, `path`, ...);
with nothing retrieved (every chunk below the retriever's `min_score`) the answer is "Not found in the
documents." without generating. Translation only."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llama_index.core.base.response.schema import Response
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.response_synthesizers import BaseSynthesizer
from llama_index.core.schema import MetadataMode, NodeWithScore
from rag_promptcache.engine.result import fixed_stream
from rag_promptcache.rag.prompts import result_stats
from rag_promptcache.rag.retrieval import NOT_FOUND

from llama_index.llms.rag_promptcache.base import PromptCacheLLM


def _refs(nodes: Sequence[NodeWithScore]) -> list[tuple[str, str]]:
    return [(n.node.node_id, n.node.get_content(metadata_mode=MetadataMode.NONE)) for n in nodes]


class ModuleSynthesizer(BaseSynthesizer):
    """The question is the user turn; the nodes become module imports (a node the corpus lacks: its text)."""

    def _get_prompts(self) -> dict[str, Any]:
        return {}

    def _update_prompts(self, prompts: dict[str, Any]) -> None:
        pass

    _stats: dict[str, Any] = {}  # the last non-streaming answer's, for `Response.metadata`

    def synthesize(self, query: Any, nodes: list[NodeWithScore], additional_source_nodes: Any = None, **kwargs: Any) -> Any:
        if not nodes:
            return _not_found()
        return self._with_stats(super().synthesize(query, nodes, additional_source_nodes, module_ids=_refs(nodes), **kwargs))

    async def asynthesize(self, query: Any, nodes: list[NodeWithScore], additional_source_nodes: Any = None, **kwargs: Any) -> Any:
        if not nodes:
            return _not_found()
        response = await super().asynthesize(query, nodes, additional_source_nodes, module_ids=_refs(nodes), **kwargs)
        return self._with_stats(response)

    def _with_stats(self, response: Any) -> Any:
        if isinstance(response, Response):
            response.metadata = {**(response.metadata or {}), **self._stats}
        return response

    def get_response(self, query_str: str, text_chunks: Sequence[str], module_ids: Sequence[Any] = (), **kwargs: Any) -> Any:
        if self._streaming:
            return (r.delta for r in self._llm.stream_complete(query_str, module_ids=module_ids, **kwargs) if r.delta)
        done = self._llm.complete(query_str, module_ids=module_ids, **kwargs)
        self._stats = dict(done.raw or {})
        return done.text

    async def aget_response(self, query_str: str, text_chunks: Sequence[str], module_ids: Sequence[Any] = (), **kwargs: Any) -> Any:
        if self._streaming:
            responses = await self._llm.astream_complete(query_str, module_ids=module_ids, **kwargs)
            return (r.delta async for r in responses if r.delta)
        done = await self._llm.acomplete(query_str, module_ids=module_ids, **kwargs)
        self._stats = dict(done.raw or {})
        return done.text


def _not_found() -> Response:
    return Response(NOT_FOUND, source_nodes=[], metadata=result_stats(fixed_stream(NOT_FOUND).consume()))


class PromptCacheQueryEngine(RetrieverQueryEngine):
    """`PromptCacheQueryEngine(corpus=corpus, similarity_top_k=4, streaming=False, min_score=None, filters=None)`;
    `filters`: LlamaIndex's `MetadataFilters`, applied inside retrieval (the retriever's); `llm=` to reuse one."""

    def __init__(self, corpus: Any, similarity_top_k: int = 4, streaming: bool = False,
                 llm: PromptCacheLLM | None = None, min_score: float | None = None, filters: Any = None,
                 **llm_kwargs: Any) -> None:
        from llama_index.retrievers.rag_promptcache import PromptCacheRetriever

        llm = llm or PromptCacheLLM(corpus=corpus, **llm_kwargs)
        super().__init__(retriever=PromptCacheRetriever(corpus, similarity_top_k=similarity_top_k, min_score=min_score,
                                                        filters=filters),
                         response_synthesizer=ModuleSynthesizer(llm=llm, streaming=streaming))
