"""Request fields that constrain the output, turned into one engine `StructuredOutput`.

Accepted: OpenAI's `response_format` (json_object, json_schema; "text" = no constraint), vLLM's
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, and vLLM's newer
`structured_outputs` object ({json | regex | choice | grammar | json_object}). Grammars are Lark
in llguidance's dialect (vLLM's guidance backend takes the same). At most one per request.
"""

from __future__ import annotations

import json

from engine.sampling_params import InvalidParameter
from engine.structured_output import StructuredOutput, choice, json_schema


def _schema(value, param: str) -> StructuredOutput:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidParameter(param, f"{param} is not valid JSON: {e}") from e
    return json_schema(value, param)


def structured_output(req) -> StructuredOutput | None:
    """The request's constraint, or None. InvalidParameter when several are given or one is malformed
    (the grammar itself is checked by the engine's compiler)."""
    found: list[StructuredOutput] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(StructuredOutput("json_object", param="response_format"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise InvalidParameter("response_format", "response_format of type json_schema needs a json_schema")
        found.append(_schema(rf.json_schema.schema_, "response_format"))
    if req.guided_json is not None:
        found.append(_schema(req.guided_json, "guided_json"))
    if req.guided_regex is not None:
        found.append(StructuredOutput("regex", req.guided_regex, "guided_regex"))
    if req.guided_choice is not None:
        found.append(choice(req.guided_choice, "guided_choice"))
    if req.guided_grammar is not None:
        found.append(StructuredOutput("grammar", req.guided_grammar, "guided_grammar"))
    so = req.structured_outputs
    if so is not None:
        given = [k for k in ("json_", "regex", "choice", "grammar", "json_object") if getattr(so, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidParameter("structured_outputs", "structured_outputs needs exactly one of json, regex, "
                                                         f"choice, grammar, json_object; got {len(given)}")
        param = "structured_outputs"
        if so.json_ is not None:
            found.append(_schema(so.json_, param))
        elif so.regex is not None:
            found.append(StructuredOutput("regex", so.regex, param))
        elif so.choice is not None:
            found.append(choice(so.choice, param))
        elif so.grammar is not None:
            found.append(StructuredOutput("grammar", so.grammar, param))
        else:
            found.append(StructuredOutput("json_object", param=param))
    if len(found) > 1:
        raise InvalidParameter(found[1].param, f"{found[0].param} and {found[1].param} both constrain the output; "
                                               "send one")
    return found[0] if found else None


def logit_bias(req) -> dict[int, float] | None:
    """OpenAI sends logit_bias keys as strings of token ids (JSON object keys)."""
    if not req.logit_bias:
        return None
    out = {}
    for key, value in req.logit_bias.items():
        try:
            out[int(key)] = float(value)
        except ValueError:
            raise InvalidParameter("logit_bias", f"logit_bias keys must be token ids, got {key!r}") from None
    return out
