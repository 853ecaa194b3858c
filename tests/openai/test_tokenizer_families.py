"""Streaming detokenization against a full decode, for both tokenizer families.

Byte-level BPE (GPT-2, SmolLM2, Llama 3) puts a word's leading space inside
its token; SentencePiece-style tokenizers (Llama 2, Mistral) mark it with '▁'
and drop it at the start of a decode, so a token decoded alone loses the
space it has after another token. Both are built here, offline, with the
`tokenizers` library, trained on a few sentences.
"""

from __future__ import annotations

from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from adapters.openai.egress import IncrementalDetokenizer
from adapters.openai.models import ChatModel

CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "Fences and posts: a fence post error is off by one.",
    "Déjà vu at the café, naïve résumé, über straße.",
    "Numbers 12 345 and 6789, and words again and again.",
] * 20
TEXTS = [
    "Hello world",
    "the quick brown fox jumps over the lazy dog",
    "a fence post error is off by one, again and again.",
    "  two leading spaces and  double  gaps",
    "Déjà vu, naïve café",
    "12 345 6789",
]


def sentencepiece_style() -> Any:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"])
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def byte_level() -> Any:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")


FAMILIES = {"sentencepiece-style": sentencepiece_style, "byte-level": byte_level}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model(request: pytest.FixtureRequest) -> ChatModel:
    return ChatModel(request.param, FAMILIES[request.param](), 512)


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_deltas_add_up_to_the_full_decode(model: ChatModel, text: str) -> None:
    ids = [int(t) for t in model.tokenizer.encode(text, add_special_tokens=False)]
    assert len(ids) > 1
    detokenizer = IncrementalDetokenizer(model.decode)
    deltas = [detokenizer.push(t) for t in ids]
    streamed = "".join(deltas) + detokenizer.flush()
    assert streamed == model.decode(ids)
    assert "\ufffd" not in streamed


def test_the_sentencepiece_family_really_drops_the_space_of_a_token_decoded_alone() -> None:
    """What makes the family worth testing: decoding token by token glues the words."""
    model = ChatModel("sp", sentencepiece_style(), 512)
    ids = [int(t) for t in model.tokenizer.encode("Hello world", add_special_tokens=False)]
    glued = "".join(model.decode([t]) for t in ids)
    assert model.decode(ids) == "Hello world"
    assert glued != model.decode(ids)  # e.g. "Helloworld"


@pytest.mark.parametrize("family", [byte_level, sentencepiece_style])
def test_token_bytes_spell_the_text(family: Any) -> None:
    model = ChatModel("m", family(), 512)
    for text in TEXTS:
        ids = model.tokenizer.encode(text, add_special_tokens=False)
        spelled = b"".join(model.token_bytes(t) for t in ids).decode()
        # SentencePiece marks the start of the text as a space ('▁') of its own
        assert spelled in (text, " " + text), (text, spelled)
    eos = model.tokenizer.eos_token_id
    assert model.token_bytes(eos) == model.tokenizer.eos_token.encode()
