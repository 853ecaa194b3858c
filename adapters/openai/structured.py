"""`response_format` in, a Constraint (or none) out: structured outputs at the boundary.

- {"type": "text"}: no constraint.
- {"type": "json_object"}: the output is one JSON object.
- {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}:
  the output is a JSON value valid under the schema. The schema is enforced
  whatever `strict` says (constrained decoding cannot be half on); strict must
  still be a boolean when given.

The shape is checked as OpenAI checks it (name: 1-64 of a-z, A-Z, 0-9, _ and
-; schema: an object), then the grammar is compiled without a tokenizer, so a
schema the grammar engine cannot enforce (an unimplemented keyword such as
`uniqueItems`, an unknown format, a broken $ref or pattern) is a 400 naming the
problem before anything is queued, never a failed stream. Validations are
cached by grammar text (grammar.validate, shared with the tool schemas): a
client repeating a schema pays once.
"""

from __future__ import annotations

import re
from typing import Any

from adapters.engine.grammar import json_schema_grammar, validate
from adapters.openai.errors import OpenAIError, invalid
from core.protocol import MAX_GRAMMAR_BYTES, Constraint

PARAM = "response_format"
TYPES = ("text", "json_object", "json_schema")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def response_format(value: object) -> Constraint | OpenAIError | None:
    """The constraint `response_format` asks for (None: plain text)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        return invalid(f"'{PARAM}' must be an object", PARAM)
    kind = value.get("type")
    if kind not in TYPES:
        return invalid(f"'{PARAM}.type' must be one of {', '.join(TYPES)}", PARAM)
    if kind == "text":
        return None
    if kind == "json_object":
        return _constraint(None)
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        return invalid(f"'{PARAM}.json_schema' must be an object", PARAM)
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        return invalid(
            f"'{PARAM}.json_schema.name' must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -",
            PARAM,
        )
    description = spec.get("description")
    if description is not None and not isinstance(description, str):
        return invalid(f"'{PARAM}.json_schema.description' must be a string", PARAM)
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        return invalid(f"'{PARAM}.json_schema.strict' must be a boolean", PARAM)
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        return invalid(f"'{PARAM}.json_schema.schema' must be a JSON Schema object", PARAM)
    return _constraint(schema)


def _constraint(schema: dict[str, Any] | None) -> Constraint | OpenAIError:
    try:
        grammar = json_schema_grammar(schema)
    except (ValueError, TypeError, RecursionError) as error:
        return invalid(f"'{PARAM}.json_schema.schema' is not usable: {error}", PARAM)
    if len(grammar) > MAX_GRAMMAR_BYTES:
        return invalid(f"'{PARAM}': the schema is too large for this server", PARAM)
    problem = _problem(grammar)
    if problem is not None:
        return invalid(f"'{PARAM}.json_schema.schema' is not supported: {problem}", PARAM)
    return Constraint(grammar)


def _problem(grammar: str) -> str | None:
    problem = validate(grammar)
    return None if problem is None else " ".join(problem.split())  # one line
