"""Compare grammar engines for constrained decoding on this CPU (docs/design/structured.md).

For each engine installed (llguidance; xgrammar and outlines-core where
importable): compile time of a typical schema with the default model's
tokenizer, mask time per token along a valid answer, and which JSON Schema
features it refuses. Run:  python bench/grammar_engines.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

from bench.engine import TYPICAL_SCHEMA

ANSWER = {
    "name": "Ada Lovelace",
    "age": 36,
    "height_m": 1.65,
    "member": True,
    "colour": "green",
    "tags": ["mathematics", "poetry", "engines"],
    "address": {"city": "London", "zip": "W1"},
}
S = {"type": "string"}
FEATURES: dict[str, dict[str, Any]] = {
    "pattern": {"type": "string", "pattern": "^[a-z]+[0-9]{2}$"},
    "format date-time": {"type": "string", "format": "date-time"},
    "format email": {"type": "string", "format": "email"},
    "minLength/maxLength": {"type": "string", "minLength": 2, "maxLength": 5},
    "minimum/maximum": {"type": "integer", "minimum": 1, "maximum": 99},
    "exclusiveMinimum number": {"type": "number", "exclusiveMinimum": 0.5},
    "multipleOf": {"type": "integer", "multipleOf": 3},
    "enum": {"enum": ["a", 1, None]},
    "const": {"const": "x"},
    "anyOf": {"anyOf": [S, {"type": "integer"}]},
    "oneOf": {"oneOf": [S, {"type": "integer"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": S}}, {"required": ["a"]}]},
    "not": {"not": {"type": "string"}},
    "if/then/else": {"if": S, "then": {"minLength": 1}, "else": {"type": "integer"}},
    "$ref recursive": {
        "$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}},
        "$ref": "#/$defs/node",
    },
    "additionalProperties schema": {"type": "object", "additionalProperties": {"type": "integer"}},
    "patternProperties": {"type": "object", "patternProperties": {"^x": S}},
    "propertyNames": {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}},
    "minItems/maxItems": {"type": "array", "items": S, "minItems": 1, "maxItems": 3},
    "uniqueItems": {"type": "array", "items": S, "uniqueItems": True},
    "prefixItems": {"type": "array", "prefixItems": [S, {"type": "integer"}]},
    "contains": {"type": "array", "contains": {"type": "integer"}},
    "minProperties": {"type": "object", "minProperties": 1},
    "dependentRequired": {"type": "object", "dependentRequired": {"a": ["b"]}},
    "type list": {"type": ["string", "null"]},
}
REPEATS = 5
TYPICAL = TYPICAL_SCHEMA  # the schema `fencepost bench engine --constrained` uses


def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from adapters.engine.files import cache_root

    directory = sorted((cache_root() / "models").glob("SmolLM2-135M-Instruct*"))[-1]
    return AutoTokenizer.from_pretrained(directory)


def timed_walk(start: Any, mask_step: Any, tokens: list[int]) -> list[float]:
    """Seconds per mask along tokens (REPEATS walks, each from a fresh state)."""
    times: list[float] = []
    for _ in range(REPEATS):
        state = start()
        for token in tokens:
            began = time.perf_counter()
            mask_step(state, token)
            times.append(time.perf_counter() - began)
    return times


def llguidance_engine(hf: Any, tokens: list[int]) -> dict[str, Any]:
    import llguidance
    import llguidance.hf
    import torch

    tok = llguidance.hf.from_tokenizer(hf, n_vocab=len(hf), eos_token=hf.eos_token_id)
    vocab = tok.vocab_size
    began = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(TYPICAL)
    template = llguidance.LLMatcher(tok, grammar)
    assert not template.is_error(), template.get_error()
    compile_s = time.perf_counter() - began
    mask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)

    def step(m: Any, token: int) -> None:
        m.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        assert m.consume_token(token), m.get_error()

    times = timed_walk(template.deep_copy, step, tokens)
    refused = []
    for name, schema in FEATURES.items():
        g = llguidance.LLMatcher.grammar_from_json_schema(schema)
        error = llguidance.LLMatcher.validate_grammar(g)
        if error:
            refused.append(f"{name} ({error.splitlines()[0][:80]})")
    return {"compile_s": compile_s, "times": times, "refused": refused}


def xgrammar_engine(hf: Any, tokens: list[int]) -> dict[str, Any]:
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    began = time.perf_counter()
    compiled = compiler.compile_json_schema(
        json.dumps(TYPICAL), any_whitespace=False, separators=(",", ":")
    )
    compile_s = time.perf_counter() - began
    mask = xgrammar.allocate_token_bitmask(1, info.vocab_size)

    def step(m: Any, token: int) -> None:
        m.fill_next_token_bitmask(mask, 0)
        assert m.accept_token(token)

    times = timed_walk(lambda: xgrammar.GrammarMatcher(compiled), step, tokens)
    refused = []
    for name, schema in FEATURES.items():
        try:
            compiler.compile_json_schema(json.dumps(schema))
        except Exception as error:
            refused.append(f"{name} ({str(error).splitlines()[0][:80]})")
    return {"compile_s": compile_s, "times": times, "refused": refused}


def outlines_engine(hf: Any, tokens: list[int]) -> dict[str, Any]:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    eos = hf.eos_token_id
    vocab: dict[str, list[int]] = {}
    for text, ident in hf.get_vocab().items():
        if ident != eos:
            vocab.setdefault(text, []).append(ident)
    vocabulary = outlines_core.Vocabulary(eos, vocab)
    began = time.perf_counter()
    regex = build_regex_from_schema(json.dumps(TYPICAL), r"")
    index = outlines_core.Index(regex, vocabulary)
    compile_s = time.perf_counter() - began

    def step(guide: Any, token: int) -> None:
        guide.get_tokens()
        guide.advance(token)

    times = timed_walk(lambda: outlines_core.Guide(index), step, tokens)
    refused = []
    for name, schema in FEATURES.items():
        try:
            outlines_core.Index(build_regex_from_schema(json.dumps(schema), r""), vocabulary)
        except Exception as error:
            refused.append(f"{name} ({str(error).splitlines()[0][:80]})")
    return {"compile_s": compile_s, "times": times, "refused": refused}


def main() -> None:
    hf = tokenizer()
    tokens = hf.encode(json.dumps(ANSWER, separators=(",", ":")), add_special_tokens=False)
    print(f"typical schema answer: {len(tokens)} tokens, vocab {len(hf)}")
    engines = {"llguidance": llguidance_engine, "xgrammar": xgrammar_engine}
    engines["outlines-core"] = outlines_engine
    for name, measure in engines.items():
        try:
            result = measure(hf, tokens)
        except ImportError as error:
            print(f"{name}: not installed ({error})")
            continue
        except Exception as error:
            print(f"{name}: failed: {type(error).__name__}: {error}")
            continue
        times = sorted(result["times"])
        p50 = statistics.median(times) * 1e6
        p99 = times[int(0.99 * (len(times) - 1))] * 1e6
        mean = statistics.fmean(times) * 1e6
        print(
            f"{name}: compile {result['compile_s'] * 1e3:.1f} ms; mask per token "
            f"mean {mean:.0f} us, p50 {p50:.0f} us, p99 {p99:.0f} us; "
            f"refuses {len(result['refused'])}/{len(FEATURES)}"
        )
        for item in result["refused"]:
            print(f"    refuses {item}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
