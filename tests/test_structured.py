"""Structured outputs on the real engine (bundled tiny model, which cannot write JSON by itself):
every constrained answer parses and validates, choice/regex answers match, free rows in the same
batch are token-exact, bad constraints get a 400, and the mask's twin fails closed."""

from __future__ import annotations

import json
import queue
import re
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from api_client import sse_json
from fastapi.testclient import TestClient
from tiny_app import MODEL, tiny_app_fixtures

from kvfence.config import EngineConfig
from kvfence.engine.engine import Engine
from kvfence.engine.request import GenerateRequest, RequestOutput, SamplingParams
from kvfence.engine.sequence import SeqStatus
from kvfence.faults import Faults
from kvfence.structured.grammar import MAX_SPEC_BYTES
from kvfence.structured.spec import Constraint, ConstraintKind

TINY = Path(__file__).resolve().parents[1] / "models" / "kvfence-tiny"

# Bounded where JSON Schema can bound (strings, arrays, integers) so a model that writes noise
# mostly closes them within max_tokens; a number's digits cannot be bounded, so an answer may
# also end at max_tokens, and then it says "length" (never "stop" on invalid JSON).
SCHEMAS: dict[str, dict[str, Any]] = {
    "nested_object": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 6},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "array_of_enums": {
        "type": "array",
        "items": {"enum": ["red", "green", "blue"]},
        "minItems": 1,
        "maxItems": 4,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "score": {"type": "number", "minimum": -1, "maximum": 1},
            "ok": {"type": "boolean"},
        },
        "required": ["age", "score", "ok"],
        "additionalProperties": False,
    },
    "pattern_strings": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "kind": {"const": "user"},
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 4},
                "maxItems": 2,
            },
        },
        "required": ["id", "kind", "tags"],
        "additionalProperties": False,
    },
    "any_of": {
        "anyOf": [
            {"type": "integer", "minimum": 0, "maximum": 9},
            {"type": "string", "enum": ["none"]},
        ]
    },
}


engine, client = tiny_app_fixtures()


def _chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Answer."}], **kw}


def _schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}


# ---- json_schema / json_object -----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_json_schema_answer_parses_and_validates(client: TestClient, name: str) -> None:
    schema = SCHEMAS[name]
    body = _chat(
        response_format=_schema_format(schema), n=3, temperature=1.0, seed=7, max_tokens=120
    )
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    finishes = [c["finish_reason"] for c in r.json()["choices"]]
    assert "stop" in finishes and set(finishes) <= {"stop", "length"}, finishes
    for choice in r.json()["choices"]:
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_completions_structured_outputs_json_and_json_object(client: TestClient) -> None:
    schema = SCHEMAS["nested_object"]
    for so, check in (
        ({"json": schema}, lambda v: jsonschema.validate(v, schema)),
        ({"json": json.dumps(schema)}, lambda v: jsonschema.validate(v, schema)),
        ({"json_object": True}, lambda v: isinstance(v, dict)),
    ):
        body = {
            "model": MODEL,
            "prompt": "x",
            "max_tokens": 60,
            "temperature": 0,
            "structured_outputs": so,
        }
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        if choice["finish_reason"] == "stop":
            assert check(json.loads(choice["text"])) is not False
        else:  # json_object has no bound: cut off, and said so (never claimed complete)
            assert so == {"json_object": True} and choice["finish_reason"] == "length"


def test_truncated_answer_says_length_not_stop(client: TestClient) -> None:
    body = _chat(response_format=_schema_format(SCHEMAS["nested_object"]), max_tokens=3)
    r = client.post("/v1/chat/completions", json=body)
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice["message"]["content"])


# ---- choice / regex / grammar --------------------------------------------------------------------


def test_choice_regex_and_grammar_answers_match(client: TestClient) -> None:
    choices = ["yes", "no", "maybe (later)", "a.b|c"]
    cases = [
        ({"choice": choices}, lambda t: t in choices),
        ({"regex": r"[a-z]{2,5}-[0-9]{1,3}"}, re.compile(r"[a-z]{2,5}-[0-9]{1,3}").fullmatch),
        (
            {"grammar": 'start: "ab" | "cd" NUM\nNUM: /[0-9]{2}/'},
            re.compile(r"ab|cd[0-9]{2}").fullmatch,
        ),
        ({"grammar": 'root ::= "x" [0-9] "y"'}, re.compile(r"x[0-9]y").fullmatch),
    ]
    for so, ok in cases:
        body = {
            "model": MODEL,
            "prompt": "pick",
            "max_tokens": 30,
            "temperature": 1.0,
            "seed": 3,
            "n": 4,
            "structured_outputs": so,
        }
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, (so, r.text)
        for c in r.json()["choices"]:
            assert c["finish_reason"] == "stop" and ok(c["text"]), (so, c)


# ---- streaming, stop strings, logprobs, the official client --------------------------------------


