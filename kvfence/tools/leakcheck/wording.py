"""How servers word a context-length refusal, and reading the prompt's token count back from it.

Each wording names the server and the source it was read from. Some servers stop counting once
a prompt is over the limit (vLLM tokenizes with truncation at the input limit + 1), so their
count is only a lower bound: "at least N" proves the prompt is over-length, never its length."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Wording:
    server: str
    source: str  # where the wording was read (file, version)
    pattern: re.Pattern[str]
    lower_bound: bool  # the number is "at least", not the prompt's length
    example: str  # a message in this wording (README table, tests)


@dataclass(frozen=True)
class Count:
    tokens: int
    lower_bound: bool
    wording: str  # "server: source"


def _w(server: str, source: str, pattern: str, lower_bound: bool, example: str) -> Wording:
    return Wording(server, source, re.compile(pattern, re.I), lower_bound, example)


# Most specific first: the first pattern that matches decides.
WORDINGS: tuple[Wording, ...] = (
    _w(
        "vLLM",
        "vllm/renderers/params.py, 0.2x to 0.32 (VLLMValidationError appends the parameter)",
        r"prompt contains at least (\d+) input tokens",
        True,
        "This model's maximum context length is 4096 tokens. However, you requested 16 output "
        "tokens and your prompt contains at least 4097 input tokens, for a total of at least "
        "4113 tokens. Please reduce the length of the input prompt or the number of requested "
        "output tokens. (parameter=input_tokens, value=4097)",
    ),
    _w(
        "vLLM",
        "vllm/renderers/params.py, 0.2x (exact count below the truncation limit)",
        r"prompt contains (\d+) input tokens",
        False,
        "This model's maximum context length is 4096 tokens. However, you requested 64 output "
        "tokens and your prompt contains 4050 input tokens, for a total of 4114 tokens. Please "
        "reduce the length of the input prompt or the number of requested output tokens.",
    ),
    _w(
        "vLLM",
        "vllm/renderers/params.py TokenizeParams._token_len_check, main 2026 (tokenized with "
        "truncation at the input limit + 1)",
        r"You passed (\d+) input tokens",
        True,
        "You passed 4081 input tokens and requested 16 output tokens. However, the model's "
        "context length is only 4096 tokens, resulting in a maximum input length of 4080 "
        "tokens. Please reduce the length of the input prompt. (parameter=input_tokens, "
        "value=4081)",
    ),
    _w(
        "vLLM",
        "vllm/entrypoints/openai/serving_engine.py, 0.10-0.11",
        r"your request has (\d+) input tokens",
        False,
        "'max_tokens' or 'max_completion_tokens' is too large: 16. This model's maximum "
        "context length is 4096 tokens and your request has 4090 input tokens "
        "(16 > 4096 - 4090).",
    ),
    _w(
        "vLLM / OpenAI",
        "vLLM serving_engine.py before 0.10; OpenAI chat (context_length_exceeded); "
        "kvfence/engine/admission.py",
        r"(\d+) in the (?:messages|prompt|input)",
        False,
        "This model's maximum context length is 4096 tokens. However, you requested 5000 "
        "tokens (4984 in the messages, 16 in the completion). Please reduce the length of the "
        "messages or completion.",
    ),
    _w(
        "OpenAI",
        "OpenAI legacy completions (context_length_exceeded)",
        r"(\d+) in your prompt",
        False,
        "This model's maximum context length is 4097 tokens, however you requested 4200 "
        "tokens (4100 in your prompt; 100 for the completion). Please reduce your prompt; or "
        "completion length.",
    ),
    _w(
        "OpenAI",
        "OpenAI chat completions and responses (context_length_exceeded)",
        r"messages resulted in (\d+) tokens",
        False,
        "This model's maximum context length is 8192 tokens. However, your messages resulted "
        "in 8200 tokens. Please reduce the length of the messages.",
    ),
    _w(
        "SGLang",
        "python/sglang/srt/managers/tokenizer_manager.py _validate_one_request, 0.4-0.5",
        r"The input \((\d+) tokens\) is longer than the model's context length",
        False,
        "The input (4097 tokens) is longer than the model's context length (4096 tokens).",
    ),
    _w(
        "SGLang",
        "python/sglang/srt/managers/tokenizer_manager.py _validate_one_request, 0.4-0.5",
        r"(\d+) tokens from the input messages",
        False,
        "Requested token count exceeds the model's maximum context length of 4096 tokens. You "
        "requested a total of 4106 tokens: 4090 tokens from the input messages and 16 tokens "
        "for the completion. Please reduce the number of tokens in the input messages or the "
        "completion to fit within the limit.",
    ),
    _w(
        "kvfence",
        "kvfence/engine/admission.py",
        r"prompt (?:has|contains|is|of) (\d+) tokens",
        False,
        "This model's maximum context length is 1024 tokens. However, your prompt has 1309 "
        "tokens, leaving no room for a completion.",
    ),
    _w(
        "vLLM",
        "VLLMValidationError suffix alone (any vLLM wording not listed above)",
        r"parameter=input_tokens, value=(\d+)",
        True,
        "(parameter=input_tokens, value=4097)",
    ),
    _w(
        "other",
        "generic: a number right after 'input length' or 'input tokens'",
        r"input (?:length|tokens?)\D{0,12}(\d+)",
        False,
        "input length 4100 exceeds the maximum",
    ),
)


def parse_refusal(message: str) -> Count | None:
    """The prompt's token count a refusal states, and whether it is only a lower bound."""
    for w in WORDINGS:
        m = w.pattern.search(message)
        if m:
            return Count(int(m.group(1)), w.lower_bound, f"{w.server}: {w.source}")
    return None


def count_from_error(message: str) -> int | None:
    count = parse_refusal(message)
    return count.tokens if count else None


# A refusal that speaks of size. Anything else (no chat template, an unsupported parameter) is
# the server declining a feature it does not offer: legitimate, and no verdict on admission.
_LENGTH = re.compile(
    r"context|too (?:long|large|many)|exceed|maximum|max_model_len|capacity|\bpool\b|"
    r"input (?:length|tokens?)|\blength\b|\btokens\b",
    re.I,
)
# Feature refusals as servers word them, for tests and the README: none is about length.
FEATURE_REFUSALS: tuple[tuple[str, str], ...] = (
    (
        "vLLM, vllm/entrypoints/chat_utils.py (a tokenizer without a chat template)",
        "As of transformers v4.44, default chat template is no longer allowed, so you must "
        "provide a chat template if the tokenizer does not define one.",
    ),
    (
        "transformers apply_chat_template (what vLLM and SGLang pass on)",
        "Cannot use chat template functions because tokenizer.chat_template is not set and no "
        "template argument was passed! For information about writing templates and setting the "
        "tokenizer.chat_template attribute, please see the documentation at "
        "https://huggingface.co/docs/transformers/main/en/chat_templating",
    ),
    (
        "kvfence, kvfence/model/tokenizer.py",
        "The chat template rejected these messages: this model has no chat template; use "
        "/v1/completions",
    ),
)


def is_length_refusal(message: str | None) -> bool:
    """Whether a 4xx's message is about the request's size (then a refusal of a request that
    fits is wrong on its face); False for a server declining a feature it does not offer."""
    if not message:
        return False
    return parse_refusal(message) is not None or _LENGTH.search(message) is not None
