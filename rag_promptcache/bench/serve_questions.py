"""The questions the serve scenario (bench/serve.py) sends over the demo corpus (rag/sample.py's topics).

`WARM` warms the server (its code paths, the modules those questions retrieve) and is never timed.
`TIMED` is a pool each timed leg takes fresh questions from (`legs`), so no timed request repeats an
earlier one: an exact repeat decodes from the prefix cache with no prefill at all, which is a row of
its own in the scenario, not what a server receiving new questions does. No question of one list
is in the other.

Not here: the timing (serve.py), the corpus (rag/sample.py).
"""

from __future__ import annotations

from collections.abc import Sequence

WARM = (
    "What does the pass statement do?",
    "What is a context manager?",
    "How are default parameter values evaluated?",
    "What is the difference between a list display and a list comprehension?",
    "Which objects are considered true?",
    "How does a class definition create a class object?",
    "What does the async with statement do?",
    "How does an if statement pick which suite to execute?",
)

TIMED = (
    "What does the yield statement do inside a function?",
    "How do break and continue behave inside a for loop?",
    "What happens when an exception is raised inside a try statement with an except clause?",
    "When is the else clause of a while loop executed?",
    "How does the with statement call __enter__ and __exit__?",
    "What does the global statement declare?",
    "How is a nonlocal name resolved?",
    "What does the del statement do to a name?",
    "What does a lambda expression create?",
    "What does the return statement do in a generator?",
    "How does the raise statement set the exception's cause?",
    "When does an assert statement do nothing?",
    "How are the keys of a dictionary display evaluated?",
    "What values are considered false in a truth value test?",
    "How does the import statement find a module?",
    "What does the in operator test for a string?",
    "How does a for statement iterate over a sequence?",
    "What does continue do in a while loop?",
    "Where may a break statement appear?",
    "When does the finally clause of a try statement run?",
    "What happens to an exception that no handler catches?",
    "How does the and operator decide its result?",
    "What does the or operator return?",
    "What does the not operator return?",
    "How is a slice with a step written?",
    "What does an extended slicing select?",
    "How does a list display build a new list?",
    "What happens when a dictionary display repeats a key?",
    "How are decorators applied to a function definition?",
    "When are the default arguments of a function evaluated?",
    "What does a return statement without an expression return?",
    "What does yield from do?",
    "How are base classes listed in a class definition?",
    "What does a class decorator receive?",
    "What does from import star import?",
    "How is a relative import written?",
    "Can a name be declared global after it is used in the same block?",
    "What does del do to a list slice?",
    "What is a coroutine function?",
    "What does await do?",
    "How does async for iterate?",
    "What does the with statement do when the block raises an exception?",
    "Which methods must a context manager define?",
    "How does the in operator work for a dictionary?",
    "What does the else clause of a try statement do?",
    "Why can the body of a lambda not contain statements?",
    "What is an exception handler?",
    "What does an elif clause do?",
    "What does the else clause of a for loop do?",
    "How does a while statement decide when to stop?",
    "What does raise with no expression do?",
    "How can a comparison be chained?",
)


def legs(sizes: Sequence[int], pool: Sequence[str] = TIMED) -> list[tuple[str, ...]]:
    """Consecutive, disjoint slices of `pool`, one of each size in `sizes`; ValueError when the pool is
    too small (more clients or repeats than the pool has new questions)."""
    if sum(sizes) > len(pool):
        raise ValueError(f"{sum(sizes)} timed requests need as many new questions; the pool has {len(pool)}: "
                         "fewer levels or repeats")
    out, at = [], 0
    for n in sizes:
        out.append(tuple(pool[at : at + n]))
        at += n
    return out
