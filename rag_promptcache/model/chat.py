"""Chat-template role markup: the fixed text a model's chat template puts around each message.

The engine compiles PML `<system>`, `<user>` and `<assistant>` tags into plain text, so it needs
the template as strings, not as a Jinja program. `role_markup` renders a conversation with
sentinel contents through the tokenizer's own template, slices the text between the sentinels,
and keeps the result only if re-assembling the pieces reproduces `apply_chat_template` exactly
for several conversations.

BOS: a template that writes `{{ bos_token }}` has it in `prefix` (as text, which tokenizes to the
BOS id); a tokenizer whose post-processor adds BOS does not add it here, because
`apply_chat_template(..., tokenize=True)` tokenizes without special tokens. The compiler therefore
tokenizes chat text without adding BOS, so a Llama-3 or Mistral style tokenizer gets exactly one.

A default system prompt that a template injects when the first message is not a system message
(SmolLM2 and Qwen2 do) is detected and kept in `default_system`; `render` puts it after `prefix`
for such conversations, as the template does.

What it deliberately does not model:
- other text a template injects only in some conversations.
- templates that cannot put a system message in a turn of its own (Gemma rejects or merges it):
  there a system message is rendered as a user turn.
- per-message rewriting beyond trimming whitespace (`trims_content`).
A template that cannot be expressed as fixed strings falls back to plain "User: " style markers,
with `from_template=False`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from jinja2 import TemplateError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ROLES = ("system", "user", "assistant")
Message = tuple[str, str]  # (role, content)

# Sentinels: plain words without whitespace, none a substring of another.
_S, _U, _A, _V = "SYSTEMSENTINEL", "USERSENTINEL", "ASSISTANTSENTINEL", "QUESTIONSENTINEL"

_CHECK_CONVERSATIONS: tuple[tuple[Message, ...], ...] = (
    (("system", "You are terse."), ("user", "Hi there, who are you?")),
    (("system", "Answer in French."), ("user", "What is 2+2?"), ("assistant", "Quatre."), ("user", "And 3+3?")),
    (("system", "Be kind."), ("user", "One"), ("assistant", "Two"), ("user", "Three"),
     ("assistant", "Four"), ("user", "Five?")),
)
_PADDED: tuple[Message, ...] = (
    ("system", " padded system\n"), ("user", "\n padded user "), ("assistant", " a "), ("user", " q\n"),
)


@dataclass(frozen=True, slots=True)
class RoleMarkup:
    """Text around messages: `prefix`, then per message `open[role] + content + close[role]`,
    then `generation_prompt` when the model is to answer. `prefix` is what the template renders
    before the first message (a BOS token for some templates, empty for others); tokenize the
    assembled text without adding special tokens again."""

    prefix: str
    open: dict[str, str]
    close: dict[str, str]
    generation_prompt: str
    from_template: bool = True
    trims_content: bool = False  # the template strips whitespace around each message's content
    default_system: str = ""  # a whole system turn the template adds when the first message is not one


PLAIN_MARKUP = RoleMarkup(
    prefix="",
    open={"system": "System: ", "user": "User: ", "assistant": "Assistant: "},
    close={"system": "\n\n", "user": "\n\n", "assistant": "\n\n"},
    generation_prompt="Assistant: ",
    from_template=False,
)


def render(markup: RoleMarkup, messages: Sequence[Message], add_generation_prompt: bool) -> str:
    """Assemble a conversation with `markup`; equals the template's output where it is verified."""
    parts = [markup.prefix]
    if messages and messages[0][0] != "system":
        parts.append(markup.default_system)
    for role, content in messages:
        if role not in markup.open:
            raise ValueError(f"unknown chat role {role!r}; valid roles: {sorted(markup.open)}")
        parts += [markup.open[role], content.strip() if markup.trims_content else content, markup.close[role]]
    if add_generation_prompt:
        parts.append(markup.generation_prompt)
    return "".join(parts)


def role_markup(tokenizer: PreTrainedTokenizerBase) -> RoleMarkup:
    """The tokenizer's chat template as fixed strings, verified by re-rendering; plain markers
    (`from_template=False`) when it has no template or the template is not expressible so."""
    if getattr(tokenizer, "chat_template", None):
        for with_system in (True, False):
            for candidate in _candidates(tokenizer, with_system):
                if _verified(tokenizer, candidate, with_system):
                    markup = _with_trimming(tokenizer, candidate, with_system)
                    return _with_default_system(tokenizer, markup) if with_system else markup
    bos = getattr(tokenizer, "bos_token", None)
    adds_bos = bos is not None and tokenizer("a")["input_ids"][:1] == [tokenizer.bos_token_id]
    if adds_bos:
        return RoleMarkup(bos, PLAIN_MARKUP.open, PLAIN_MARKUP.close, PLAIN_MARKUP.generation_prompt, False)
    return PLAIN_MARKUP


def _apply(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], add_generation_prompt: bool) -> str:
    chat = [{"role": role, "content": content} for role, content in messages]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert isinstance(text, str), f"{type(text)=}"
    return text


