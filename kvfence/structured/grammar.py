"""Grammar compilation with llguidance: one bounded LRU cache of compiled grammars per engine,
compiled in the submitting thread under size, fuel and time bounds, and the per-sequence
Matcher whose state advances token by token.

Why llguidance (benchmarks/RESULTS.md "Grammar engines"): compiling is lazy (~1 ms for a JSON schema
where outlines-core builds a whole regex x vocabulary index up front), every resource it may
spend is capped by explicit fuel limits (a tenant's pathological schema ends in an error, not a
stall), its per-token mask cost on this CPU is tens of microseconds, and the wheel needs nothing
else (xgrammar pulls triton and a second FFI runtime).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import llguidance
import torch
from llguidance.gbnf_to_lark import any_to_lark

from kvfence.structured.spec import Constraint, ConstraintKind

MAX_SPEC_BYTES = 64 * 1024  # a schema/regex/grammar larger than this is refused unread
COMPILE_TIMEOUT_S = 10.0  # wall bound on one compile (the fuel limits bound the work itself)
CACHE_ENTRIES = 256
# llguidance's resource caps, tighter than its defaults: compile fuel and grammar size bound the
# compile; step fuel and items bound every token's mask, so no row can stall a batch.
LIMITS = dict(
    initial_lexer_fuel=500_000,
    step_lexer_fuel=200_000,
    step_max_items=50_000,
    max_lexer_states=50_000,
    max_grammar_size=200_000,
    verbose_errors=False,  # errors must not carry parser state (or another tenant's bytes)
)
# Compact JSON with a space after ':' and ',': what models are trained to write, and no
# free whitespace a model could emit forever.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_REGEX_META = re.compile(r"([\\.+*?()|\[\]{}^$#&\-~])")


class GrammarError(ValueError):
    """A constraint that cannot be compiled: the client's 400."""

    def __init__(self, message: str, code: str = "invalid_grammar") -> None:
        super().__init__(message)
        self.code = code


