"""A JSON schema that constrains every kind of value, for structured-output tests."""

from __future__ import annotations


# Nested: objects, arrays, enums, required fields; strings and arrays bounded so a random model
# (which never chooses to stop) still finishes within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["cat", "dog", "fox"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9},
                           "admin": {"type": "boolean"}},
            "required": ["id", "admin"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "tags", "owner"],
    "additionalProperties": False,
}