def _split(text: str, sentinels: Sequence[str]) -> list[str] | None:
    """The text before, between and after the sentinels, or None if they are not there once each in order."""
    pieces, rest = [], text
    for s in sentinels:
        if text.count(s) != 1 or s not in rest:
            return None
        before, rest = rest.split(s, 1)
        pieces.append(before)
    return [*pieces, rest]


def _candidates(tokenizer: PreTrainedTokenizerBase, with_system: bool) -> Iterator[RoleMarkup]:
    """Possible markups from the sentinel conversation, most plausible split first; the boundary
    between one message's close and the next one's open is not visible in a single rendering."""
    convo: list[Message] = [("user", _U), ("assistant", _A), ("user", _V)]
    if with_system:
        convo.insert(0, ("system", _S))
    try:
        t0, t1 = _apply(tokenizer, convo, False), _apply(tokenizer, convo, True)
    except (TemplateError, ValueError, TypeError):
        return  # e.g. "System role not supported"
    pieces = _split(t0, [c for _, c in convo])
    if pieces is None or not t1.startswith(t0):
        return
    if with_system:
        head, sys_to_user, user_to_asst, asst_to_user, tail = pieces
    else:
        head, user_to_asst, asst_to_user, tail = pieces
    generation_prompt = t1[len(t0):]
    close_user = tail
    if not user_to_asst.startswith(close_user):
        return
    open_asst = user_to_asst[len(close_user):]

    options = []
    if asst_to_user.startswith(close_user):  # every role closes the same way (most templates)
        options.append(asst_to_user[len(close_user):])
    for role_text in (open_asst, generation_prompt):
        for name in ("assistant", "model"):
            if name in role_text:
                options.append(role_text.replace(name, "user"))
    other = sys_to_user if with_system else head
    options += [asst_to_user[i:] for i in range(len(asst_to_user)) if other.endswith(asst_to_user[i:])]

    seen = set()
    for open_user in options:
        if open_user in seen or not asst_to_user.endswith(open_user) or not other.endswith(open_user):
            continue
        seen.add(open_user)
        close_asst = asst_to_user[: len(asst_to_user) - len(open_user)]
        if with_system:
            close_sys = sys_to_user[: len(sys_to_user) - len(open_user)]
            prefix, open_sys = _split_head(head, open_user)
        else:
            prefix, open_sys, close_sys = head[: len(head) - len(open_user)], open_user, close_user
        yield RoleMarkup(
            prefix=prefix,
            open={"system": open_sys, "user": open_user, "assistant": open_asst},
            close={"system": close_sys, "user": close_user, "assistant": close_asst},
            generation_prompt=generation_prompt,
        )


def _split_head(head: str, open_user: str) -> tuple[str, str]:
    """Split the text before the system message into (prefix, open["system"]): the system open is
    taken to look like the user open with the role name swapped (true of every common template)."""
    if "user" in open_user:
        i = head.find(open_user.replace("user", "system"))
        if i >= 0:
            return head[:i], head[i:]
    return "", head


def _verified(tokenizer: PreTrainedTokenizerBase, markup: RoleMarkup, with_system: bool) -> bool:
    for convo in _CHECK_CONVERSATIONS:
        msgs = convo if with_system else tuple(m for m in convo if m[0] != "system")
        for gen in (False, True):
            try:
                if _apply(tokenizer, msgs, gen) != render(markup, msgs, gen):
                    return False
            except (TemplateError, ValueError, TypeError):
                return False
    return True


def _with_trimming(tokenizer: PreTrainedTokenizerBase, markup: RoleMarkup, with_system: bool) -> RoleMarkup:
    """Detect templates that strip each message's content (Llama 3 does)."""
    msgs = _PADDED if with_system else tuple(m for m in _PADDED if m[0] != "system")
    try:
        text = _apply(tokenizer, msgs, True)
    except (TemplateError, ValueError, TypeError):
        return markup
    trimmed = replace(markup, trims_content=True)
    if text != render(markup, msgs, True) and text == render(trimmed, msgs, True):
        return trimmed
    return markup


def _with_default_system(tokenizer: PreTrainedTokenizerBase, markup: RoleMarkup) -> RoleMarkup:
    """Detect a system turn the template injects before a conversation that does not start with one;
    kept only if it reproduces the template for every check conversation without a system message."""
    msgs: tuple[Message, ...] = (("user", _U),)
    try:
        text = _apply(tokenizer, msgs, False)
    except (TemplateError, ValueError, TypeError):
        return markup
    plain = render(markup, msgs, False)
    body = plain[len(markup.prefix):]
    if text == plain or not text.startswith(markup.prefix) or not text.endswith(body):
        return markup
    candidate = replace(markup, default_system=text[len(markup.prefix): len(text) - len(body)])
    for convo in _CHECK_CONVERSATIONS:
        no_system = tuple(m for m in convo if m[0] != "system")
        for gen in (False, True):
            try:
                if _apply(tokenizer, no_system, gen) != render(candidate, no_system, gen):
                    return markup
            except (TemplateError, ValueError, TypeError):
                return markup
    return candidate
