"""Chat template + tokenization with exact segment boundaries.

The gateway owns tokenization so it knows where each retention segment starts::

    | system (leading system messages,  | context (earlier turns, tool   | turn (last user message |
    |  tool definitions, or the         |  results, documents)           |  + generation prompt)   |
    |  template's default one)          |                                |                         |
    0                              system_end                      context_end                  total

Boundaries come from rendering message-list prefixes with the model's own chat
template (each must be a text prefix of the full rendering, else the boundary falls
back to the previous one), and each segment's text is tokenized on its own. That
makes a segment's tokens a function of its text alone: the same system prompt always
yields the same token ids, so it always hits the same cached blocks.

For ``/v1/completions`` (a raw prompt, no roles) the whole prompt is context.

A dialect may also ask for *marks*: the token offset where the first ``k`` messages end
(Anthropic's ``cache_control`` breakpoints, ``server.gateway.api.messages_convert``). Each
mark is found the same way (the rendering of ``messages[:k]`` must be a text prefix of the
full rendering, else the mark falls back to the previous boundary) and becomes one more
cut between separately tokenized pieces. Cuts sit at message boundaries, where chat
templates put special tokens, so the token ids equal those of the same prompt without marks.

A :class:`TextMark` ends *inside* a message (the Messages path's tool breakpoints: the tools
open the system message, before its text). It is no cut: the piece holding it is tokenized
whole, as without it, and the mark is the number of that piece's leading tokens that the
marked text alone tokenizes to as well (the longest common prefix of the two id lists), so
it never covers a token that reaches past the marked text, and never changes an id::

    <|im_start|>system\n# Tools ... </tools> ... </tool_call>\n\nYou are terse.<|im_end|>\n
    |<------------ TextMark(0, len(tools text)) ---------->|
    |<------------------------- mark 1 (message 0 ends) --------------------------->|

When the template does not render the message's text verbatim (the marked text is then not
found in the rendering), the mark falls back to the end of its message (rounded up, as a
block inside a message is).

Control tokens come from the template alone. A client's text may hold a special token's text
(a user writing ``<|im_end|>\n<|im_start|>system``, a stop token in a tool result): it is plain
text, as on OpenAI's API, never a forged turn or an early end. The messages are rendered
shielded (:meth:`~engines.tokenizer.ChatTokenizer.shield_chat`: each such text replaced by a
placeholder) and every piece is tokenized by
:meth:`~engines.tokenizer.ChatTokenizer.encode_prompt`, which turns a placeholder into the
plain tokens of the text it stands for. Everything above (boundaries, marks, the prefix cache)
works on the shielded rendering; a :class:`TextMark` is moved to its place in the shielded
text. Messages without such text (the usual request) are not copied, and their pieces
tokenize exactly as ``encode`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from engines.tokenizer import ChatTokenizer
from server.gateway.api.logprobs import TokenTexts
from server.gateway.api.prefix_cache import PrefixTokens


@dataclass(frozen=True, slots=True)
class TextMark:
    """A mark after messages ``[:index]`` and the first ``chars`` characters of message ``index``'s content."""

    index: int
    chars: int


Mark = int | TextMark  # an int k: where the first k messages end


@dataclass(frozen=True, slots=True)
class PreparedPrompt:
    input_ids: tuple[int, ...]
    system_end: int
    context_end: int
    marks: tuple[int, ...] = ()  # token offsets of the asked marks (message ends, TextMarks), in the order asked


    @property
    def total(self) -> int:
        return len(self.input_ids)


def _last_user_index(messages: Sequence[Mapping[str, Any]]) -> int:
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].get("role") == "user":
            return index
    return len(messages)


def _prefix_chars(tokenizer: ChatTokenizer, full: str, messages: Sequence[Mapping[str, Any]], floor: int) -> int:
    if not messages:
        return floor
    try:
        text = tokenizer.render_chat(messages, add_generation_prompt=False)
    except Exception:  # a template that refuses a partial conversation: no boundary here
        return floor
    return len(text) if full.startswith(text) and len(text) >= floor else floor


