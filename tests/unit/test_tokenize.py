"""Text and chat tokenization (kvindex/tokenize) on tokenizers made here with the ``tokenizers`` library.

What "exact" means is vLLM's rule (docs/tokenize.md), checked without transformers:

- completions: the text encoded by tokenizer.json's own pipeline with special tokens added, i.e.
  ``Tokenizer.encode(text)`` of the ``tokenizers`` library, which is what transformers' fast tokenizer
  calls (BOS from the post-processor, once);
- chats: the template's text, spelled out by hand below for a fixed conversation, encoded without
  adding special tokens (the template writes BOS; vLLM's chat default add_special_tokens=False).

The same fixtures were also compared with transformers 5.19's AutoTokenizer (5400 prompts and chats,
no difference; docs/tokenize.md) and the e2e run compares with a real vLLM.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from kvindex.tokenize import ChatOptions, TokenizeError, Tokenizers
from kvindex.tokenize import cache as cache_module
from kvindex.tokenize.chat import content_format
from kvindex.tokenize.segments import LINE_START
from kvtools.testing.tokenizer_fixtures import make_tokenizer_dir


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {style: make_tokenizer_dir(root / style, style) for style in ("llama3", "chatml", "sentencepiece")}


@pytest.fixture
def toks(dirs: dict[str, Path]) -> Tokenizers:
    return Tokenizers.from_dirs({name: str(d) for name, d in dirs.items()})


@pytest.fixture(scope="module")
def shared(dirs: dict[str, Path]) -> Tokenizers:
    """One registry for every example of a property test: later examples hit pieces of earlier ones."""
    return Tokenizers.from_dirs({name: str(d) for name, d in dirs.items()}, cache_bytes=1 << 20)


_RAW: dict[Path, Tokenizer] = {}


def raw(dirs: dict[str, Path], style: str) -> Tokenizer:
    """The tokenizer.json as the tokenizers library loads it, nothing applied: the reference."""
    path = dirs[style] / "tokenizer.json"
    if path not in _RAW:
        _RAW[path] = Tokenizer.from_file(str(path))
    return _RAW[path]


CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is a prefix cache?"},
    {"role": "assistant", "content": "It keeps KV blocks of earlier prompts."},
    {"role": "user", "content": "  And why route by it?  "},
]


def test_loading_compiles_the_template_and_leaves_cache_and_stats_empty(dirs: dict[str, Path]) -> None:
    """The first request after a start must not pay the template's compile (tens of ms)."""
    from kvindex.tokenize.chat import compile_template

    compile_template.cache_clear()
    toks = Tokenizers.from_dirs({"m": str(dirs["llama3"])})
    source = toks.get("m").template(False)
    hits = compile_template.cache_info().hits
    compile_template(source)
    assert compile_template.cache_info().hits == hits + 1  # compiled at load, not by this call
    assert len(toks.cache) == 0 and toks.cache.stats.misses == 0  # the warm-up cached nothing
    assert toks.stats.requests == Counter() and toks.stats.direct_encodes == 0  # no request counted


# -- completions -------------------------------------------------------------------------------------


def test_prompt_gets_bos_once_from_the_post_processor(toks: Tokenizers, dirs: dict[str, Path]) -> None:
    tok = raw(dirs, "llama3")
    bos = tok.token_to_id("<|begin_of_text|>")
    text = "Hello world, the cache 東京 🙂\n\n  two spaces"
    ids = toks.encode_prompt("llama3", text).tolist()
    assert ids == tok.encode(text).ids
    assert ids[0] == bos and ids.count(bos) == 1
    assert tok.decode(ids[1:]) == text  # byte-level: every character is in the ids
    assert toks.encode_prompt("llama3", text, add_special_tokens=False).tolist() == ids[1:]
    # A prompt that already starts with the BOS text gets a second BOS, as in vLLM's completions API.
    twice = toks.encode_prompt("llama3", "<|begin_of_text|>hi").tolist()
    assert twice[:2] == [bos, bos]