def test_stream_with_stop_string_and_logprobs(client: TestClient) -> None:
    schema = SCHEMAS["array_of_enums"]
    body = _chat(
        response_format=_schema_format(schema),
        stream=True,
        logprobs=True,
        top_logprobs=2,
        max_tokens=60,
        temperature=0,
    )
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    chunks = sse_json(r.text)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    jsonschema.validate(json.loads(text), schema)
    lps = [
        x
        for c in chunks
        if c["choices"] and c["choices"][0]["logprobs"]
        for x in c["choices"][0]["logprobs"]["content"]
    ]
    assert lps and all(len(x["top_logprobs"]) == 2 for x in lps)
    # A stop string still cuts the answer (and says stop): the client asked for both.
    body = {
        "model": MODEL,
        "prompt": "x",
        "max_tokens": 40,
        "temperature": 0,
        "stop": ["e"],
        "structured_outputs": {"choice": ["abcdef"]},
    }
    (c,) = client.post("/v1/completions", json=body).json()["choices"]
    assert c == {**c, "text": "abcd", "finish_reason": "stop"}


def test_official_openai_client_parses_answer_and_stream(client: TestClient) -> None:
    oa = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)
    schema = SCHEMAS["pattern_strings"]
    rf = _schema_format(schema)
    out = oa.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        response_format=rf,
        max_tokens=60,
        temperature=0,
    )
    jsonschema.validate(json.loads(out.choices[0].message.content or ""), schema)
    stream = oa.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        response_format=rf,
        max_tokens=60,
        temperature=0,
        stream=True,
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == out.choices[0].message.content


# ---- bad input ------------------


@pytest.mark.parametrize(
    "field, value, code",
    [
        ("response_format", {"type": "xml"}, "invalid_value"),
        ("response_format", {"type": "json_schema"}, "invalid_value"),
        ("response_format", _schema_format({"type": "nonsense"}), "invalid_grammar"),
        (
            "response_format",
            _schema_format({"type": "array", "uniqueItems": True}),
            "unsupported_schema_keyword",
        ),
        (
            "response_format",
            _schema_format({"type": "string", "description": "x" * MAX_SPEC_BYTES}),
            "grammar_too_large",
        ),
        ("structured_outputs", {"regex": "(a"}, "invalid_grammar"),
        ("structured_outputs", {"grammar": "start: nowhere"}, "invalid_grammar"),
        # Found by fuzzing (tests/fuzz): llguidance's GBNF reader raises a bare Exception on a
        # malformed grammar or a missing rule, which was a 500.
        ("structured_outputs", {"grammar": 'root ::= "a'}, "invalid_grammar"),
        ("structured_outputs", {"grammar": 'x ::= "a"'}, "invalid_grammar"),
        ("structured_outputs", {"choice": []}, "invalid_value"),
        ("structured_outputs", {"regex": "a", "choice": ["a"]}, "invalid_value"),
        ("structured_outputs", {"structural_tag": "{}"}, "unsupported_parameter"),
        ("guided_json", {"type": "object"}, "unsupported_parameter"),
    ],
)
def test_bad_constraints_get_a_400(client: TestClient, field: str, value: Any, code: str) -> None:
    r = client.post("/v1/chat/completions", json=_chat(max_tokens=4, **{field: value}))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == code, r.text


def test_pathological_regex_is_bounded_and_others_are_served(client: TestClient) -> None:
    """Compiled lazily and within llguidance's fuel: each token's mask is bounded work, so the
    request ends (answer, length or a grammar_error 400) and a free request beside it is served."""
    bad = {
        "model": MODEL,
        "prompt": "x",
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 1,
        "structured_outputs": {"regex": "(a|aa)*(b{1000}){1000}c"},
    }
    r = client.post("/v1/completions", json=bad)
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert r.json()["error"]["code"] in ("grammar_error", "grammar_too_large")
    ok = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4})
    assert ok.status_code == 200, ok.text


# ---- engine level: batch exactness, preemption, the mask's twin, PD params -----------------------


def _run(
    engine: Engine,
    reqs: list[GenerateRequest],
    preempt_after: int | None = None,
) -> dict[str, list[int]]:
    """Submit all, then step the (not started) engine by hand: one batch, deterministically."""
    outs: dict[str, list[RequestOutput]] = {r.request_id: [] for r in reqs}
    for r in reqs:
        assert not hasattr(engine.submit(r, outs[r.request_id].append), "code")
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        assert steps < 500, "engine did not finish"
        if preempt_after is not None and steps == preempt_after:
            for seq in list(engine.scheduler.running):
                if seq.matcher is not None and seq.status is SeqStatus.RUNNING:
                    engine.scheduler._preempt(seq)  # recompute: its tokens (and grammar) stay
    done = {}
    for rid, os_ in outs.items():
        assert os_ and os_[-1].finished, rid
        done[rid] = [t for o in os_ for t in o.new_token_ids]
    return done


@pytest.fixture(scope="module")
def stepped() -> Engine:
    return Engine(EngineConfig(model=str(TINY), kv_pool_tokens=4096, context_length=512))