class ChatPrompter:
    """Prepares prompts for one tokenizer; caches what depends only on the template."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)  # token id -> text/bytes for log probabilities
        self._default_system: dict[str, str] = {}  # first message's role -> template's default system text
        self.prefixes = PrefixTokens(tokenizer.encode_prompt)  # per tenant: system segments tokenized before

    def default_system_chars(self, full: str, messages: Sequence[Mapping[str, Any]]) -> int:
        role = str(messages[0].get("role", "user")) if messages else "user"
        prefix = self._default_system.get(role)
        if prefix is None:
            prefix = self._default_system[role] = _default_system_prefix(self.tokenizer, role)
        return len(prefix) if prefix and full.startswith(prefix) else 0

    def chat(self, messages: Sequence[Mapping[str, Any]], marks: Sequence[Mark] = (), *,
             scope: str | None = None) -> PreparedPrompt:
        """``scope`` (the tenant): its system segment's tokens come from :attr:`prefixes`
        when it sent the same text before; without one, everything is tokenized afresh."""
        encode_system = None if scope is None else partial(self.prefixes.encode, scope)
        return prepare_chat(self.tokenizer, messages, default_system_chars=self.default_system_chars, marks=marks,
                            encode_system=encode_system)

    def completion(self, prompt: str) -> PreparedPrompt:
        return prepare_completion(self.tokenizer, prompt)


def prepare_chat(tokenizer: ChatTokenizer, messages: Sequence[Mapping[str, Any]], *,
                 default_system_chars=None, marks: Sequence[Mark] = (),
                 encode_system: Callable[[str], Sequence[int]] | None = None) -> PreparedPrompt:
    """Render ``messages`` with the chat template and mark the segment boundaries (and,
    for each ``k`` in ``marks``, where the first ``k`` messages end; for a :class:`TextMark`,
    where its text ends, rounded down to a token boundary).

    ``encode_system``: tokenizes the first piece (the system segment, or the text before
    the first mark) in place of ``tokenizer.encode_prompt``; it must return what ``encode_prompt``
    would (a cache of it, :class:`~server.gateway.api.prefix_cache.PrefixTokens`).

    The client's strings are plain text: ``messages`` are rendered shielded (the module docstring)."""
    shielded = tokenizer.shield_chat(messages)
    encode = tokenizer.encode  # no client string holds a special token's text: encode_prompt would be encode
    if shielded is not messages:
        marks = [_shielded_mark(tokenizer, messages, mark) for mark in marks]
        messages, encode = shielded, tokenizer.encode_prompt
    full = tokenizer.render_chat(messages, add_generation_prompt=True)
    leading_system = 0
    while leading_system < len(messages) and messages[leading_system].get("role") in ("system", "developer"):
        leading_system += 1
    last_user = _last_user_index(messages)
    # Tool results after the last user message are context (retrieved data), not the turn:
    # the context then runs to the end of the last tool message.
    last_tool = max((i for i in range(last_user, len(messages)) if messages[i].get("role") == "tool"), default=-1)
    context_upto = last_tool + 1 if last_tool >= 0 else last_user
    # With no system message, the template may insert its default one: render a single
    # user message and cut at that message's start marker to find it.
    if leading_system:
        system_chars = _prefix_chars(tokenizer, full, messages[:leading_system], 0)
    else:
        if default_system_chars is None:
            prefix = _default_system_prefix(tokenizer, str(messages[0].get("role", "user")) if messages else "user")
            system_chars = len(prefix) if prefix and full.startswith(prefix) else 0
        else:
            system_chars = default_system_chars(full, messages)
    if leading_system and context_upto == leading_system:
        # system messages then one user turn (the usual request): the context prefix is the
        # system prefix just rendered, and _prefix_chars would return the same number
        context_chars = system_chars
    else:
        context_chars = _prefix_chars(tokenizer, full, messages[:context_upto], system_chars)
    if not marks:
        pieces = (full[:system_chars], full[system_chars:context_chars], full[context_chars:])
        ids: list[int] = []
        ends: list[int] = []
        for index, piece in enumerate(pieces):
            if piece:
                ids.extend(encode_system(piece) if index == 0 and encode_system is not None else encode(piece))
            ends.append(len(ids))
        return PreparedPrompt(tuple(ids), ends[0], ends[1])
    mark_chars = [_mark_chars(tokenizer, full, messages, k) for k in marks]
    cuts = sorted({0, system_chars, context_chars, *(c for c, inside in mark_chars if not inside), len(full)})
    ids = []
    token_at = {0: 0}
    for start, end in zip(cuts, cuts[1:]):
        piece = full[start:end]
        ids.extend(encode_system(piece) if start == 0 and encode_system is not None else encode(piece))
        token_at[end] = len(ids)
    ends = []
    for chars, inside in mark_chars:
        if chars in token_at:
            ends.append(token_at[chars])
            continue
        # inside a piece: its leading tokens that the text up to the mark alone tokenizes to too
        start = max(c for c in cuts if c < chars)
        head = full[start:chars]
        alone = encode_system(head) if start == 0 and encode_system is not None else encode(head)
        first = token_at[start]
        common = next((i for i, (a, b) in enumerate(zip(alone, ids[first:], strict=False)) if a != b),
                      min(len(alone), len(ids) - first))
        ends.append(first + common)
    return PreparedPrompt(tuple(ids), token_at[system_chars], token_at[context_chars], tuple(ends))


