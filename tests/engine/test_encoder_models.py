"""BERT-family encoders against HF transformers on the same random weights: embeddings
(every sentence-transformers pooling mode), classification heads, cross-encoder
reranking, truncation, and the encoder loop's packing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pooling_models import build_encoder, write_sentence_transformers_files

from tokenmill.engine.api.llm import LLM
from tokenmill.engine.types.pooling_params import PoolingParams

TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "a",
    "search the web for a relevant passage",
    "",
    "the cat is on the road in the city by the river",
    "red blue green",
    "the quick brown fox jumps over the lazy dog",  # a repeat: same length as the first
]


def hf_hidden(hf, ids: list[int], token_types: list[int] | None = None) -> torch.Tensor:
    """HF's final hidden states [len, hidden] for one unpadded sequence."""
    base = getattr(hf, "bert", None) or getattr(hf, "roberta", None) or hf
    kwargs = {}
    if token_types is not None:
        kwargs["token_type_ids"] = torch.tensor([token_types])
    with torch.no_grad():
        return base(input_ids=torch.tensor([ids]), **kwargs).last_hidden_state[0]


def st_pool(hidden: torch.Tensor, mode: str) -> torch.Tensor:
    """sentence-transformers' pooling of one unpadded sequence (its own formulas)."""
    n = hidden.shape[0]
    if mode == "cls":
        return hidden[0]
    if mode == "lasttoken":
        return hidden[-1]
    if mode == "max":
        return hidden.max(0).values
    if mode == "mean":
        return hidden.mean(0)
    if mode == "mean_sqrt_len_tokens":
        return hidden.sum(0) / n**0.5
    weights = torch.arange(1, n + 1, dtype=hidden.dtype)[:, None]
    return (hidden * weights).sum(0) / weights.sum()


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_bare_encoder_mean_embeddings_match_transformers(kind, tmp_path):
    hf = build_encoder(kind, tmp_path)
    llm = LLM(str(tmp_path), dtype="float32")
    assert llm.tasks == ("embed",)
    outputs = llm.embed(TEXTS)
    for text, out in zip(TEXTS, outputs):
        want = hf_hidden(hf, out.prompt_token_ids).mean(0)  # no modules.json: mean, raw
        torch.testing.assert_close(torch.tensor(out.embedding), want, atol=2e-5, rtol=1e-4)
        assert out.prompt == text and out.finish_reason == "embed" and not out.truncated


@pytest.mark.parametrize(
    "modes",
    [["cls"], ["max"], ["mean_sqrt_len_tokens"], ["weightedmean"], ["lasttoken"], ["cls", "mean"]],
)
def test_every_pooling_mode_matches_sentence_transformers_formulas(modes, tmp_path):
    hf = build_encoder("bert", tmp_path)
    write_sentence_transformers_files(tmp_path, pooling_mode=modes, normalize=True)
    llm = LLM(str(tmp_path), dtype="float32")
    assert llm.embedding_size == 64 * len(modes)
    for out in llm.embed(TEXTS):
        hidden = hf_hidden(hf, out.prompt_token_ids)
        order = [
            m
            for m in ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
            if m in modes
        ]
        want = F.normalize(torch.cat([st_pool(hidden, m) for m in order]), dim=0)
        torch.testing.assert_close(torch.tensor(out.embedding), want, atol=2e-5, rtol=1e-4)


def test_legacy_pooling_flags_are_read(tmp_path):
    hf = build_encoder("bert", tmp_path)
    write_sentence_transformers_files(tmp_path, pooling_mode="cls", legacy_flags=True)
    out = LLM(str(tmp_path), dtype="float32").embed(TEXTS[0])[0]
    want = F.normalize(hf_hidden(hf, out.prompt_token_ids)[0], dim=0)
    torch.testing.assert_close(torch.tensor(out.embedding), want, atol=2e-5, rtol=1e-4)


def test_matryoshka_dimensions_are_cut_then_normalised(tmp_path):
    build_encoder("bert", tmp_path)
    write_sentence_transformers_files(tmp_path, normalize=True)
    llm = LLM(str(tmp_path), dtype="float32")
    full = torch.tensor(llm.embed(TEXTS[0])[0].embedding)
    cut = torch.tensor(llm.embed(TEXTS[0], dimensions=16)[0].embedding)
    assert cut.shape == (16,)
    torch.testing.assert_close(cut, F.normalize(full[:16], dim=0))
    with pytest.raises(ValueError, match="dimensions=65 is more than"):
        llm.embed(TEXTS[0], dimensions=65)


