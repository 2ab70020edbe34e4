"""A model's tokenizer and chat templates, read from a local directory the way transformers v5 reads it.

vLLM loads tokenizers with ``transformers.AutoTokenizer``; for a ``tokenizer.json`` tokenizer that is
``TokenizersBackend`` (the old ``PreTrainedTokenizerFast``), which wraps a ``tokenizers.Tokenizer`` and
changes it in a few ways that decide the token ids. This module applies the same changes, and nothing
else, so that encoding with the ``tokenizers`` library directly gives the ids vLLM computes:

- BOS/EOS come from tokenizer.json's post-processor only: with a tokenizer.json, transformers v5 drops
  ``add_bos_token`` / ``add_eos_token`` from tokenizer_config.json before building the tokenizer
  (``PreTrainedTokenizerBase._from_pretrained``), so a tokenizer.json without a post-processor adds
  nothing even when the config says ``add_bos_token: true`` (checked against transformers 5.19).
- Tokens of ``added_tokens_decoder`` and named special tokens missing from tokenizer.json are added.
- ``split_special_tokens: true``: special tokens in text are encoded as text.
- Truncation and padding baked into tokenizer.json are switched off (vLLM overrides them per request).
- Named special tokens (``bos_token``, ``eos_token``, ...) become template variables; legacy
  ``special_tokens_map.json`` is read when tokenizer_config.json has no ``added_tokens_decoder``.
- Chat templates: ``chat_template.jinja`` (and ``additional_chat_templates/*.jinja``) win over
  tokenizer_config.json's ``chat_template`` (a string, or a list of named templates).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from kvindex.tokenize.errors import TokenizeError

SPECIAL_TOKEN_ATTRIBUTES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Classes AutoTokenizer maps to TokenizersBackend itself, which keeps tokenizer.json's pipeline as is.
# Model-specific classes (LlamaTokenizer, Qwen2Tokenizer, ...) rebuild normalizer and pre-tokenizer in
# their own __init__; for most models that equals tokenizer.json, but it is not checked here.
GENERIC_CLASSES = frozenset({"", "PreTrainedTokenizerFast", "TokenizersBackend"})

log = structlog.get_logger("kvindex.tokenize")


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizeError(f"{path}: cannot read: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizeError(f"{path}: expected a JSON object")
    return data


@dataclass
class ModelTokenizer:
    """What encoding one model's prompts needs: the backend tokenizer, template variables, templates."""

    model: str
    path: Path
    tokenizer: Any  # tokenizers.Tokenizer
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token -> "<s>", ...
    templates: dict[str, str] = field(default_factory=dict)  # name -> Jinja source; "default" first
    tokenizer_class: str = ""

    def template(self, tools: bool) -> str:
        """The template transformers' ``get_chat_template`` picks: "tool_use" when tools are given and
        there is one, else "default" (or the only template)."""
        if not self.templates:
            raise TokenizeError(
                f"model {self.model!r} has no chat template ({self.path} has no chat_template.jinja and no "
                "chat_template in tokenizer_config.json); send a prompt instead of messages"
            )
        if len(self.templates) == 1 and "default" in self.templates:
            return self.templates["default"]
        if tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        raise TokenizeError(
            f"model {self.model!r} has several chat templates and none named 'default': "
            f"{', '.join(sorted(self.templates))}"
        )


def _templates(path: Path, config: dict[str, Any]) -> dict[str, str]:
    templates: dict[str, str] = {}
    raw = config.get("chat_template")
    if isinstance(raw, str):
        templates["default"] = raw
    elif isinstance(raw, list):
        for item in raw:
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                templates[item["name"]] = str(item.get("template", ""))
    from_files: dict[str, str] = {}
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        from_files["default"] = jinja.read_text(encoding="utf-8")
    extra = path / "additional_chat_templates"
    if extra.is_dir():
        for file in sorted(extra.glob("*.jinja")):
            from_files[file.stem] = file.read_text(encoding="utf-8")
    # transformers: templates saved as files replace the config's (init_kwargs["chat_template"]).
    return from_files or templates


def load_model_tokenizer(model: str, directory: str | Path) -> ModelTokenizer:
    """Read ``tokenizer.json`` and ``tokenizer_config.json`` (and template files) from ``directory``."""
    from tokenizers import AddedToken, Tokenizer

    path = Path(directory)
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        raise TokenizeError(
            f"{path}: no tokenizer.json (kvindex reads the fast-tokenizer file vLLM reads; models shipping "
            "only a sentencepiece or tiktoken file need it exported once with transformers' save_pretrained)"
        )
    config = _read_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").is_file() else {}
    try:
        tok = Tokenizer.from_file(str(tok_file))
    except Exception as exc:  # the Rust side raises its own exception type
        raise TokenizeError(f"{tok_file}: cannot load: {exc}") from exc
    tok.no_truncation()
    tok.no_padding()

    named: dict[str, Any] = {attr: config.get(attr) for attr in SPECIAL_TOKEN_ATTRIBUTES if attr in config}
    if "added_tokens_decoder" not in config and (path / "special_tokens_map.json").is_file():
        legacy = _read_json(path / "special_tokens_map.json")
        named.update({k: v for k, v in legacy.items() if k in SPECIAL_TOKEN_ATTRIBUTES})
    special_tokens = {k: t for k, v in named.items() if (t := _token_text(v)) is not None}

    # Tokens the config declares but tokenizer.json lacks, added as TokenizersBackend.__init__ adds them.
    to_add = []
    decoder = config.get("added_tokens_decoder")
    if isinstance(decoder, dict):
        for _idx, spec in sorted(decoder.items(), key=lambda kv: int(kv[0]) if str(kv[0]).isdigit() else 0):
            content = spec.get("content") if isinstance(spec, dict) else None
            if isinstance(content, str) and tok.token_to_id(content) is None:
                fields = ("single_word", "lstrip", "rstrip", "normalized", "special")
                to_add.append(AddedToken(content, **{k: bool(spec[k]) for k in fields if k in spec}))
    for text in special_tokens.values():
        if tok.token_to_id(text) is None and all(t.content != text for t in to_add):
            to_add.append(AddedToken(text, special=True, normalized=False))
    if to_add:
        tok.add_tokens(to_add)

    if config.get("split_special_tokens"):
        tok.encode_special_tokens = True

    tokenizer_class = str(config.get("tokenizer_class") or "")
    if tokenizer_class.removesuffix("Fast") not in GENERIC_CLASSES and tokenizer_class not in GENERIC_CLASSES:
        log.warning(
            "tokenizer_class_not_checked",
            model=model,
            tokenizer_class=tokenizer_class,
            note="transformers rebuilds this class's pre-tokenizer in code; kvindex uses tokenizer.json "
            "as written. Check a few prompts against the engine's /tokenize (docs/tokenize.md).",
        )
    return ModelTokenizer(
        model=model,
        path=path,
        tokenizer=tok,
        special_tokens=special_tokens,
        templates=_templates(path, config),
        tokenizer_class=tokenizer_class,
    )