class Matcher:
    """One sequence's position in its grammar."""

    def __init__(self, inner: llguidance.LLMatcher) -> None:
        self.inner = inner

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False: it broke the grammar (or a step limit hit)."""
        return bool(self.inner.consume_token(token_id))

    @property
    def done(self) -> bool:
        """Nothing but end-of-sequence can follow: the answer is complete."""
        return bool(self.inner.is_stopped())

    def error(self) -> str:
        return _first_line(self.inner.get_error()) or "the output left the grammar"


class Grammars:
    """Compiles constraints for one tokenizer/vocabulary and caches the results (LRU)."""

    def __init__(
        self, tokenizer_json: str | None, vocab_size: int, eos_token_ids: list[int]
    ) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._tok: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, Constraint], llguidance.LLMatcher] = OrderedDict()
        # Two compile threads: a burst of novel schemas queues here, never on the step loop.
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="kvfence-grammar")
        self._executor: llguidance.LLExecutor | None = None
        self._masker = ThreadPoolExecutor(1, thread_name_prefix="kvfence-mask")
        self.compiles = 0  # cache misses, for tests and metrics

    def matcher(self, c: Constraint, tenant: str) -> Matcher:
        """A fresh matcher for c; compiles (bounded) on a cache miss. Raises GrammarError.
        The cache is per tenant: a hit is ~30x faster than a compile, and one tenant must not
        learn by timing which schemas another sends (the prefix cache's rule, DESIGN.md)."""
        if self._tokenizer_json is None:
            raise GrammarError(
                "structured outputs need the model's tokenizer; this server runs with "
                "--skip-tokenizer-init",
                "unsupported_parameter",
            )
        key = (tenant, c)
        with self._lock:
            pristine = self._cache.get(key)
            if pristine is not None:
                self._cache.move_to_end(key)
                return Matcher(pristine.deep_copy())
        try:
            size = len(c.value.encode())
        except UnicodeEncodeError:  # a lone surrogate, which JSON's \u escapes can spell
            raise GrammarError(f"the {c.kind.value} is not valid Unicode text") from None
        if size > MAX_SPEC_BYTES:
            raise GrammarError(
                f"the {c.kind.value} is {size} bytes; at most {MAX_SPEC_BYTES} are allowed",
                "grammar_too_large",
            )
        future = self._pool.submit(self._compile, c)
        try:
            pristine = future.result(timeout=COMPILE_TIMEOUT_S)
        except FutureTimeout:
            raise GrammarError(
                f"compiling the {c.kind.value} took longer than {COMPILE_TIMEOUT_S:g} s",
                "grammar_too_large",
            ) from None
        with self._lock:
            self._cache[key] = pristine
            self._cache.move_to_end(key)
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return Matcher(pristine.deep_copy())

    def _tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tok is None:  # ~0.5 s for a large vocabulary: only when first needed
                assert self._tokenizer_json is not None
                self._tok = llguidance.LLTokenizer(
                    self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self._eos
                )
            return self._tok

    def _compile(self, c: Constraint) -> llguidance.LLMatcher:
        grammar = _llg_grammar(c)
        self.compiles += 1
        m = llguidance.LLMatcher(
            self._tokenizer(), grammar, log_level=0, limits=llguidance.LLParserLimits(**LIMITS)
        )
        if not m.is_error():
            m.compute_bitmask()  # the first token's mask: where a pathological lexer blows up
        if m.is_error():
            err = _first_line(m.get_error())
            code = "invalid_grammar"
            if "limit" in err.lower() or "too " in err.lower():
                code = "grammar_too_large"
            elif "unimplemented" in err.lower():
                code = "unsupported_schema_keyword"
            raise GrammarError(f"invalid {c.kind.value}: {err}", code)
        return m

    def fill_bitmask_async(
        self, rows: list[tuple[Matcher, int]], batch: int
    ) -> Future[torch.Tensor]:
        """fill_bitmask on a helper thread, so the step overlaps it with the forward pass."""
        return self._masker.submit(self.fill_bitmask, rows, batch)

    def fill_bitmask(self, rows: list[tuple[Matcher, int]], batch: int) -> torch.Tensor:
        """[batch, ceil(V/32)] int32 allowed-token bits; rows not listed allow everything.
        The constrained rows are filled in parallel by llguidance's own threads."""
        bitmask = torch.full((batch, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=2)
        # llguidance.torch wraps this call, but importing it compiles a kernel via torch._dynamo.
        width = bitmask.shape[1] * bitmask.element_size()
        self._executor.unsafe_compute_mask_ptr(
            [(m.inner, i) for m, i in rows], bitmask.data_ptr(), width, batch
        )
        return bitmask


def _llg_grammar(c: Constraint) -> str:
    try:
        if c.kind is ConstraintKind.JSON_SCHEMA:
            schema = json.loads(c.value)
            if not isinstance(schema, dict):
                raise GrammarError("a JSON schema must be an object", "invalid_json_schema")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if c.kind is ConstraintKind.JSON_OBJECT:
            return llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=JSON_OPTIONS
            )
        if c.kind is ConstraintKind.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(c.value)
        if c.kind is ConstraintKind.CHOICE:
            options = json.loads(c.value)
            return llguidance.LLMatcher.grammar_from_regex(
                "|".join(_REGEX_META.sub(r"\\\1", o) for o in options)
            )
        return llguidance.LLMatcher.grammar_from_lark(_to_lark(c.value))
    except GrammarError:
        raise
    except (ValueError, TypeError, RecursionError) as e:
        raise GrammarError(f"invalid {c.kind.value}: {_first_line(str(e))}") from e


def _to_lark(text: str) -> str:
    try:
        return any_to_lark(text)
    except Exception as e:  # noqa: BLE001 - llguidance's GBNF reader raises bare Exception
        raise GrammarError(f"invalid grammar: {_first_line(str(e))}") from e


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0][:500] if text.strip() else ""
