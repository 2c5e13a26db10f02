"""How a context and a question become the token ids fed to the model: BOS, special tokens, plain or chat.

This is the prompt rule of :func:`polykv.runtime.answer.answer` and of every study item
(:mod:`polykv.studies.prompt` reports its errors as study errors). A prompt is built the way the model's
own tokenizer builds a plain-completion prompt, in two parts (the context is compressed before the
question is seen, so they are encoded apart):

- **context ids** = the tokens the tokenizer puts *in front of* a text (its ``add_special_tokens=True``
  behaviour: the BOS for Llama 3, Gemma, Mistral; nothing for SmolLM2), then the context's text tokens;
- **question ids** = the question's text tokens, continuing the same sequence: no second BOS;
- a teacher-forced continuation (the ``continuation`` task) continues the same way.

Special tokens a tokenizer would *append* to a text (an EOS, with ``add_eos_token``) would end the
document in the middle of the prompt, so they are never placed.

``bos`` overrides the rule: ``"auto"`` (default) = what the tokenizer does; ``True`` = the BOS is the
first token (added when the tokenizer would not add it; an error when the tokenizer has no BOS);
``False`` = no BOS (any other leading special tokens the tokenizer adds stay). A text that itself
starts with the BOS (written into a task file, or by a chat template) keeps that one and never gets a
second; with ``False`` such a text is an error rather than silently edited.

``prompt_format="chat"`` (instruct models) renders the tokenizer's chat template for one user turn
whose content is ``context + question``, with the generation prompt (the assistant turn's header),
and splits the rendered text right after the context: everything up to the end of the context (the
template's opening: BOS or system turn, the user turn's header, then the context) is the context part,
compressed as usual; the rest (the question, the end of the user turn, the assistant header) is the
question part, fed through the compressed cache before generating. Both parts are tokenized without
adding special tokens, as ``apply_chat_template(tokenize=True)`` does (the template writes its own);
``bos`` then applies to the first token of the rendered template the same way.
"""

from __future__ import annotations

from typing import Any

from polykv.errors import PolykvError, RuntimeConfigError

BOS_CHOICES = ("auto", True, False)
PROMPT_FORMATS = ("plain", "chat")
_PROBE = "Hello world"


