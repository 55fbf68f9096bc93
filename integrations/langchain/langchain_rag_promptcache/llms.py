"""`PromptCacheLLM`: a LangChain `BaseLLM` (drop-in for `HuggingFacePipeline`) on a `PromptCache` engine.

A prompt is PML (`<prompt schema=…>`), text holding `format_modules` references (imported from the
corpus; the rest is the user turn), or plain text (the user turn of the model's chat template when
it has one, else generated as is). Translation only."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from pydantic import AliasChoices, ConfigDict, Field, model_validator

from rag_promptcache.rag.prompts import ANSWER_DEFAULTS, build_prompt, generation_options, result_stats, wants_chat

from langchain_rag_promptcache.modules import engine_of


class PromptCacheLLM(BaseLLM):
    """`PromptCacheLLM(corpus=Corpus.open(dir))` or `PromptCacheLLM(engine=PromptCache.from_pretrained(…))`."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")  # a misspelt option is an error

    corpus: Any = None
    engine: Any = None
    model_name: str = ""
    # `ask`'s answer defaults, one record (rag.repetition.AnswerDefaults): the length is the knob to turn
    max_tokens: int = Field(default=ANSWER_DEFAULTS.max_new_tokens, gt=0,
                            validation_alias=AliasChoices("max_tokens", "max_new_tokens"))
    temperature: float = ANSWER_DEFAULTS.temperature
    no_repeat_ngram: int = Field(default=ANSWER_DEFAULTS.no_repeat_ngram, ge=0)  # zero turns it off
    stop_repeats: bool = ANSWER_DEFAULTS.stop_repeats  # end the answer before a sentence it repeats
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] | None = None

    @model_validator(mode="after")
    def _bind(self) -> PromptCacheLLM:
        self.engine = engine_of(self.corpus, self.engine)
        self.model_name = self.model_name or self.engine.model_name
        return self

    @property
    def _llm_type(self) -> str:
        return "rag-promptcache"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "max_tokens": self.max_tokens, "temperature": self.temperature}

    def _args(self, prompt: str, stop: list[str] | None, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError("empty prompt")
        engine_prompt = build_prompt([("user", prompt)], corpus=self.corpus, chat=wants_chat(self.engine, prompt))
        defaults = {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                    "top_k": self.top_k, "seed": self.seed, "stop": self.stop,
                    "no_repeat_ngram": self.no_repeat_ngram, "stop_repeats": self.stop_repeats}
        return engine_prompt, generation_options(defaults, {**kwargs, "stop": stop})

    def _generate(self, prompts: list[str], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> LLMResult:
        generations = []
        for prompt in prompts:
            if run_manager is not None:  # stream so callbacks get tokens
                chunks = list(self._stream(prompt, stop, run_manager, **kwargs))
                text, info = "".join(c.text for c in chunks), chunks[-1].generation_info
            else:
                engine_prompt, options = self._args(prompt, stop, kwargs)
                result = self.engine.generate(engine_prompt, **options)
                text, info = result.text, result_stats(result)
            generations.append([Generation(text=text, generation_info=info)])
        return LLMResult(generations=generations, llm_output={"model_name": self.model_name})

    async def _agenerate(self, prompts: list[str], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> LLMResult:
        generations = []
        for prompt in prompts:
            chunks = [c async for c in self._astream(prompt, stop, run_manager, **kwargs)]
            generations.append([Generation(text="".join(c.text for c in chunks), generation_info=chunks[-1].generation_info)])
        return LLMResult(generations=generations, llm_output={"model_name": self.model_name})

    def _stream(self, prompt: str, stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[GenerationChunk]:
        engine_prompt, options = self._args(prompt, stop, kwargs)
        stream = self.engine.stream(engine_prompt, **options)
        for piece in stream:
            chunk = GenerationChunk(text=piece)
            if run_manager is not None:
                run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        yield GenerationChunk(text="", generation_info=result_stats(stream.result))

    async def _astream(self, prompt: str, stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> AsyncIterator[GenerationChunk]:
        engine_prompt, options = self._args(prompt, stop, kwargs)
        stream = self.engine.astream(engine_prompt, **options)
        async for piece in stream:
            chunk = GenerationChunk(text=piece)
            if run_manager is not None:
                await run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        yield GenerationChunk(text="", generation_info=result_stats(stream.result))
