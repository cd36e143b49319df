"""schemathesis check loaded by tests/test_fuzz.py (SCHEMATHESIS_HOOKS): every error this server
sends has OpenAI's shape, {"error": {"message", "type", "param", "code"}} with code = the status."""

import schemathesis


@schemathesis.check
def openai_error_shape(ctx, response, case):
    if response.status_code < 400:
        return
    body = response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == response.status_code and isinstance(err["message"], str) and err["message"], err
    assert "Traceback" not in err["message"], err