def test_chatml_prompt_has_no_bos(toks: Tokenizers, dirs: dict[str, Path]) -> None:
    tok = raw(dirs, "chatml")
    ids = toks.encode_prompt("chatml", "hello world").tolist()
    assert ids == tok.encode("hello world", add_special_tokens=False).ids
    assert tok.decode(ids) == "hello world"


def test_add_bos_token_in_config_is_ignored_with_a_tokenizer_json(
    toks: Tokenizers, dirs: dict[str, Path]
) -> None:
    # transformers 5 drops add_bos_token/add_eos_token from tokenizer_config.json when tokenizer.json is
    # there (PreTrainedTokenizerBase._from_pretrained), and this tokenizer.json has no post-processor.
    config = json.loads((dirs["sentencepiece"] / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is True
    tok = raw(dirs, "sentencepiece")
    assert toks.encode_prompt("sentencepiece", "hello world").tolist() == tok.encode("hello world").ids
    assert tok.token_to_id("<s>") not in toks.encode_prompt("sentencepiece", "hello world").tolist()


def test_special_tokens_in_text_are_single_ids(toks: Tokenizers, dirs: dict[str, Path]) -> None:
    tok = raw(dirs, "llama3")
    eot = tok.token_to_id("<|eot_id|>")
    ids = toks.encode_prompt("llama3", "a<|eot_id|>b", add_special_tokens=False).tolist()
    assert ids == [tok.token_to_id("a"), eot, tok.token_to_id("b")]


# -- chats -------------------------------------------------------------------------------------------


def test_llama3_chat_is_the_template_text_encoded_without_adding_bos(
    toks: Tokenizers, dirs: dict[str, Path]
) -> None:
    expected = (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is a prefix cache?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nIt keeps KV blocks of earlier prompts.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nAnd why route by it?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert toks.render_chat("llama3", CHAT) == expected
    tok = raw(dirs, "llama3")
    ids = toks.encode_chat("llama3", CHAT).tolist()
    assert ids == tok.encode(expected, add_special_tokens=False).ids
    bos = tok.token_to_id("<|begin_of_text|>")
    assert ids[0] == bos and ids.count(bos) == 1  # the template's BOS, not a second one
    header = tok.encode("<|start_header_id|>assistant<|end_header_id|>\n\n", add_special_tokens=False).ids
    assert ids[-len(header) :] == header
    # vLLM's add_special_tokens=True on a chat adds the post-processor's BOS on top: two.
    both = toks.encode_chat("llama3", CHAT, add_special_tokens=True).tolist()
    assert both == [bos, *ids]


def test_generation_prompt_and_continue_final_message(toks: Tokenizers) -> None:
    no_prompt = toks.render_chat("chatml", CHAT, ChatOptions(add_generation_prompt=False))
    assert no_prompt.endswith("<|im_start|>user\n  And why route by it?  <|im_end|>\n")
    prefill = [*CHAT, {"role": "assistant", "content": "Because the"}]
    text = toks.render_chat(
        "chatml", prefill, ChatOptions(add_generation_prompt=False, continue_final_message=True)
    )
    assert text.endswith("<|im_start|>assistant\nBecause the")
    with pytest.raises(TokenizeError, match="add_generation_prompt"):
        toks.encode_chat("chatml", prefill, continue_final_message=True)  # vLLM: both true is an error


def test_chatml_tools_and_tool_calls_as_vllm_passes_them(toks: Tokenizers) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sunny"}]},
    ]
    text = toks.render_chat("chatml", msgs, ChatOptions(tools=tools))
    # The tool as ChatCompletionToolsParam.model_dump() gives it: description null, not absent.
    dumped = {
        "type": "function",
        "function": {"name": "get_weather", "description": None, "parameters": {"type": "object"}},
    }
    assert "<tools>\n" + json.dumps(dumped) + "\n</tools>" in text
    # Arguments parsed from their JSON string; the tool result's parts joined into a string.
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_content_parts_joined_or_kept_as_the_template_expects(
    toks: Tokenizers, dirs: dict[str, Path]
) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    assert "one\ntwo" in toks.render_chat("llama3", parts)
    looping = (
        "{% for message in messages %}{% for part in message['content'] %}[{{ part.type }}:{{ part.text }}]"
        "{% endfor %}{% endfor %}"
    )
    assert content_format(looping) == "openai"
    assert content_format(toks.get("llama3").templates["default"]) == "string"
    d = dirs["llama3"].parent / "looping"
    d.mkdir(exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (d / name).write_bytes((dirs["llama3"] / name).read_bytes())
    (d / "chat_template.jinja").write_text(looping)  # a template file wins over the config's template
    toks.load("looping", d)
    assert toks.render_chat("looping", parts) == "[text:one][text:two]"
    assert toks.render_chat("looping", [{"role": "user", "content": "plain"}]) == "[text:plain]"


def test_developer_role_becomes_system_when_the_template_lacks_it(toks: Tokenizers) -> None:
    msgs = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert toks.render_chat("chatml", msgs).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def test_chat_template_kwargs_reach_the_template_only_if_it_uses_them(toks: Tokenizers) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    plain = toks.render_chat("chatml", msgs)
    assert not plain.startswith("<|im_start|>system")
    custom = toks.render_chat(
        "chatml", msgs, ChatOptions(chat_template_kwargs={"default_system": "Be kind."})
    )
    assert custom.startswith("<|im_start|>system\nBe kind.<|im_end|>\n")
    ignored = ChatOptions(chat_template_kwargs={"enable_thinking": False, "default_system": None})
    assert toks.render_chat("chatml", msgs, ignored) == plain  # unused and None values are dropped
    # The request's own bos_token variable overrides the tokenizer's, as in transformers.
    swapped = toks.render_chat("llama3", msgs, ChatOptions(chat_template_kwargs={"bos_token": "<X>"}))
    assert swapped.startswith("<X><|start_header_id|>")


@pytest.mark.parametrize(
    ("model", "messages", "options", "match"),
    [
        ("nope", CHAT, ChatOptions(), "no tokenizer configured"),
        ("llama3", [], ChatOptions(), "at least one message"),
        ("llama3", {"role": "user"}, ChatOptions(), "JSON list"),
        ("llama3", [{"content": "x"}], ChatOptions(), r"messages\[0\]\.role"),
        ("llama3", [{"role": "user", "content": 5}], ChatOptions(), "content must be"),
        (
            "llama3",
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            ChatOptions(),
            "only text parts",
        ),
        ("sentencepiece", [{"role": "assistant", "content": "x"}], ChatOptions(), "roles must alternate"),
        ("llama3", CHAT, ChatOptions(chat_template_kwargs={"tokenize": True}), "may not set 'tokenize'"),
        ("llama3", CHAT, ChatOptions(tools=[{"type": "function"}]), r"tools\[0\]"),
    ],
)
def test_bad_chats_are_refused_with_the_reason(
    toks: Tokenizers, model: str, messages: object, options: ChatOptions, match: str
) -> None:
    with pytest.raises(TokenizeError, match=match):
        toks.encode_chat_options(model, messages, options)
    assert toks.stats.errors["chat"] == 1


def test_a_model_without_a_template_says_so(toks: Tokenizers, dirs: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((dirs["chatml"] / "tokenizer.json").read_bytes())
    toks.load("bare", tmp_path)
    assert toks.encode_prompt("bare", "hello").tolist() == raw(dirs, "chatml").encode("hello").ids
    with pytest.raises(TokenizeError, match="no chat template"):
        toks.encode_chat("bare", CHAT)
    with pytest.raises(TokenizeError, match=r"no tokenizer\.json"):
        toks.load("missing", tmp_path / "nowhere")


# -- the cache ---------------------------------------------------------------------------------------


def test_boundaries_only_where_splitting_is_safe(toks: Tokenizers) -> None:
    assert re.escape("<|eot_id|>") in toks.boundaries("llama3")
    assert re.escape("<|im_end|>") in toks.boundaries("chatml")
    for style in ("llama3", "chatml"):
        assert toks.boundaries(style).endswith(LINE_START)  # byte-level BPE: line starts too
    # Metaspace with prepend_scheme "first" encodes a piece differently when it starts the text.
    assert toks.boundaries("sentencepiece") == ""


def test_a_document_asked_about_again_is_encoded_once(toks: Tokenizers, dirs: dict[str, Path]) -> None:
    """A document with a new question, in one user message or as a completions prompt: its lines are
    cut at line starts and reused; only the question is encoded again."""
    tok = raw(dirs, "llama3")
    document = "\n".join(
        f"Line {i}: the cache keeps blocks of earlier prompts, {i * 7} of them." for i in range(80)
    )
    for n, question in enumerate(("What is kept?", "How many blocks?", "Why?")):
        text = f"{document}\nQ: {question}"
        for form in ("chat", "prompt"):
            before = toks.cache.stats.miss_tokens, toks.cache.stats.hit_tokens
            if form == "chat":
                msgs = [{"role": "user", "content": text}]
                ids = toks.encode_chat("llama3", msgs).tolist()
                expected = tok.encode(toks.render_chat("llama3", msgs), add_special_tokens=False).ids
            else:
                ids = toks.encode_prompt("llama3", text).tolist()
                expected = tok.encode(text).ids
            assert ids == expected
            encoded = toks.cache.stats.miss_tokens - before[0]
            reused = toks.cache.stats.hit_tokens - before[1]
            assert encoded + reused + (form == "prompt") == len(ids)  # + the BOS of the post-processor
            if n:
                assert encoded < 30 and reused > 20 * encoded, (form, encoded, reused)


def test_a_growing_chat_encodes_only_its_new_turns(toks: Tokenizers, dirs: dict[str, Path]) -> None:
    tok = raw(dirs, "llama3")
    chat = [{"role": "system", "content": "You are a careful assistant. " * 40}]
    for turn in range(6):
        chat.append({"role": "user", "content": f"Question {turn}: how do caches help? " * 5})
        before = toks.cache.stats.miss_tokens, toks.cache.stats.hit_tokens
        ids = toks.encode_chat("llama3", chat).tolist()
        assert ids == tok.encode(toks.render_chat("llama3", chat), add_special_tokens=False).ids
        encoded = toks.cache.stats.miss_tokens - before[0]
        reused = toks.cache.stats.hit_tokens - before[1]
        assert encoded + reused == len(ids)
        if turn:
            new_turn = tok.encode(
                f"<|start_header_id|>user<|end_header_id|>\n\n{chat[-1]['content'].strip()}<|eot_id|>",
                add_special_tokens=False,
            ).ids
            # Only the new question (and the generation prompt's header pieces, if new) are encoded.
            assert encoded <= len(new_turn) + 8 < reused
        chat.append({"role": "assistant", "content": f"Answer {turn}."})
    # The same chat twice: nothing encoded the second time.
    first = toks.encode_chat("llama3", chat).tolist()
    misses = toks.cache.stats.misses
    assert toks.encode_chat("llama3", chat).tolist() == first
    assert toks.cache.stats.misses == misses


def test_the_cache_stays_within_its_bytes(dirs: dict[str, Path]) -> None:
    toks = Tokenizers.from_dirs({"llama3": str(dirs["llama3"])}, cache_bytes=64 << 10)
    tok = raw(dirs, "llama3")
    for i in range(300):
        text = f"prompt number {i} " * 20
        assert toks.encode_prompt("llama3", text).tolist() == tok.encode(text).ids
        assert toks.cache.bytes <= toks.cache.max_bytes
    assert toks.cache.stats.evictions > 0
    huge = "x y " * 20000  # more than a quarter of the cache: encoded, not kept
    assert toks.encode_prompt("llama3", huge).tolist() == tok.encode(huge).ids
    assert toks.cache.stats.uncached == 1


def _fresh_ids(dirs: dict[str, Path], style: str, text: str, special: bool = False) -> list[int]:
    return list(raw(dirs, style).encode(text, add_special_tokens=special).ids)


def test_a_grown_conversation_looks_up_only_its_new_turn(dirs: dict[str, Path]) -> None:
    """A conversation grown by a turn reuses the remembered ids of its previous text up to the last
    boundary they share: the pieces looked up are the new turn's, as many at turn 2 as at turn 11, not
    the whole conversation's; the ids are exactly a full encode's."""
    toks = Tokenizers.from_dirs({"llama3": str(dirs["llama3"])})
    looked_up: list[int] = []
    get_many = toks.cache.get_many

    def counting(model: int, pieces: list[str]) -> list[np.ndarray | None]:
        looked_up.append(len(pieces))
        return get_many(model, pieces)

    toks.cache.get_many = counting  # type: ignore[method-assign]
    chat = [{"role": "system", "content": "You are a careful assistant.\nAnswer briefly.\n" * 30}]
    for turn in range(12):
        chat.append({"role": "user", "content": f"Question {turn}:\nhow do caches help?\nSay it." * 3})
        stats = toks.cache.stats
        before = stats.prefix_hits, stats.hit_tokens + stats.miss_tokens, stats.miss_tokens
        ids = toks.encode_chat("llama3", chat).tolist()
        assert ids == _fresh_ids(dirs, "llama3", toks.render_chat("llama3", chat))
        # Every token is counted once: a hit (remembered, or a cached piece) or a miss (encoded).
        assert stats.hit_tokens + stats.miss_tokens - before[1] == len(ids)
        if turn:
            assert stats.prefix_hits == before[0] + 1
            assert stats.miss_tokens - before[2] < 80  # the new turns (a question, an answer) at most
        chat.append({"role": "assistant", "content": f"Answer {turn}.\nDone."})
    assert len(toks.memo) == 1  # the conversation keeps one remembered entry, not one per turn
    assert len(toks.memo._entries[next(iter(toks.memo._entries))].ends) > looked_up[0] + 100
    grown = looked_up[1:]
    assert max(grown) == min(grown) < 20, looked_up


def test_common_prefix_of_long_texts() -> None:
    base = "".join(chr(0x41 + (i * 7919) % 57) for i in range(200_000))
    for at in (0, 1, 4095, 32_767, 32_768, 65_537, 150_001, 199_999):
        other = base[:at] + "\u6771" + base[at + 1 :]
        assert cache_module.common_prefix(base, other) == at
        assert cache_module.common_prefix(other[: at + 1], base) == at
    assert cache_module.common_prefix(base, base[:70_000]) == 70_000
    assert cache_module.common_prefix("", base) == 0


def test_the_same_long_prompt_again_comes_whole_from_memory(dirs: dict[str, Path]) -> None:
    toks = Tokenizers.from_dirs({"llama3": str(dirs["llama3"])})
    text = "\n".join(f"Row {i}: value {i * 3}." for i in range(400))
    first = toks.encode_prompt("llama3", text)
    misses = toks.cache.stats.misses
    again = toks.encode_prompt("llama3", text)
    assert again.tolist() == first.tolist() == _fresh_ids(dirs, "llama3", text, special=True)
    assert toks.cache.stats.misses == misses and toks.cache.stats.prefix_hits == 1
    # A new question after the same document: only the question is cut and encoded.
    asked = toks.encode_prompt("llama3", text + "\nQuestion: which row is largest?")
    assert asked.tolist() == _fresh_ids(dirs, "llama3", text + "\nQuestion: which row is largest?", True)
    assert toks.cache.stats.misses - misses <= 2


def test_one_call_adds_at_most_its_budget_to_the_cache(dirs: dict[str, Path]) -> None:
    """A huge prompt made of many small lines (~1 MiB of pieces) is encoded exactly, but adds at most
    ``call_bytes`` to the cache: what other prompts cached stays (the bound of --tokenize-call-mb)."""
    call = 32 << 10
    toks = Tokenizers.from_dirs({"llama3": str(dirs["llama3"])}, cache_bytes=1 << 20, call_bytes=call)
    earlier = ["\n".join(f"Doc {d} line {i}: kept." for i in range(60)) for d in range(10)]
    for text in earlier:
        toks.encode_prompt("llama3", text)
    held = toks.cache.bytes
    huge = "\n".join(f"Line {i} of a very long agent transcript." for i in range(5000))
    assert toks.encode_prompt("llama3", huge).tolist() == _fresh_ids(dirs, "llama3", huge, special=True)
    assert held < toks.cache.bytes <= held + call
    assert toks.cache.stats.evictions == 0 and toks.cache.stats.uncached > 0
    assert len(toks.memo) == 10  # too large to remember: the earlier prompts stay remembered
    toks.memo.clear()  # the pieces alone: every earlier document still cached
    misses = toks.cache.stats.misses
    for text in earlier:
        toks.encode_prompt("llama3", text)
    assert toks.cache.stats.misses == misses


def test_remembered_prompts_stay_within_their_bytes(dirs: dict[str, Path]) -> None:
    toks = Tokenizers.from_dirs({"llama3": str(dirs["llama3"])}, cache_bytes=1 << 20)
    for i in range(200):
        text = "\n".join(f"Conversation {i}, line {j}." for j in range(100))
        assert toks.encode_prompt("llama3", text).tolist() == _fresh_ids(dirs, "llama3", text, True)
        assert toks.memo.bytes <= toks.memo.max_bytes == (1 << 20) // 4
    assert 0 < len(toks.memo) < 200


@pytest.mark.parametrize(
    "flag", [["--tokenize-call-mb", "-1"], ["--tokenize-max-chars", "0"], ["--tokenize-max-chars", "1e6"]]
)
def test_tokenize_bounds_are_checked_by_serve(flag: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from kvindex.cli import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", *flag])
    assert exc.value.code == 2 and flag[0] in capsys.readouterr().err


def test_a_text_longer_than_the_bound_is_refused_naming_the_flag(dirs: dict[str, Path]) -> None:
    toks = Tokenizers.from_dirs({"llama3": str(dirs["llama3"])}, max_text_chars=1000)
    assert len(toks.encode_prompt("llama3", "x" * 1000)) > 0
    with pytest.raises(TokenizeError, match=r"1001 characters; at most 1000 .*--tokenize-max-chars"):
        toks.encode_prompt("llama3", "x" * 1001)
    with pytest.raises(TokenizeError, match="at most 1000"):
        toks.encode_chat("llama3", [{"role": "user", "content": "y" * 1000}])  # rendered: longer
    assert toks.cache.stats.misses == 1


_pieces = st.sampled_from(
    [
        "hello",
        " world",
        "\n\n",
        "  ",
        "東京",
        "🙂",
        "'s",
        "12345",
        "\t",
        "<|eot_id|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|begin_of_text|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<s>",
        "</s>",
        "x",
        " ",
        "\n",
        "<|",
        "|>",
        "é",
        "Zebra",
        "\n\n",
        ".\n",
    ]
)
_texts = st.lists(_pieces, max_size=40).map("".join)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(_texts, min_size=1, max_size=4), special=st.booleans())
def test_piecewise_cached_encoding_equals_a_full_encode(
    dirs: dict[str, Path], shared: Tokenizers, texts: list[str], special: bool
) -> None:
    toks = shared
    for style in ("llama3", "chatml", "sentencepiece"):
        tok = raw(dirs, style)
        for text in texts:  # later texts reuse pieces of earlier ones
            got = toks.encode_prompt(style, text, special)
            assert got.dtype == np.uint32
            assert got.tolist() == tok.encode(text, add_special_tokens=special).ids, (style, text)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(contents=st.lists(_texts, min_size=1, max_size=6))
def test_cached_chats_equal_a_full_encode_of_the_rendered_text(
    dirs: dict[str, Path], shared: Tokenizers, contents: list[str]
) -> None:
    toks = shared
    msgs = [{"role": ("user", "assistant")[i % 2], "content": c} for i, c in enumerate(contents)]
    for style in ("llama3", "chatml", "sentencepiece"):
        tok = raw(dirs, style)
        for n in range(1, len(msgs) + 1):  # the chat growing turn by turn
            try:
                text = toks.render_chat(style, msgs[:n])
            except TokenizeError:
                continue  # e.g. the [INST] template refusing an assistant message first
            assert (
                toks.encode_chat(style, msgs[:n]).tolist() == tok.encode(text, add_special_tokens=False).ids
            )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    base=_texts,
    edits=st.lists(st.tuples(st.floats(0, 1), _texts), min_size=1, max_size=5),
    special=st.booleans(),
)
def test_texts_built_on_remembered_ones_equal_a_full_encode(
    dirs: dict[str, Path], shared: Tokenizers, base: str, edits: list[tuple[float, str]], special: bool
) -> None:
    """Each text is the previous one cut anywhere and continued (a turn added, an answer regenerated,
    a message edited): what the remembered prefix gives plus the rest equals a full encode. The window
    that files remembered texts is made tiny so that these short texts exercise it."""
    toks = shared  # later examples also find earlier ones' texts
    window = cache_module.WINDOW
    cache_module.WINDOW = 4
    try:
        for style in ("llama3", "chatml"):
            text = base
            for cut, suffix in [(1.0, ""), *edits]:
                text = text[: int(len(text) * cut)] + suffix
                got = toks.encode_prompt(style, text, special).tolist()
                assert got == _fresh_ids(dirs, style, text, special), (style, text)
    finally:
        cache_module.WINDOW = window


def test_openai_request_bodies_as_vllm_reads_them(toks: Tokenizers, dirs: dict[str, Path]) -> None:
    """What the routing proxy and the ext_proc picker call with the body they parsed."""
    body = {"model": "chatml", "messages": CHAT, "max_tokens": 5, "stream": True}
    assert toks.encode_openai(body, chat=True).tolist() == toks.encode_chat("chatml", CHAT).tolist()
    body = {
        **body,
        "add_generation_prompt": False,
        "tools": [{"type": "function", "function": {"name": "f"}}],
    }
    expected = toks.encode_chat("chatml", CHAT, add_generation_prompt=False, tools=body["tools"])
    assert toks.encode_openai(body, chat=True).tolist() == expected.tolist()
    # reasoning_effort reaches a template that reads it, as vLLM passes it.
    (dirs["chatml"].parent / "effort").mkdir(exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (dirs["chatml"].parent / "effort" / name).write_bytes((dirs["chatml"] / name).read_bytes())
    template = (
        "{{ reasoning_effort }}/{{ enable_thinking }}:{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    (dirs["chatml"].parent / "effort" / "chat_template.jinja").write_text(template)
    toks.load("effort", dirs["chatml"].parent / "effort")
    msgs = [{"role": "user", "content": "hi"}]
    ids = toks.encode_openai({"model": "effort", "messages": msgs, "reasoning_effort": "low"}, chat=True)
    assert raw(dirs, "chatml").decode(ids.tolist()) == "low/True:hi"
    body = {"model": "x", "prompt": "Hello world"}
    assert (
        toks.encode_openai(body, chat=False, model="llama3").tolist()
        == toks.encode_prompt("llama3", "Hello world").tolist()
    )
    assert toks.encode_openai({"model": "llama3", "prompt": [5, 6, 7]}, chat=False).tolist() == [5, 6, 7]
    with pytest.raises(TokenizeError, match="one prompt per request"):
        toks.encode_openai({"model": "llama3", "prompt": ["a", "b"]}, chat=False)
    with pytest.raises(TokenizeError, match="no model"):
        toks.encode_openai({"prompt": "a"}, chat=False)