def test_texts_longer_than_max_seq_length_are_cut_as_sentence_transformers_cuts(tmp_path):
    hf = build_encoder("bert", tmp_path)
    write_sentence_transformers_files(tmp_path, max_seq_length=8)
    llm = LLM(str(tmp_path), dtype="float32")
    assert llm.max_model_len == 8
    long_text = "the quick brown fox jumps over the lazy dog and the cat"
    out = llm.embed([long_text, "red"])
    assert out[0].truncated and not out[1].truncated
    ids = out[0].prompt_token_ids
    assert len(ids) == 8 and ids[0] == 2 and ids[-1] == 3  # [CLS] ... [SEP] kept whole
    want = F.normalize(hf_hidden(hf, ids).mean(0), dim=0)
    torch.testing.assert_close(torch.tensor(out[0].embedding), want, atol=2e-5, rtol=1e-4)
    refused = llm.embed([long_text, "red"], truncate=False)
    assert "longer than the model's max_seq_length of 8" in refused[0].error
    assert refused[1].error is None and refused[0].finish_reason == "error"
    with pytest.raises(ValueError, match="failed"):
        _ = refused[0].embedding


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
def test_classification_head_matches_transformers(kind, tmp_path):
    hf = build_encoder(kind, tmp_path, num_labels=3, id2label={0: "neg", 1: "neu", 2: "pos"})
    llm = LLM(str(tmp_path), dtype="float32")
    assert llm.tasks == ("classify", "rerank") and llm.label_names == ("neg", "neu", "pos")
    for out in llm.classify(TEXTS):
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([out.prompt_token_ids])).logits[0]
        want = torch.softmax(logits, 0)
        torch.testing.assert_close(torch.tensor(out.probs), want, atol=1e-5, rtol=1e-4)
        assert out.label == ("neg", "neu", "pos")[int(want.argmax())]
    with pytest.raises(ValueError, match="not embed"):
        llm.embed("a")
    with pytest.raises(ValueError, match="not generate"):
        llm.generate("a")
    with pytest.raises(ValueError, match="one-label head"):
        llm.score("a", "b")


def test_cross_encoder_scores_pairs_with_token_types(tmp_path):
    hf = build_encoder("bert", tmp_path, num_labels=1)
    llm = LLM(str(tmp_path), dtype="float32")
    query = "what is the capital city"
    documents = ["the city by the river", "red blue green", "a"]
    outputs = llm.score(query, documents)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for document, out in zip(documents, outputs):
        pair = tok.encode(query, document)
        assert out.prompt_token_ids == pair.ids
        with torch.no_grad():
            logit = hf(
                input_ids=torch.tensor([pair.ids]), token_type_ids=torch.tensor([pair.type_ids])
            ).logits[0, 0]
        assert out.score == pytest.approx(torch.sigmoid(logit).item(), abs=1e-5)
    # "[SEP]" in a query is data: plain text, scored as the pair of its text.
    as_text = llm.score(["[SEP] oops", "fine"], ["a", "a"])
    plain = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    plain.encode_special_tokens = True
    assert as_text[0].error is None
    assert as_text[0].prompt_token_ids == plain.encode("[SEP] oops", "a").ids
    assert as_text[0].prompt_token_ids.count(tok.token_to_id("[SEP]")) == 2
    # Allowed as a token, the query's own separator would split the pair in the wrong
    # place: refused alone.
    refused = llm.score(["[SEP] oops", "fine"], ["a", "a"], allow_special_tokens=True)
    assert "pair separator" in refused[0].error and refused[1].error is None


def test_packing_does_not_change_a_sequence(tmp_path):
    """A text alone and inside a batch of mixed lengths (several batches, several runs of
    equal length per batch) gets the same embedding."""
    build_encoder("bert", tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", max_num_batched_tokens=24)
    alone = [llm.embed(t)[0].embedding for t in TEXTS]
    together = llm.embed(TEXTS * 3)
    for i, out in enumerate(together):
        torch.testing.assert_close(torch.tensor(out.embedding), torch.tensor(alone[i % len(TEXTS)]))
    assert llm.stats().num_steps > 3


def test_encode_refuses_what_the_engine_cannot_serve(tmp_path):
    build_encoder("bert", tmp_path)
    llm = LLM(str(tmp_path), dtype="float32")
    params = PoolingParams()
    outputs = llm.encode([[2, 50, 3], [], [2] * 200, [2, 10_000, 3]], params)
    assert outputs[0].error is None and outputs[0].data.shape == (64,)
    assert outputs[1].error == "prompt is empty (0 tokens)"
    assert "takes at most 128" in outputs[2].error
    assert "outside the vocabulary" in outputs[3].error
    with pytest.raises(ValueError, match="quantization is not available"):
        LLM(str(tmp_path), quantization="int8")


def test_bf16_embeddings_stay_close_to_fp32(tmp_path):
    build_encoder("bert", tmp_path)
    write_sentence_transformers_files(tmp_path, normalize=True)
    fp32 = LLM(str(tmp_path), dtype="float32").embed(TEXTS)
    bf16 = LLM(str(tmp_path), dtype="bfloat16").embed(TEXTS)
    for a, b in zip(fp32, bf16):
        cos = F.cosine_similarity(torch.tensor(a.embedding), torch.tensor(b.embedding), dim=0)
        assert cos > 0.999
