"""Decoders that pool, through the decode loop, against HF transformers on the same random
weights: Qwen3-Embedding's layout (last-token pooling, an instruction prefix, the prefix
cache), pooling that reads every token across prompt chunks, and a Qwen2 classification
head."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pooling_models import build_decoder, write_sentence_transformers_files
from tiny_model import build_tiny_model

from tokenmill.engine.api.llm import LLM
from tokenmill.engine.types.sampling_params import SamplingParams

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000",
    "def add(a, b):\n    return a + b\n",
    "answer",
]
INSTRUCTION = "Instruct: Given a web search query, retrieve relevant passages\nQuery:"


def hf_last_hidden(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids])).last_hidden_state[0]


def test_last_token_embeddings_match_transformers_and_share_the_prefix(tmp_path):
    hf = build_decoder("qwen3", tmp_path)
    write_sentence_transformers_files(
        tmp_path, pooling_mode="lasttoken", normalize=True, prompts={"query": INSTRUCTION}
    )
    llm = LLM(str(tmp_path), dtype="float32", max_num_batched_tokens=64)
    assert llm.tasks == ("embed",)
    first = llm.embed(TEXTS, prompt_name="query")
    again = llm.embed(TEXTS, prompt_name="query")
    for out, repeat, text in zip(first, again, TEXTS):
        assert out.prompt_token_ids == llm.tokenizer.encode(INSTRUCTION + text)
        want = F.normalize(hf_last_hidden(hf, out.prompt_token_ids)[-1], dim=0)
        torch.testing.assert_close(torch.tensor(out.embedding), want, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(repeat.embedding), want, atol=2e-5, rtol=1e-4)
    # The instruction's full blocks are computed once and served from the prefix cache.
    assert sum(o.cached_tokens for o in again) >= len(TEXTS) * 16
    with pytest.raises(ValueError, match="not generate"):
        llm.generate("hello")


@pytest.mark.parametrize("mode", ["mean", "weightedmean", "max", "cls"])
def test_pooling_every_token_across_prompt_chunks(mode, tmp_path):
    hf = build_decoder("qwen3", tmp_path)
    write_sentence_transformers_files(tmp_path, pooling_mode=mode, normalize=False)
    # Chunks of 8 tokens: every prompt is pooled over several steps.
    llm = LLM(str(tmp_path), dtype="float32", max_num_batched_tokens=8, block_size=4)
    texts = [INSTRUCTION + t for t in TEXTS]
    for _ in range(2):  # the second pass must not take pooled rows from the cache
        for out in llm.embed(texts):
            hidden = hf_last_hidden(hf, out.prompt_token_ids)
            n = hidden.shape[0]
            weights = torch.arange(1, n + 1, dtype=hidden.dtype)[:, None]
            want = {
                "mean": hidden.mean(0),
                "weightedmean": (hidden * weights).sum(0) / weights.sum(),
                "max": hidden.max(0).values,
                "cls": hidden[0],
            }[mode]
            torch.testing.assert_close(torch.tensor(out.embedding), want, atol=2e-5, rtol=1e-4)
            assert out.cached_tokens == 0


def test_qwen2_classification_head_matches_transformers(tmp_path):
    hf = build_decoder("qwen2", tmp_path, num_labels=2, id2label={0: "no", 1: "yes"})
    llm = LLM(str(tmp_path), dtype="float32")
    assert llm.tasks == ("classify", "rerank") and llm.label_names == ("no", "yes")
    for out in llm.classify(TEXTS):
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([out.prompt_token_ids])).logits[0]
        torch.testing.assert_close(torch.tensor(out.probs), torch.softmax(logits, 0))


def test_a_causal_lm_embeds_only_when_its_directory_says_how(tmp_path):
    build_tiny_model(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32")
    assert llm.tasks == ("generate",)
    with pytest.raises(ValueError, match="not embed"):
        llm.embed("hello")
    write_sentence_transformers_files(tmp_path, pooling_mode="lasttoken", normalize=True)
    llm = LLM(str(tmp_path), dtype="float32")
    assert llm.tasks == ("generate", "embed")
    # One engine serves both: generation and embeddings interleave on one cache.
    text = llm.generate("hello", SamplingParams(max_tokens=3, temperature=0))[0]
    embedding = llm.embed("hello")[0]
    assert len(text.token_ids) <= 3 and len(embedding.embedding) == 64
    assert embedding.completion_tokens == 0


def test_a_qwen3_embedding_layout_causal_lm_loads_its_bare_checkpoint(tmp_path):
    """Qwen3-Embedding's directory: config.json says Qwen3ForCausalLM (tied embeddings), the
    weights are the bare model's (no "model." in their names, no lm_head), and
    sentence-transformers' files say last-token pooling."""
    import json

    hf = build_decoder("qwen3", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(architectures=["Qwen3ForCausalLM"], tie_word_embeddings=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    write_sentence_transformers_files(tmp_path, pooling_mode="lasttoken", normalize=True)
    llm = LLM(str(tmp_path), dtype="float32")
    assert llm.tasks == ("generate", "embed")
    for out in llm.embed(TEXTS):
        want = F.normalize(hf_last_hidden(hf, out.prompt_token_ids)[-1], dim=0)
        torch.testing.assert_close(torch.tensor(out.embedding), want, atol=2e-5, rtol=1e-4)
