"""The OpenAI HTTP surface fuzzed from the server's own OpenAPI document (issue 47), a few
examples per operation and generation mode, on a unified worker and through the router in front
of a prefill/decode pair: no 5xx, no status, content type or body the document does not admit.
scripts/schemathesis.sh is the long run."""

from __future__ import annotations

from openapi_props import run, worker_and_router

EXAMPLES = 3


def test_openapi_every_operation_answers_within_its_document() -> None:
    with worker_and_router() as (worker, router, doc):
        assert {"/v1/completions", "/v1/chat/completions", "/v1/responses"} <= set(doc["paths"])
        for where, url in (("worker", worker), ("router", router)):
            tally = run(doc, url, EXAMPLES)
            assert tally.calls > 0
            assert not tally.failures, f"{tally.line(where)}\n" + "\n".join(tally.failures[:10])


def test_openapi_document_describes_bodies_answers_and_errors() -> None:
    with worker_and_router() as (_, _, doc):
        for path, ops in doc["paths"].items():
            for method, op in ops.items():
                assert "422" not in op["responses"], (method, path)  # bad input is a 400
                assert {"200", "4XX", "503"} <= set(op["responses"]), (method, path)
                if method == "post":
                    assert "requestBody" in op, path