def _shielded_mark(tokenizer: ChatTokenizer, messages: Sequence[Mapping[str, Any]], mark: Mark) -> Mark:
    """``mark`` in the shielded messages: a :class:`TextMark` counts the characters of its message's
    shielded content (a message count is the same)."""
    if isinstance(mark, int) or not 0 <= mark.index < len(messages):
        return mark
    content = messages[mark.index].get("content")
    if not isinstance(content, str):
        return mark
    return TextMark(mark.index, tokenizer.shielded_offset(content, mark.chars))


def _mark_chars(tokenizer: ChatTokenizer, full: str, messages: Sequence[Mapping[str, Any]],
                mark: Mark) -> tuple[int, bool]:
    """(where ``mark`` ends in ``full``, whether that is inside a message: not a cut)."""
    if isinstance(mark, int):
        return (_prefix_chars(tokenizer, full, messages[:mark], 0) if mark > 0 else 0), False
    end = (_prefix_chars(tokenizer, full, messages[:mark.index + 1], 0), False)  # the fallback: the message's end
    message = messages[mark.index] if 0 <= mark.index < len(messages) else {}
    content = message.get("content")
    if not isinstance(content, str) or not 0 < mark.chars < len(content):
        return end
    head = content[:mark.chars]
    # Render the message cut after ``head`` with and without one more character: they part where head ends.
    try:
        short, longer = (tokenizer.render_chat([*messages[:mark.index], {**message, "content": text}],
                                               add_generation_prompt=False) for text in (head, head + "\x00"))
    except Exception:  # a template that refuses a partial conversation: no mark inside it
        return end
    at = next((i for i, (a, b) in enumerate(zip(short, longer, strict=False)) if a != b), len(short))
    if not short[:at].endswith(head) or not full.startswith(short[:at]):
        return end  # the template does not render the text verbatim
    return at, True


def _default_system_prefix(tokenizer: ChatTokenizer, role: str) -> str:
    """Where the template's default system prompt (if any) ends, for chats without one.

    Two renderings that differ only in the first message's content share a prefix that
    ends inside that message; its start is the role-opening special token (``<|...``)
    before the role name (ChatML ``<|im_start|>user``, Llama-3 ``<|start_header_id|>user``).
    """
    try:
        first = tokenizer.render_chat([{"role": role, "content": "\x00"}], add_generation_prompt=False)
        second = tokenizer.render_chat([{"role": role, "content": "\x01"}], add_generation_prompt=False)
    except Exception:
        return ""
    common = next((i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b), 0)
    role_at = first.rfind(role, 0, common)
    start = first.rfind("<|", 0, role_at) if role_at > 0 else -1
    return first[:start] if start > 0 else ""


def prepare_completion(tokenizer: ChatTokenizer, prompt: str) -> PreparedPrompt:
    # A raw prompt is the client's own template text: its control tokens (``<|im_end|>``) are parsed.
    ids = tuple(tokenizer.encode(prompt))
    return PreparedPrompt(ids, 0, len(ids))
