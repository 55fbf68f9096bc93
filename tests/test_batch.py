"""Batched decoding against one-at-a-time decoding: the bookkeeping (no tensors), next-token logits at
every step with rows joining and leaving (tiny random llama, fp32), and the same greedy text with
SmolLM2 through the scheduler thread."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from rag_promptcache.engine import PromptCache
from rag_promptcache.engine.batching.batch import BatchCache, decode_step
from rag_promptcache.engine.batching.batcher import Cancelled
from rag_promptcache.engine.compute.runner import forward_last, lean_forward
from rag_promptcache.engine.batching.scheduler import Move, QueueFull, Rows
from rag_promptcache.store import MemoryStore
from tests.tiny import build

TOL = 1e-4  # fp32: the batched matmuls round differently from batch-1 ones; masked slots add exactly 0

SCHEMA = """<schema name="s">
  <module name="a">The quick brown fox jumps over the lazy dog near the river bank.</module>
  <module name="b">Paris is the capital of France, and the Seine runs through it.</module>
  <module name="c">Tokyo has great food and a very large subway network.</module>
</schema>"""
# two real documents for the SmolLM2 tests (test_lookup's too)
DOCS = ('<schema name="doc"><module name="eiffel">The Eiffel Tower in Paris was completed in 1889 '
        'as the entrance arch to the World\'s Fair. It is 330 metres tall.</module>'
        '<module name="moon">Apollo 11 landed on the Moon in July 1969; Neil Armstrong stepped out first.</module>'
        '</schema>')
PROMPTS = [
    '<prompt schema="s"><a/><b/><user>What is the capital?</user></prompt>',
    '<prompt schema="s"><c/><user>Tell me about the food in that city, in detail please.</user></prompt>',
    "A plain prompt with no modules at all.",
    '<prompt schema="s"><b/><c/><a/><user>Which animal?</user></prompt>',
]


# -- bookkeeping ------------------------------------------------------------------------------------

def test_rows_admit_in_order_stay_packed_and_bound_the_queue():
    rows = Rows(max_batch=2, max_queue=1)
    for r in "abc":
        rows.submit(r)
    with pytest.raises(QueueFull, match="max_queue=1"):
        rows.submit("d")  # 2 rows + 1 waiting
    assert rows.has_room() and rows.next_waiting() == "a"
    assert rows.has_room() and rows.next_waiting() == "b"  # both prefilling: they hold the rows
    assert not rows.has_room() and rows.join("a") == 0 and rows.join("b") == 1
    with pytest.raises(QueueFull):
        rows.submit("d")
    assert not rows.has_room() and rows.num_waiting == 1 and rows.running == ("a", "b")
    assert rows.leave("a") == Move("b", 1, 0)  # the last row fills the hole
    assert rows.running == ("b",) and rows.join(rows.next_waiting()) == 1
    assert rows.leave("c") is None and rows.running == ("b",)
    rows.submit("f")
    assert rows.next_waiting() == "f" and rows.leave("f") is None  # failed in its prefill
    assert rows.running == ("b",) and rows.has_room() is False and rows.num_waiting == 0
    rows.submit("e")
    assert rows.leave("e") is None and rows.num_waiting == 0  # cancelled while waiting
    with pytest.raises(ValueError, match="max_batch"):
        Rows(0, 1)


# -- logits at every step, rows joining and leaving -------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tokenizer, device):
    # no prefix cache: these tests hold a batched request to the same prompt run alone, counts included,
    # and the second of two equal prompts would reuse the first's KV (tests/test_prefix_cache.py); the cached
    # path always (fallback "never"): under load the timed cost model chose full prefill for one of two equal
    # prefills and cached for the other, and their logits differ in the last bits (tests/conftest.py)
    pc = PromptCache(build("llama", device, vocab_size=len(tokenizer)), tokenizer, store=MemoryStore(), recovery="none",
                     prefix_cache_bytes=0, fallback="never")
    pc.add_schema(SCHEMA)
    return pc


def _reference(pc: PromptCache, prompt: str, steps: int) -> tuple[list[int], list[torch.Tensor], int]:
    """The one-at-a-time path: greedy tokens and the logits before each of them."""
    first = pc.prefill(pc.plan(prompt), steps)
    cache, logits, position = first.cache, first.logits, first.next_position
    tokens, seen = [], [logits]
    for i in range(steps):
        tokens.append(int(logits.argmax()))
        dev = pc.model.device
        logits = forward_last(pc.model, torch.tensor([[tokens[-1]]], device=dev), torch.tensor([[position + i]], device=dev),
                              cache)
        seen.append(logits)
    return tokens, seen, position


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
def test_batched_step_logits_match_alone_with_rows_joining_and_leaving(tiny, lean):
    pc = tiny
    assert lean_forward(pc.model) is not None  # a Llama: both batched steps exist
    steps = [6, 3, 8, 4]
    refs = [_reference(pc, p, n) for p, n in zip(PROMPTS, steps)]
    batch = BatchCache(pc.model.config, pc.geometry, 3, 8, pc.model.dtype, pc.model.device)  # grows
    rows = Rows(3, 4)
    done = {i: 0 for i in range(4)}  # tokens fed per request
    joins = {0: [0, 1], 2: [2], 5: [3]}  # step → requests joining then
    for t in range(12):
        for i in joins.get(t, []):
            rows.submit(i)
            while rows.has_room():
                j = rows.next_waiting()
                first = pc.prefill(pc.plan(PROMPTS[j]))
                cache, logits = first.cache, first.logits
                assert torch.equal(logits, refs[j][1][0])
                batch.load(rows.join(j), cache)
        running = rows.running
        if not running:
            break
        ids = [refs[i][0][done[i]] for i in running]
        pos = [refs[i][2] + done[i] for i in running]
        logits = decode_step(pc.model, batch, ids, pos, lean=lean)
        for r, i in enumerate(running):
            done[i] += 1
            diff = float((logits[r] - refs[i][1][done[i]]).abs().max())
            assert diff < TOL, f"request {i} step {done[i]}: {diff=}"
            if done[i] == steps[i]:
                move = rows.leave(i)
                if move is not None:
                    batch.move(move.src, move.dst)
    assert done == dict(enumerate(steps))
    assert batch.capacity > 8  # it grew past its first allocation


def test_generate_batch_equals_generate_and_scheduler_admits_mid_way(tiny):
    pc = tiny
    for p in PROMPTS:  # every module stored before the runs compared: a miss stored meanwhile changes the counts
        pc.generate(p, max_new_tokens=1)
    assert pc.background.wait_done(timeout=120)
    alone = [pc.generate(p, max_new_tokens=n) for p, n in zip(PROMPTS, [5, 9, 3, 7])]
    together = pc.generate_batch(PROMPTS, max_new_tokens=9, max_batch=2)
    assert [r.token_ids for r in together][1] == alone[1].token_ids
    for a, b in zip(alone, together):
        assert b.token_ids[: len(a.token_ids)] == a.token_ids
        assert (b.prompt_tokens, b.cached_tokens) == (a.prompt_tokens, a.cached_tokens)
    with pc.scheduler(max_batch=4) as s:
        first = s.submit(PROMPTS[0], max_new_tokens=30, ignore_eos=True)
        it = iter(first)
        next(it)  # running: the next ones join a running batch
        late = [s.submit(p, max_new_tokens=n) for p, n in zip(PROMPTS[1:], [9, 3, 7])]
        assert [h.consume().token_ids for h in late] == [a.token_ids for a in alone[1:]]
        assert first.consume().num_generated == 30 and first.result.finish_reason == "length"


def test_cancel_frees_the_row_and_bad_input_raises_at_submit(tiny):
    pc = tiny
    with pc.scheduler(max_batch=1, max_queue=1) as s:
        h = s.submit(PROMPTS[0], max_new_tokens=500, ignore_eos=True)
        next(iter(h))
        queued = s.submit(PROMPTS[1], max_new_tokens=2)
        with pytest.raises(QueueFull):
            s.submit(PROMPTS[2], max_new_tokens=2)
        h.cancel()
        with pytest.raises(Cancelled):
            h.consume()
        assert queued.consume().num_generated >= 1  # it got the freed row
        assert s.num_running == 0 and s.num_waiting == 0
        with pytest.raises(ValueError, match="context window"):
            s.submit(PROMPTS[0], max_new_tokens=5000)
        with pytest.raises(ValueError, match="max_new_tokens"):
            s.submit(PROMPTS[0], max_new_tokens=0)


def test_a_request_that_fails_inside_the_batch_fails_alone(tiny):
    """A request whose own code fails in the batcher's thread (its `stop_when` raises on the third
    token): it fails with that error, while the rows decoding beside it finish their answers."""
    pc = tiny
    alone = [pc.generate(PROMPTS[i], max_new_tokens=12, ignore_eos=True) for i in (0, 2)]

    def fails(text: str, final: bool) -> tuple[int | None, int]:
        if len(text) > 8:
            raise RuntimeError("stop_when failed")
        return None, 0

    with pc.scheduler(max_batch=4) as s:
        running = s.submit(PROMPTS[0], max_new_tokens=12, ignore_eos=True)
        next(iter(running))  # decoding when the failing one arrives
        broken = s.submit(PROMPTS[1], max_new_tokens=12, ignore_eos=True, stop_when=fails)
        after = s.submit(PROMPTS[2], max_new_tokens=12, ignore_eos=True)
        with pytest.raises(RuntimeError, match="stop_when failed"):
            broken.consume()
        assert [running.consume().token_ids, after.consume().token_ids] == [a.token_ids for a in alone]
        assert s.num_running == 0 and s.num_waiting == 0
        assert s.submit(PROMPTS[2], max_new_tokens=12, ignore_eos=True).consume().token_ids == alone[1].token_ids


def test_async_iteration_and_threads(tiny):
    pc = tiny
    alone = pc.generate(PROMPTS[0], max_new_tokens=6)
    with pc.scheduler(max_batch=4) as s:
        async def run():
            h = s.submit(PROMPTS[0], max_new_tokens=6)
            pieces = [p async for p in h]
            return "".join(pieces), h.result

        text, result = asyncio.run(run())
        assert text == result.text == alone.text and result.token_ids == alone.token_ids
        out: list = [None] * 3
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, s.submit(PROMPTS[i], max_new_tokens=6).consume()))
                   for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert out[0].token_ids == alone.token_ids


# -- real text -----------------------------------------------------------------------------------------

@pytest.mark.smollm
def test_smollm2_greedy_text_is_the_same_in_a_batch(smollm):
    model, tokenizer = smollm
    pc = PromptCache(model, tokenizer, store=MemoryStore())
    pc.add_schema(DOCS)
    prompts = ['<prompt schema="doc"><eiffel/><user>When was the Eiffel Tower completed?</user></prompt>',
               '<prompt schema="doc"><moon/><user>Who walked on the Moon first?</user></prompt>',
               '<prompt schema="doc"><eiffel/><moon/><user>How tall is the Eiffel Tower?</user></prompt>',
               "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"]
    alone = [pc.generate(p, max_new_tokens=20) for p in prompts]
    together = pc.generate_batch(prompts, max_new_tokens=20)
    assert [r.text for r in together] == [r.text for r in alone]
    assert "1889" in together[0].text