def _reqs(engine: Engine, constrained: bool, tag: str) -> list[GenerateRequest]:
    c = Constraint.json_schema(SCHEMAS["nested_object"]) if constrained else None
    prompts = ["one two", "three", "four five six", "seven"]
    out = []
    for i, p in enumerate(prompts):
        sp = SamplingParams(
            max_tokens=40, temperature=0.0, logprobs=1, constraint=c if i % 2 else None
        )
        out.append(GenerateRequest(f"{tag}{i}", "t", tuple(engine.tokenizer.encode(p)), sp))
    return out


def test_free_rows_are_token_exact_beside_constrained_rows(stepped: Engine) -> None:
    base = _run(stepped, _reqs(stepped, False, "a"))
    mixed = _run(stepped, _reqs(stepped, True, "b"))
    for i in (0, 2):  # the free rows of the same batch
        assert mixed[f"b{i}"] == base[f"a{i}"]
    for i in (1, 3):
        text = stepped.tokenizer.decode(mixed[f"b{i}"])
        jsonschema.validate(json.loads(text), SCHEMAS["nested_object"])


def test_preempted_constrained_rows_keep_their_grammar(stepped: Engine) -> None:
    out = _run(stepped, _reqs(stepped, True, "p"), preempt_after=6)
    assert stepped.scheduler.num_preemptions >= 2
    for i in (1, 3):
        jsonschema.validate(
            json.loads(stepped.tokenizer.decode(out[f"p{i}"])), SCHEMAS["nested_object"]
        )


def test_twin_without_the_mask_the_row_fails_closed_not_invalid() -> None:
    faults = Faults()
    e = Engine(EngineConfig(model=str(TINY), kv_pool_tokens=4096, context_length=512), faults)
    sink: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
    sp = SamplingParams(
        max_tokens=20, temperature=0.0, constraint=Constraint.json_schema(SCHEMAS["nested_object"])
    )
    req = GenerateRequest("tw", "t", tuple(e.tokenizer.encode("hi")), sp)
    with faults.injected("skip_grammar_mask"):
        e.submit(req, sink.put)
        for _ in range(50):
            if not e.has_work():
                break
            e.step()
    last = sink.get_nowait()
    assert last.finish_reason is not None and last.finish_reason.value == "error"
    assert last.error_code == "grammar_error" and last.error_status == 400


def test_grammar_cache_is_per_tenant(engine: Engine) -> None:
    """A cache hit is observable by timing, so one tenant's schema never warms another's."""
    c = Constraint(ConstraintKind.REGEX, "per-tenant-[0-9]{3}")
    before = engine.grammars.compiles
    engine.grammars.matcher(c, "tenant-a")
    engine.grammars.matcher(c, "tenant-a")
    assert engine.grammars.compiles == before + 1
    engine.grammars.matcher(c, "tenant-b")
    assert engine.grammars.compiles == before + 2


def test_no_tokenizer_means_no_grammar() -> None:
    """--skip-tokenizer-init: nothing maps a grammar to tokens, so a constraint is a 400."""
    from kvfence.structured.grammar import GrammarError, Grammars

    with pytest.raises(GrammarError) as err:
        Grammars(None, 2048, [2]).matcher(Constraint(ConstraintKind.REGEX, "a"), "t")
    assert err.value.code == "unsupported_parameter"


def test_constraint_travels_in_reserve_sampling_params() -> None:
    """PD: prefill samples token 1, so RESERVE's sampling dict carries the constraint."""
    sp = SamplingParams(max_tokens=5, constraint=Constraint(ConstraintKind.REGEX, "[ab]+"))
    wire = json.loads(json.dumps(sp.to_dict()))
    assert SamplingParams.from_dict(wire) == sp
    assert SamplingParams.from_dict(SamplingParams(max_tokens=5).to_dict()).constraint is None
    with pytest.raises((TypeError, ValueError)):
        SamplingParams.from_dict({**wire, "constraint": {"kind": "sql", "value": "x"}})


def test_pd_prefill_masks_token_one_and_decode_continues_the_grammar() -> None:
    """PD: prefill samples the first token under the constraint from RESERVE's sampling params;
    decode's matcher replays it and constrains the rest. An unmasked first token would fail
    decode's grammar (grammar_error), so a valid answer shows both sides applied it."""
    from pd_harness import PDPair, finished_ok

    pd = PDPair(str(TINY), kv_pool_tokens=2048, context_length=256)
    try:
        tok = pd.decode.engine.tokenizer
        schema = SCHEMAS["nested_object"]
        cases = [
            (Constraint.json_schema(schema), lambda t: jsonschema.validate(json.loads(t), schema)),
            (
                Constraint.choice(["zebra crossing", "yak"]),
                lambda t: t in ("zebra crossing", "yak"),
            ),
        ]
        for constraint, check in cases:
            sp = SamplingParams(max_tokens=60, temperature=1.0, seed=4, constraint=constraint)
            for r in pd.generate([tok.encode("a b c"), tok.encode("d")], sp):
                assert finished_ok(r) and r.final is not None, r.final
                assert r.final.finish_reason.value == "stop", r.final
                assert check(r.text) is not False, r.text
        assert pd.wait_idle()
    finally:
        pd.close()
