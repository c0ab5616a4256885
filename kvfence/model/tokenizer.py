"""Tokenizer: tokenizer.json via `tokenizers`, chat templates via a sandboxed jinja2, and
incremental detokenization for streaming."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from kvfence.model.config import UnsupportedModelError

if TYPE_CHECKING:
    from kvfence.config import EngineConfig


class ChatTemplateError(ValueError):
    """The messages could not be rendered by the model's chat template."""


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


class Tokenizer:
    has_text = True  # NoTokenizer's is False

    def __init__(self, model_dir: str | Path, *, special_tokens_in_chat: bool = False) -> None:
        """special_tokens_in_chat: let control-token text typed in chat message content become
        control tokens (an operator's opt-in; off, a user cannot forge a turn or an EOS)."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise UnsupportedModelError(
                f"{model_dir}: no tokenizer.json (--skip-tokenizer-init serves token-id prompts "
                "without one)"
            )
        self._tok = HFTokenizer.from_file(str(path))
        # A second instance that reads special-token text as plain text (the tokenizers
        # library's split-special-tokens mode); a flag flipped on a shared instance would race
        # between request threads.
        self._literal = HFTokenizer.from_file(str(path))
        self._literal.encode_special_tokens = True
        self.special_tokens_in_chat = special_tokens_in_chat
        self._specials = sorted(
            (t.content for t in self._tok.get_added_tokens_decoder().values() if t.special),
            key=len,
            reverse=True,
        )
        cfg_path = model_dir / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self.add_bos_token = bool(cfg.get("add_bos_token", False))
        template = cfg.get("chat_template")
        tpl_file = model_dir / "chat_template.jinja"
        if template is None and tpl_file.is_file():
            template = tpl_file.read_text()
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(template) if template else None
        self.eos_token_ids: set[int] = set()
        if (
            self.eos_token is not None
            and (tid := self._tok.token_to_id(self.eos_token)) is not None
        ):
            self.eos_token_ids.add(tid)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def backend_json(self) -> str:
        """The tokenizer as tokenizer.json text (what the grammar engine builds its trie from)."""
        return self._tok.to_str()

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and self.bos_token is not None:
            bos = self._tok.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """tools: OpenAI tool definitions, handed to the template as transformers does."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                tools=tools,
            )
        except TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Render and encode a conversation. Control-token text inside message content is
        encoded as plain text unless the operator opted in; the template's own control tokens
        stay control tokens. Content without such text encodes exactly as the whole render."""
        if tools and not self.special_tokens_in_chat:
            spec = json.dumps(tools, ensure_ascii=False)
            if any(sp in spec for sp in self._specials):
                # No marker swap for template-walked tool schemas: refuse, never forge a turn.
                raise ChatTemplateError("tool definitions must not contain control-token text")
        if self.special_tokens_in_chat or not any(
            sp in c for c in _contents(messages) for sp in self._specials
        ):
            text = self.apply_chat_template(messages, add_generation_prompt, tools)
            # The template already wrote BOS and friends: encoding must not add them twice.
            return self.encode(text, add_special_tokens=False)
        # Swap each typed control token for a marker no client can guess, render, then encode
        # the template's text normally and each marker as the literal text it replaced.
        nonce = secrets.token_hex(8)
        typed: list[str] = []
        pattern = re.compile("|".join(re.escape(sp) for sp in self._specials))

        def mark(m: re.Match[str]) -> str:
            typed.append(m.group(0))
            return f"\ue000{nonce}:{len(typed) - 1}\ue001"

        masked = [_map_content(msg, lambda c: pattern.sub(mark, c)) for msg in messages]
        text = self.apply_chat_template(masked, add_generation_prompt, tools)
        ids: list[int] = []
        marker = re.compile(f"\ue000{nonce}:(\\d+)\ue001")
        pos = 0
        for m in marker.finditer(text):
            ids += self._tok.encode(text[pos : m.start()], add_special_tokens=False).ids
            literal = typed[int(m.group(1))]
            ids += self._literal.encode(literal, add_special_tokens=False).ids
            pos = m.end()
        ids += self._tok.encode(text[pos:], add_special_tokens=False).ids
        return ids


def _contents(messages: list[dict[str, Any]]) -> list[str]:
    out: list[str] = []
    for msg in messages:
        _map_content(msg, lambda c: out.append(c) or c)
    return out


def _map_content(msg: dict[str, Any], f: Any) -> dict[str, Any]:
    """msg with f applied to every piece of text content (a string, or OpenAI's text parts)."""
    content = msg.get("content")
    if isinstance(content, str):
        return {**msg, "content": f(content)}
    if isinstance(content, list):
        parts = [
            {**p, "text": f(p["text"])} if isinstance(p, dict) and isinstance(p.get("text"), str)
            else p
            for p in content
        ]
        return {**msg, "content": parts}
    return msg


class TokenizerDisabled(ValueError):
    """Text was asked of a node started with --skip-tokenizer-init."""


class NoTokenizer:
    """The tokenizer of a node started with --skip-tokenizer-init (vLLM's flag): prompts are token
    ids, outputs are token ids with empty text. Anything that needs text raises, so nothing
    silently answers a text prompt with the wrong tokens."""

    has_text = False
    has_chat_template = False
    eos_token_ids: frozenset[int] = frozenset()

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise TokenizerDisabled(_DISABLED)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        raise TokenizerDisabled(_DISABLED)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""  # the detokenizer then holds nothing and emits nothing: outputs are ids only


_DISABLED = (
    "This server runs with --skip-tokenizer-init: send prompts as token ids "
    "(text prompts, chat messages and stop strings need a tokenizer)."
)


@dataclass
class IncrementalDetokenizer:
    """Emits only text that can no longer change (vLLM-style prefix/read offsets), so a
    multi-byte character split across tokens is never sent half-done."""

    tokenizer: Tokenizer | NoTokenizer
    prefix_offset: int = 0
    read_offset: int = 0

    def step(self, all_ids: list[int]) -> str:
        prefix = self.tokenizer.decode(all_ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(all_ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(all_ids)
            return full[len(prefix) :]
        return ""

    def flush(self, all_ids: list[int]) -> str:
        prefix = self.tokenizer.decode(all_ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(all_ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(all_ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""


def load_tokenizer(cfg: EngineConfig, vocab_size: int) -> Tokenizer | NoTokenizer:
    """A node's tokenizer as its flags ask (one rule for the engine and the HTTP process)."""
    if cfg.skip_tokenizer_init:
        return NoTokenizer(vocab_size)
    return Tokenizer(cfg.model, special_tokens_in_chat=cfg.special_tokens_in_chat)


def stop_token_ids(
    model_dir: Path, config_ids: tuple[int, ...], tokenizer: Tokenizer | NoTokenizer
) -> frozenset[int]:
    """Every id that ends an answer: config.json's, the tokenizer's and generation_config.json's
    eos ids (checkpoints spread them over all three)."""
    ids = set(config_ids) | set(tokenizer.eos_token_ids)
    gen_cfg = model_dir / "generation_config.json"
    if gen_cfg.is_file():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        ids |= set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())
    return frozenset(ids)
