"""Thinking models for tests, built offline: tokenizers with `<think>` and `</think>`
and chat templates written here in each family's convention, and a scripted
model whose decoder says exactly what a test writes, thinking included.

Conventions (as the families' own templates behave; the text is ours):
- "qwen3": the model opens the block itself; `enable_thinking: false` closes an
  empty block in the generation prompt; an assistant turn's reasoning_content is
  shown only after the last user message (earlier thinking is dropped).
- "smollm3": as qwen3, and a system prompt ending in `/no_think` turns it off too.
- "r1": the generation prompt opens the block (DeepSeek-R1's later templates);
  no switch.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from adapters.openai.normalize import ChatMessage
from adapters.openai.reasoning import Thinking
from adapters.openai.tools import Tool
from tests.openai.test_openai_tools import ScriptModel
from tests.support import tiny_models
from tests.support.tiny_models import default_tokenizer

NL = '{{ "\\n" }}'  # newlines as expressions: transformers' Jinja trims those after tags
_LAST_USER = (
    "{% set ns = namespace(last=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}"
    "{% endif %}{% endfor %}{% set last_user = ns.last %}"
)
_TURNS = (
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}"
    f"<|im_start|>assistant{NL}"
    "{% if m.reasoning_content is defined and m.reasoning_content and loop.index0 > last_user %}"
    f"<think>{NL}{{{{ m.reasoning_content }}}}{NL}</think>{NL}{NL}"
    "{% endif %}"
    f"{{{{ m.content }}}}<|im_end|>{NL}"
    f"{{% else %}}<|im_start|>{{{{ m.role }}}}{NL}{{{{ m.content }}}}<|im_end|>{NL}{{% endif %}}"
    "{% endfor %}"
)
_PROMPT = f"{{% if add_generation_prompt %}}<|im_start|>assistant{NL}"
TEMPLATES = {
    "qwen3": _LAST_USER
    + _TURNS
    + _PROMPT
    + "{% if enable_thinking is defined and enable_thinking is false %}"
    f"<think>{NL}{NL}</think>{NL}{NL}{{% endif %}}{{% endif %}}",
    "smollm3": _LAST_USER
    + "{% set off = (enable_thinking is defined and enable_thinking is false) or "
    "(messages[0].role == 'system' and messages[0].content.endswith('/no_think')) %}"
    + _TURNS
    + _PROMPT
    + f"{{% if off %}}<think>{NL}{NL}</think>{NL}{{% endif %}}{{% endif %}}",
    "r1": _LAST_USER + _TURNS + _PROMPT + f"<think>{NL}{{% endif %}}",
}


def thinking_tokenizer(convention: str) -> Any:
    """The default model's tokenizer with the two tags added (single tokens, as in the
    families' vocabularies) and a chat template of `convention`."""
    tokenizer = copy.deepcopy(default_tokenizer())
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = TEMPLATES[convention]
    return tokenizer


# The scripted model's tags: two characters no test writes otherwise, one token each.
OPEN, CLOSE = "\u2983", "\u2984"  # ⦃ ⦄


class ThinkingScriptModel(ScriptModel):
    """ScriptModel (token t is chr(t)) that thinks: OPEN and CLOSE are its tags. Its
    prompt honours enable_thinking (false: an empty block closed in the prompt) and,
    with `opens`, ends inside an open block, as R1's templates do."""

    def __init__(self, opens: bool = False) -> None:
        super().__init__()
        blank = frozenset(ord(c) for c in " \n")
        self.thinking: Thinking | None = Thinking(ord(OPEN), ord(CLOSE), not opens, blank)
        self.opens = opens

    def tokenize_chat(
        self,
        messages: Sequence[ChatMessage],
        tools: tuple[Tool, ...] = (),
        template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        prompt = super().tokenize_chat(messages, tools, template_kwargs, add_generation_prompt)
        if not add_generation_prompt:
            return prompt
        if self.opens:
            return [*prompt, ord(OPEN), ord("\n")]
        if (template_kwargs or {}).get("enable_thinking") is False:
            return prompt + [ord(c) for c in f"{OPEN}\n\n{CLOSE}\n\n"]
        return prompt


def thinking_checkpoint(case: str, convention: str, folder: Path) -> Path:
    """A tiny random checkpoint of `case` (tiny_models) saved with the thinking tokenizer
    of `convention`, its vocabulary widened to hold the two tags."""
    target = folder / f"{case}-{convention}"
    if not (target / "config.json").is_file():
        tokenizer = thinking_tokenizer(convention)
        tiny_models.model(case, vocab_size=len(tokenizer)).save_pretrained(target)
        tokenizer.save_pretrained(target)
    return target
