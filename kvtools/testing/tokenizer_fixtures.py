"""Small real tokenizers made on the spot with the Hugging Face ``tokenizers`` library, saved as a model
directory the way ``transformers`` writes one (``tokenizer.json`` + ``tokenizer_config.json``, optionally
``chat_template.jinja``), with a chat template in one of the common families.

Used by the test suite (tests/*/test_tokenize*.py) and by ``e2e/make_model.py`` (the tiny model the real
vLLM serves), so the tokenizer checked against the engine is built by the same code the tests use.
Nothing is downloaded: the BPE merges are trained on a generated corpus in well under a second.

Styles:

- ``llama3``: byte-level BPE with Llama 3's pre-tokenizer regex, a post-processor adding
  ``<|begin_of_text|>`` (BOS), header/end-of-turn special tokens and a Llama-3-style template that
  writes the BOS text itself; ``chat_template`` in tokenizer_config.json.
- ``chatml``: byte-level BPE with Qwen 2's regex, no BOS, ``<|im_start|>``/``<|im_end|>`` and a
  ChatML template with tool support, in ``chat_template.jinja``.
- ``sentencepiece``: a Metaspace BPE (Llama 2 / Mistral family, ``prepend_scheme: first``) whose
  ``tokenizer_config.json`` says ``add_bos_token: true`` while tokenizer.json has no post-processor
  (transformers v5 then adds no BOS: the flag is ignored when tokenizer.json exists), and an
  ``[INST]`` template.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

STYLES = ("llama3", "chatml", "sentencepiece")

# Llama 3's and Qwen 2's pre-tokenizer patterns (the regexes their tokenizer.json files carry).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
]
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SP_SPECIALS = ["<unk>", "<s>", "</s>"]

# Llama 3.1's template, shortened (no tool-call or date handling) but with the same structure: the BOS
# text first, a header per message, content trimmed, <|eot_id|> after each, the assistant header last.
LLAMA3_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content'] | trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system_message = '' %}\n"
    "{%- endif %}\n"
    "{%- if system_message or tools is not none %}\n"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}\n"
    "{%- if tools is not none %}\n"
    "{{- 'You may call these functions:\\n\\n' }}\n"
    "{%- for t in tools %}\n"
    "{{- t | tojson(indent=4) }}\n"
    "{{- '\\n\\n' }}\n"
    "{%- endfor %}\n"
    "{%- endif %}\n"
    "{{- system_message }}\n"
    "{{- '<|eot_id|>' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

# Qwen 2.5's template, shortened: tools as JSON lines in the system turn, tool calls as <tool_call>
# blocks, tool results grouped in a user turn; content iterated when it is a list of parts.
CHATML_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    "    {{- '\\n\\n# Tools\\n\\n<tools>' }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- '\\n' }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- '\\n</tools><|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- elif default_system is defined %}\n"
    "        {{- '<|im_start|>system\\n' + default_system + '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == 'assistant' %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
    "            {{- tool_call.name }}\n"
    '            {{- \'", "arguments": \' }}\n'
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == 'tool' %}\n"
    "        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

# Mistral-style: the BOS text from the template, [INST] blocks, EOS after each assistant reply.
SP_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
    "        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}\n"
    "    {%- endif %}\n"
    "    {%- if message['role'] == 'user' %}\n"
    "        {{- '[INST] ' + message['content'] + ' [/INST]' }}\n"
    "    {%- elif message['role'] == 'assistant' %}\n"
    "        {{- message['content'] + eos_token }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
)

_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "with",
    "was",
    "on",
    "be",
    "by",
    "this",
    "are",
    "from",
    "at",
    "or",
    "an",
    "have",
    "not",
    "which",
    "one",
    "cache",
    "block",
    "token",
    "prompt",
    "request",
    "instance",
    "router",
    "engine",
    "prefix",
    "index",
    "score",
    "model",
    "worker",
    "event",
    "system",
    "user",
    "assistant",
    "tool",
    "function",
    "call",
    "result",
    "message",
    "hello",
    "world",
    "please",
    "explain",
    "how",
    "why",
    "what",
    "time",
    "first",
    "latency",
    "queue",
    "prefill",
    "decode",
    "memory",
    "tier",
    "gpu",
    "cpu",
    "disk",
    "shared",
    "pool",
    "batch",
    "stream",
    "import",
    "def",
    "return",
    "class",
    "self",
    "value",
    "list",
    "dict",
    "json",
    "string",
    "number",
    "true",
    "false",
    "null",
]
_EXTRA = [
    "naïve café 東京 데이터 ünïcødé — “quotes” … ½ € 🙂 🚀",
    "def f(x):\n    return x * 2\n\n\tif x:\n\t\tpass\n",
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}',
    "1234567890 3.14159 2026-12-01 10:30:00 #42 @user https://example.org/a?b=c",
    "   leading spaces and trailing   \n\n\nmany newlines\r\nwindows line\n",
]


def corpus(n_lines: int = 3000, seed: int = 0) -> list[str]:
    """Deterministic training text: English-like word salad, code, JSON, digits and Unicode."""
    rng = random.Random(seed)
    # Pseudo-words from syllables, so that the merges fill a vocabulary of about a thousand.
    syllables = [c + v for c in "bcdfghklmnprstvwz" for v in "aeiou"]
    vocab = _WORDS + ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(1500)]
    lines = []
    for i in range(n_lines):
        words = rng.choices(vocab, k=rng.randint(3, 18))
        if rng.random() < 0.3:
            words[0] = words[0].capitalize()
        line = " ".join(words) + rng.choice([".", ",", "?", "!", ":", ""])
        if i % 7 == 0:
            line += " " + _EXTRA[i % len(_EXTRA)]
        lines.append(line)
    return lines


def _byte_level_bpe(pattern: str, specials: list[str], vocab_size: int) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        special_tokens=[],
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    # Special tokens after the trained vocabulary, as in Llama 3 and Qwen 2 (ids above the BPE ids).
    tok.add_special_tokens(specials)
    return tok


def _metaspace_bpe(specials: list[str], vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False, limit_alphabet=400
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def _added_tokens_decoder(tok: Any) -> dict[str, Any]:
    out = {}
    for idx, added in sorted(tok.get_added_tokens_decoder().items()):
        out[str(idx)] = {
            "content": added.content,
            "lstrip": added.lstrip,
            "normalized": added.normalized,
            "rstrip": added.rstrip,
            "single_word": added.single_word,
            "special": added.special,
        }
    return out


def make_tokenizer_dir(out: Path, style: str = "llama3", vocab_size: int = 1024) -> Path:
    """Write a tokenizer directory of ``style`` (see the module docstring) to ``out``; returns ``out``."""
    from tokenizers import processors

    if style not in STYLES:
        raise ValueError(f"unknown style {style!r}; one of {', '.join(STYLES)}")
    out.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
    }
    if style == "llama3":
        tok = _byte_level_bpe(LLAMA3_PATTERN, LLAMA3_SPECIALS, vocab_size)
        bos = "<|begin_of_text|>"
        tok.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{bos}:0 $A:0",
                    pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                    special_tokens=[(bos, tok.token_to_id(bos))],
                ),
            ]
        )
        config.update(bos_token=bos, eos_token="<|eot_id|>", chat_template=LLAMA3_TEMPLATE)
    elif style == "chatml":
        tok = _byte_level_bpe(QWEN2_PATTERN, CHATML_SPECIALS, vocab_size)
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        config.update(bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>")
        (out / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    else:
        tok = _metaspace_bpe(SP_SPECIALS, vocab_size)
        # No post-processor in tokenizer.json, add_bos_token in the config: no BOS (see the docstring).
        config.update(
            bos_token="<s>",
            eos_token="</s>",
            unk_token="<unk>",
            add_bos_token=True,
            add_eos_token=False,
            chat_template=SP_TEMPLATE,
        )
    config["added_tokens_decoder"] = _added_tokens_decoder(tok)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return out