class PromptEncoder:
    """A tokenizer together with a study's prompt rule (see the module docstring).

    Behaves as the tokenizer for tasks (``encode``, ``decode`` and every other attribute are the
    tokenizer's) and adds :meth:`prompt_ids`, :meth:`prompt_length`, :meth:`text_ids` and
    :meth:`chat_split`.
    """

    error: type[PolykvError] = RuntimeConfigError
    """The error class its refusals raise."""
    kind = "parameter"
    """What its refusals call ``bos`` and ``prompt_format`` (a study spec's are fields)."""

    def __init__(self, tokenizer, *, bos: Any = "auto", prompt_format: str = "plain", where: str = "prompt"):
        if bos not in BOS_CHOICES or isinstance(bos, int) and not isinstance(bos, bool):
            raise self.error(f"{where}: {self.kind} 'bos': expected \"auto\", true or false, got {bos!r}")
        if prompt_format not in PROMPT_FORMATS:
            raise self.error(f"{where}: {self.kind} 'prompt_format': expected one of {list(PROMPT_FORMATS)}, "
                             f"got {prompt_format!r}")
        self.tokenizer, self.bos, self.prompt_format, self.where = tokenizer, bos, prompt_format, where
        self.bos_id = _bos_id(tokenizer)
        if bos is True and self.bos_id is None:
            raise self.error(f"{where}: {self.kind} 'bos': true asks for a BOS token but the tokenizer "
                             f"({type(tokenizer).__name__}) has none; use \"auto\" or false")
        if prompt_format == "chat" and not getattr(tokenizer, "chat_template", None):
            raise self.error(f"{where}: {self.kind} 'prompt_format': \"chat\" needs a tokenizer with a chat template, "
                             f"and {type(tokenizer).__name__} has none; use \"plain\"")
        self.leading = _leading_special_ids(tokenizer, self.error)

    # -- the tokenizer's own interface, for tasks ---------------------------------------------------
    def encode(self, text: str, **kwargs) -> list[int]:
        """The tokenizer's ``encode``, unchanged (tasks pass ``add_special_tokens=False``)."""
        return list(self.tokenizer.encode(text, **kwargs))

    def decode(self, ids, **kwargs) -> str:
        return self.tokenizer.decode(ids, **kwargs)

    def __getattr__(self, name: str):
        """Every other attribute is the tokenizer's (``eos_token_id``, ``vocab_size``, ...)."""
        if name == "tokenizer" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.tokenizer, name)

    # -- the prompt rule ----------------------------------------------------------------------------
    def text_ids(self, text: str) -> list[int]:
        """Tokens of ``text`` continuing a sequence: no special tokens added; empty text has none."""
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def prompt_ids(self, context: str, question: str) -> tuple[list[int], list[int]]:
        """(context ids, question ids) of one item, as the runner feeds them."""
        if self.prompt_format == "chat":
            context, question = self.chat_split(context, question)
            head = []
        else:
            head = list(self.leading)
            if self.bos is True and head[:1] != [self.bos_id]:
                head = [self.bos_id] + [t for t in head if t != self.bos_id]
            elif self.bos is False:
                head = [t for t in head if t != self.bos_id]
        body = self.text_ids(context)
        if self.bos_id is not None and body[:1] == [self.bos_id]:
            if self.bos is False:
                raise self.error(f"{self.where}: {self.kind} 'bos' is false but the context "
                                 + ("(the rendered chat template) " if self.prompt_format == "chat" else "")
                                 + f"itself starts with the BOS token {self._bos_text()}; remove it from the "
                                 "text, or use \"auto\" or true")
            head = [t for t in head if t != self.bos_id]       # the text brings its own: never a second
        elif self.prompt_format == "chat" and self.bos is True:
            head = [self.bos_id]
        return head + body, self.text_ids(question)

    def prompt_length(self, context: str, question: str) -> int:
        """Tokens the runner feeds for this item's prompt (context part + question part)."""
        ctx, q = self.prompt_ids(context, question)
        return len(ctx) + len(q)

    def chat_split(self, context: str, question: str) -> tuple[str, str]:
        """The rendered chat template cut right after ``context``: (context part, question part)."""
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": context + question}],
                                                  tokenize=False, add_generation_prompt=True)
        if not context or text.count(context) != 1:
            raise self.error(f"{self.where}: {self.kind} 'prompt_format': the chat template does not reproduce the "
                             "item's context verbatim exactly once (it edits the message text), so the context "
                             "cannot be split from the question; use \"plain\"")
        cut = text.index(context) + len(context)
        return text[:cut], text[cut:]

    def _bos_text(self) -> str:
        tok = getattr(self.tokenizer, "bos_token", None)
        return f"{tok!r} (id {self.bos_id})" if tok else f"id {self.bos_id}"


def _bos_id(tokenizer) -> int | None:
    bos = getattr(tokenizer, "bos_token_id", None)
    return int(bos) if isinstance(bos, int) and not isinstance(bos, bool) else None


def _leading_special_ids(tokenizer, error: type[PolykvError]) -> tuple[int, ...]:
    """The tokens the tokenizer puts in front of any text when asked for its special tokens.

    A tokenizer without special tokens (no ``all_special_ids``, like the offline word and character
    tokenizers) adds none.
    """
    if not hasattr(tokenizer, "all_special_ids"):
        return ()
    plain = list(tokenizer.encode(_PROBE, add_special_tokens=False))
    full = list(tokenizer.encode(_PROBE, add_special_tokens=True))
    for i in range(len(full) - len(plain) + 1):
        if full[i:i + len(plain)] == plain:
            return tuple(int(t) for t in full[:i])
    raise error(f"the tokenizer {type(tokenizer).__name__} tokenizes {_PROBE!r} differently with and without "
                     "its special tokens, so the tokens it adds cannot be told apart from the text's")
