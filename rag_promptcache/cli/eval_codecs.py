"""`rag-promptcache eval --codec`: each KV codec's answers against the same modules in fp16, written as plain
`eval` writes a recovery's (cli/eval_format.py): counts beside every share, kept's 95% interval, the warning
where fp16 answered few right, no recommendation where too few did (`rag.fidelity.too_few`), and each failing
question once, fp16's answer with every codec's that fails it. Parsing and printing only; the work is in
`rag_promptcache.rag.codec_eval`."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from rag_promptcache.cli.app import SHOWN_CODECS, check_name, fail
from rag_promptcache.cli.eval_format import (few, few_warning, interval_text, kept_text, miss_text, no_recommendation,
                                             rests_on, retained_text, summary_line)


def eval_codecs(questions: Path, corpus: Path, k: int, codec: str, specs: list[str], max_new_tokens: int,
                apply: bool, as_json: bool, redis_url: str | None, dtype: str | None, adapter: str) -> None:
    """Each codec's answers against fp16 modules', and the smallest that keeps them."""
    codecs = [c.strip() for c in codec.split(",") if c.strip()]
    if not codecs:
        raise fail("--codec names no codec")
    for c in codecs:
        check_name("codec", c, SHOWN_CODECS, "valid codecs")
    if len(specs) > 1:
        raise fail(f"--codec compares codecs under one recovery; --recovery names {len(specs)}: {', '.join(specs)}")
    if apply:
        raise fail("--apply sets a recovery; a corpus's codec is set when it is built: ingest into a new corpus with --codec")
    from rag_promptcache.engine.planning.recovery import Recovery
    from rag_promptcache.rag import Corpus
    from rag_promptcache.rag.codec_eval import REFERENCE_CODEC, REFERENCE_WHOSE, evaluate_codecs, recommend_codec
    from rag_promptcache.rag.fidelity import RULE, read_questions
    from rag_promptcache.store import check_codec

    codecs = [check_codec(c) for c in codecs]
    qs = read_questions(questions)
    c = Corpus.open(corpus, redis_url=redis_url, dtype=dtype, adapter=adapter)
    try:
        rec = str(Recovery.parse(specs[0])) if specs else str(c.prepare().recovery)
        reports = evaluate_codecs(c, qs, codecs, rec, k=k, max_new_tokens=max_new_tokens)
    finally:
        c.close()
    best = recommend_codec(reports)
    target = f"keeps {RULE} against {REFERENCE_WHOSE}"
    rule = f"the fewest bytes per token that {target}"
    reference = reports[0].report
    others = [r for r in reports if r.codec != REFERENCE_CODEC]
    why_none = None if best is not None else no_recommendation(
        reference, max((r.report for r in others), key=lambda r: (r.kept or 0.0, r.retained or 0.0), default=None),
        target, "codec", REFERENCE_WHOSE, hint="Keep fp16, or try another codec or a recovery that recomputes more "
                                               "(--recovery).")
    if as_json:
        typer.echo(json.dumps({"corpus": str(corpus), "k": k, "recovery": rec, "rule": rule,
                               "few_answers": few(reference),
                               "recommended": None if best is None else best.codec, "no_recommendation": why_none,
                               # fp16 first: the reference, its failures are its own wrong answers
                               "codecs": [{**r.as_dict(), "failures": [f.as_dict() for f in r.report.failures]}
                                          for r in reports],
                               "fp16_wrong": [{"question": f.question, "expected": list(f.expected or ()), "fp16": f.full}
                                              for f in reference.results if f.full_right is False]}))
        return
    answered = reference.num_with_answer
    typer.echo(summary_line(len(qs), k, reference, f"{REFERENCE_WHOSE} answer", f", recovery {rec}"))
    typer.echo(f"{'codec':<10} {'bytes/token':>11} {'right':>7} {'kept':>11} {'95% interval':>13} {'retained':>9} "
               f"{'agreement':>10}")
    for r in reports:
        s = r.report
        right = f"{s.cached_correct}/{answered}" if answered else "n/a"
        if r.codec == REFERENCE_CODEC:  # the reference itself: its right answers are what the others keep
            typer.echo(f"{r.codec:<10} {r.bytes_per_token:>11.0f} {right:>7} {'(reference)':>11}")
            continue
        agree = f"{sum(x.agrees for x in s.results)}/{s.num_questions}"
        typer.echo(f"{r.codec:<10} {r.bytes_per_token:>11.0f} {right:>7} {kept_text(s):>11} {interval_text(s):>13} "
                   f"{retained_text(s):>9} {agree:>10}")
    typer.echo(f"kept: of {REFERENCE_WHOSE}' right answers, how many the codec also gets right; retained: codec right "
               f"/ {REFERENCE_CODEC} right")
    if (warning := few_warning(reference, REFERENCE_WHOSE)) is not None:
        typer.echo(f"\n{warning}")
    if best is None:
        typer.echo(f"\n{why_none}")
    else:
        typer.echo(f"\nrecommended: {best.codec} ({rule}): {best.bytes_per_token:.0f} bytes per token, it keeps "
                   f"{kept_text(best.report)} (95% interval {interval_text(best.report)}). "
                   f"{rests_on(best.report, REFERENCE_WHOSE)}. A new corpus takes it with `ingest --codec {best.codec}`")
    # each question once: fp16's answer, then every codec's that fails it (one block, not one per codec)
    failing = [i for i, f in enumerate(reference.results)
               if f.full_right is False or any(r.report.results[i].failed for r in others)]
    if failing:
        typer.echo(f"\n{len(failing)} question(s) where a codec fails or {REFERENCE_WHOSE} answer wrong "
                   "(check the expected answers where they do)")
        for i in failing:
            f = reference.results[i]
            lines = [(REFERENCE_CODEC, f.full + (" (wrong)" if f.full_right is False else ""))]
            lines += [(r.codec, r.report.results[i].cached) for r in others if r.report.results[i].failed]
            typer.echo(miss_text(f, lines))
