"""Our Tokenizer on the converted SmolLM2 against the one transformers builds from the GGUF."""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from pathlib import Path

import jinja2
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for model_fixtures

from model_fixtures import converted_smollm2_dir, smollm2_gguf_path  # noqa: E402

from tokenmill.engine.core.detokenizer import IncrementalDetokenizer  # noqa: E402
from tokenmill.engine.loader.model_files import ModelFilesError  # noqa: E402
from tokenmill.engine.loader.tokenizer import Tokenizer, compile_chat_template  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "It's 5 o'clock; we'll see what's up at 12:30pm - $3.50 each (or 2 for $6).",
    "日本語のテキストと中文文本，还有한국어 텍스트.",
    "Emoji: 🎉🚀👩‍👩‍👧‍👦 and flags 🇫🇷, skin tones 👍🏽.",
    "Accents: naïve café, Ångström, façade, jalapeño, Œuvre, Zürich, ß.",
    "Whitespace   runs\tand\ttabs\n\nnew lines\r\n   indented\n\t\tmixed  \n",
    "    leading spaces and trailing spaces    ",
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n",
    "Specials inline: <|endoftext|><repo_name>x<file_sep>y<|im_end|>",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n",
    "",
    " ",
    "\u00a0non-breaking\u2003em-space\u200bzero-width",
]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    try:
        return Tokenizer.from_dir(converted_smollm2_dir())
    except ModelFilesError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def reference():
    transformers = pytest.importorskip("transformers")
    try:
        gguf_path = smollm2_gguf_path()
    except ModelFilesError as error:
        pytest.skip(str(error))
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


def test_special_ids(ours):
    assert ours.vocab_size == 49152
    assert ours.bos_token_id == 1  # <|im_start|>
    assert ours.eos_token_ids == [2]  # <|im_end|>
    assert ours.pad_token_id == 2
    assert ours.token_to_id("<|endoftext|>") == 0


@pytest.mark.parametrize("text", TEXTS)
def test_ids_and_decode_match_transformers(ours, reference, text):
    ids = ours.encode(text)
    assert ids == reference.encode(text)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(
            ids, skip_special_tokens=skip
        )
    assert ours.decode(ids, skip_special_tokens=False) == text


def test_encode_batch_equals_encode(ours):
    assert ours.encode_batch(TEXTS) == [ours.encode(t) for t in TEXTS]
    assert ours.decode_batch(ours.encode_batch(TEXTS), skip_special_tokens=False) == TEXTS


def test_digits_are_split_before_whitespace_merges(ours, reference):
    # SmolLM2's own tokenizer (and llama.cpp's "smollm" pre-tokenizer) isolates every digit
    # before the GPT-2 split, so "  2" keeps its two spaces as one token (256 = "ĠĠ").
    # transformers' GGUF loader skips the digit step and gives two single spaces instead;
    # we follow the model's tokenizer. Everything else matches (test above).
    assert ours.encode("a  2") == [81, 256, 34]
    assert reference.encode("a  2") in ([81, 216, 216, 34], [81, 256, 34])


def test_chat_template_matches_transformers(ours, reference):
    conversations = [
        [
            {"role": "system", "content": "You answer in French."},
            {"role": "user", "content": "Hi!"},
        ],
        [{"role": "user", "content": "What is 2+2?"}],
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello! 👋"},
            {"role": "user", "content": "Bye\n"},
        ],
    ]
    for messages in conversations:
        for add_generation_prompt in (True, False):
            expected = reference.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
            assert got == expected
            ids = ours.apply_chat_template(messages, tokenize=True)
            assert ids == reference.apply_chat_template(
                messages, tokenize=True, add_generation_prompt=True, return_dict=False
            )
    # The template adds SmolLM's default system turn when there is none.
    assert got == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello! 👋<|im_end|>\n"
        "<|im_start|>user\nBye\n<|im_end|>\n"
    )


@pytest.mark.parametrize(
    "messages",
    [
        "just a string",
        None,
        [{"role": "user"}],
        [{"role": "user", "content": None}],
        [{"role": 1, "content": "hi"}],
        ["hi"],
        {"role": "user", "content": "hi"},
    ],
)
def test_malformed_messages_raise_value_error(ours, messages):
    with pytest.raises(ValueError, match="message"):
        ours.apply_chat_template(messages)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__init__.__globals__ }}",
        "{{ raise_exception.__globals__['os'] }}",
        "{% set ns = namespace() %}{% set ns._evil = 1 %}{{ ns }}",
        "{{ messages.append(1) }}",
    ],
)
def test_sandbox_blocks_unsafe_templates(template):
    with pytest.raises(jinja2.exceptions.SecurityError):
        compile_chat_template(template).render(messages=[])


def test_template_helpers():
    template = compile_chat_template(
        "{% if messages|length == 0 %}{{ raise_exception('empty chat') }}{% endif %}"
        "{{ messages|tojson }} {{ strftime_now('%Y') | length }}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}"
    )
    with pytest.raises(jinja2.exceptions.TemplateError, match="empty chat"):
        template.render(messages=[])
    messages = [{"role": "user", "content": "é<b>"}, {"role": "user", "content": "second"}]
    assert template.render(messages=messages) == f"{json.dumps(messages, ensure_ascii=False)} 4é<b>"


def test_generation_config_eos_ids_are_added(tmp_path):
    source = converted_smollm2_dir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, tmp_path / name)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0].content }}")
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert tokenizer.eos_token_ids == [2, 0]
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>x"


def test_no_chat_template_is_a_clear_error(ours):
    bare = Tokenizer(ours.backend, special_tokens=ours.special_tokens)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])


def _detokenize(tokenizer, ids, **kwargs):
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.finish())
    return pieces, detok.text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_detokenizer_equals_full_decode(ours, skip_special_tokens):
    for text in TEXTS:
        ids = ours.encode(text)
        pieces, text_out = _detokenize(ours, ids, skip_special_tokens=skip_special_tokens)
        assert "".join(pieces) == text_out == ours.decode(ids, skip_special_tokens)
        # A character split over byte tokens is never emitted half-done.
        assert not any("\ufffd" in piece for piece in pieces)


def test_incremental_detokenizer_waits_for_split_characters(ours):
    ids = ours.encode("🎉")
    assert len(ids) > 1  # the emoji is several byte tokens
    detok = IncrementalDetokenizer(ours)
    assert [detok.add(i) for i in ids] == [""] * (len(ids) - 1) + ["🎉"]
    assert detok.add([ours.encode(" ok")[0]]) == " ok"


def test_incremental_detokenizer_random_ids(ours):
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 40))]
        pieces, text = _detokenize(ours, ids)
        assert text == ours.decode(ids)
