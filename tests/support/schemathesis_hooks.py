"""schemathesis check loaded by tests/server/test_fuzz.py (SCHEMATHESIS_HOOKS): every error this server
sends has OpenAI's shape, {"error": {"message", "type", "param", "code"}} with code = the status,
or, on Anthropic's Messages API (/v1/messages), Anthropic's: {"type": "error", "error": {"type",
"message"}}."""

import schemathesis

ANTHROPIC_TYPES = {"invalid_request_error", "authentication_error", "permission_error", "not_found_error",
                   "request_too_large", "rate_limit_error", "api_error", "overloaded_error"}


@schemathesis.check
def openai_error_shape(ctx, response, case):
    if response.status_code < 400:
        return
    body = response.json()
    if case.operation.path.startswith("/v1/messages"):
        assert set(body) == {"type", "error"} and body["type"] == "error", body
        err = body["error"]
        assert set(err) == {"type", "message"} and err["type"] in ANTHROPIC_TYPES, err
    else:
        assert set(body) == {"error"}, body
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert err["code"] == response.status_code, err
    assert isinstance(err["message"], str) and err["message"], err
    assert "Traceback" not in err["message"], err
