"""Constrained decoding: a request's Constraint becomes a token mask at every step.

A Constraint holds an llguidance grammar (a JSON schema or a Lark grammar, as
LLMatcher.grammar_from_json_schema / grammar_from_lark write it). Grammars
compiles it once per text (a bounded LRU, so n choices and repeated schemas do
not compile again) against the model's tokenizer, and hands each sequence its
own matcher, a copy of the compiled one. The matcher's state is a function of
the tokens consumed so far: a continuation replays its output prefix into a
fresh matcher and is then where the undisturbed run was.

Per step the engine asks for the masks of all its constrained rows in one call
(llguidance fills them on its own threads, outside the GIL) and sets every
disallowed token's logit to -inf before sampling, so greedy and seeded
sampling keep their contract over the masked distribution. Once the grammar
is complete only end-of-sequence tokens are allowed, so a finished JSON value
ends the output with reason eos like any other stop.

Why llguidance (measured against xgrammar and outlines-core): see
docs/design/structured.md.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import llguidance
import torch

GRAMMAR_CACHE_SIZE = 64  # compiled grammars kept, least recently used dropped first


class GrammarError(ValueError):
    """The grammar does not compile, or a replayed prefix is not a sentence of it."""


def tokenizer_for(hf_tokenizer: Any, vocab_size: int, eos_ids: Iterable[int]) -> Any:
    """llguidance's view of a Hugging Face fast tokenizer (~1 s: build once per engine).

    vocab_size is the width of the model's logits (it may exceed the tokenizer's);
    eos_ids are the tokens a finished grammar allows."""
    import llguidance.hf

    eos = sorted(eos_ids)
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos or None)


def validate(grammar: str) -> str | None:
    """Why the grammar cannot be used (no tokenizer needed), or None when it can."""
    error = llguidance.LLMatcher.validate_grammar(grammar)
    return error or None


def json_schema_grammar(schema: dict[str, Any] | None) -> str:
    """The llguidance grammar for JSON values valid under `schema` (None: any JSON
    object). Whitespace is compact so the model cannot stall on indentation."""
    options: dict[str, Any] = {"whitespace_flexible": False}
    if schema is None:
        schema = {"type": "object"}
    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)  # type: ignore[arg-type]


class Grammars:
    """Compiled grammars by text for one tokenizer, and fresh matchers from them."""

    def __init__(self, tokenizer: Any, capacity: int = GRAMMAR_CACHE_SIZE) -> None:
        self.tokenizer = tokenizer
        self.vocab_size: int = tokenizer.vocab_size
        self._capacity = capacity
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._executor = llguidance.LLExecutor()
        self.compiled_count = 0  # how many compilations ran (the cache's misses)

    def matcher(self, grammar: str, prefix: Sequence[int] = ()) -> llguidance.LLMatcher:
        """A matcher at the start of `grammar`, then past `prefix` (a continuation's
        output so far). Raises GrammarError if either fails."""
        template = self._compiled.get(grammar)
        if template is None:
            template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            if template.is_error():
                raise GrammarError(f"the grammar does not compile: {template.get_error()}")
            self.compiled_count += 1
            self._compiled[grammar] = template
            while len(self._compiled) > self._capacity:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        matcher = template.deep_copy()
        if prefix and not matcher.consume_tokens(list(prefix)):
            raise GrammarError(f"the output prefix breaks the grammar: {matcher.get_error()}")
        return matcher

    def mask(
        self, logits: torch.Tensor, rows: Sequence[int], matchers: Sequence[llguidance.LLMatcher]
    ) -> torch.Tensor:
        """logits [rows, vocab] with every token the row's matcher forbids at -inf, for
        the given rows (the others as they were); one native call computes all masks."""
        if not rows:
            return logits
        words = (self.vocab_size + 31) // 32
        bitmask = torch.zeros((len(rows), words), dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(), words * 4, len(rows)
        )
        allowed = torch.ones(logits.shape, dtype=torch.bool)
        allowed[list(rows)] = allowed_tokens(bitmask, logits.shape[-1])
        return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


_BITS = torch.arange(32, dtype=torch.int32)


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """The boolean [rows, vocab] view of a packed bitmask [rows, words] (bit j of word
    w is token 32*w + j); tokens past the mask's width are not allowed."""
    bits = (bitmask.unsqueeze(-1) >> _BITS) & 1
    flat = bits.reshape(bitmask.shape[0], -1).bool()
    if flat.shape[1] >= vocab:
        return flat[:, :vocab]
    pad = torch.zeros((flat.shape[0], vocab - flat.shape[1]), dtype=torch.bool)
    return torch.cat([flat, pad], dim=1)
