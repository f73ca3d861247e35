"""Penalties, logit bias, allowed tokens and bad words: the sampler's sparse edits equal
their definitions computed densely, greedy outputs equal a reference loop over HF
transformers with the same definitions (transformers' own processors where it has them:
the repetition penalty, `NoBadWordsLogitsProcessor`, `PrefixConstrainedLogitsProcessor`),
and overlapped steps change nothing.

Bad words differ from transformers' processor in one place, on purpose (vLLM's rule):
tokenmill matches a word's earlier tokens against the output only, where transformers
matches them against prompt and output together - a word begun at the end of the prompt
is banned there, not here. The comparison uses prompts where no word's start ends the
prompt, and a test shows the difference itself."""

from __future__ import annotations

import random

import pytest
import torch
from hf_models import build_hf_model, make_engine, run_all, save_char_tokenizer
from tiny_model import build_tiny_model
from transformers import (
    NoBadWordsLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)

from tokenmill.engine.core.bans import bad_words_token_ids
from tokenmill.engine.core.step import PLACEHOLDER_TOKEN_ID, Sequence
from tokenmill.engine.sample.logit_controls import LogitControls
from tokenmill.engine.sample.sampler import Sampler, SamplingBatch
from tokenmill.engine.types.sampling_params import SamplingParams
from tokenmill.engine.types.structured_outputs import StructuredOutputs

VOCAB = 256


@pytest.fixture(scope="module")
def hf_and_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    hf = build_hf_model("llama", path, eos_token_id=7)
    save_char_tokenizer(path)
    return hf, path


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def reference_logits(logits, prompt, output, params: SamplingParams) -> torch.Tensor:
    """One row's edited logits by the definitions: transformers' repetition penalty over
    prompt and output, OpenAI's presence/frequency over the output, then the bias."""
    logits = logits.clone()[None]
    if params.repetition_penalty != 1.0:
        seen = torch.tensor([prompt + output])
        logits = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(seen, logits)
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=VOCAB).float()
    logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
    for token, bias in (params.logit_bias or {}).items():
        logits[0, token] += bias
    return logits[0]


def _seq(prompt, output, params, *, pending_row=-1) -> Sequence:
    seq = Sequence(0, "r", 0, prompt + output, len(prompt), params)
    if pending_row >= 0:
        seq.token_ids.append(PLACEHOLDER_TOKEN_ID)
        seq.num_pending_tokens, seq.pending_row = 1, pending_row
    return seq


def _controls(seqs, previous=None, conditional=None):
    return LogitControls.build(
        seqs, conditional or [[] for _ in seqs], torch.device("cpu"), previous
    )


def test_sparse_edits_equal_the_definitions():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, VOCAB, generator=gen) * 3
    prompts = [_tokens(n, seed=n) for n in (12, 30, 5, 9, 20)]
    outputs = [[3, 3, 9, 3, 200], [], [1, 1, 1, 1], [4, 5, 4], [10, 11]]
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(repetition_penalty=0.8, presence_penalty=0.5),
        SamplingParams(frequency_penalty=1.5, presence_penalty=-0.7),
        SamplingParams(),  # untouched beside the others
        SamplingParams(repetition_penalty=1.2, frequency_penalty=0.4, logit_bias={10: -100, 77: 5}),
    ]
    seqs = [_seq(p, o, q) for p, o, q in zip(prompts, outputs, params)]
    edited = logits.clone()
    _controls(seqs).apply_before_mask(edited, Sampler().penalty_scratch)
    for row, (p, o, q) in enumerate(zip(prompts, outputs, params)):
        torch.testing.assert_close(edited[row], reference_logits(logits[row], p, o, q))
    assert torch.equal(edited[3], logits[3])


def test_pending_token_is_read_on_the_device():
    """A penalized row whose last token is the previous step's sample, not yet on the host."""
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))
    prompt, output = _tokens(10, seed=3), [5, 6, 5]
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25)
    previous = torch.tensor([42, 5])  # this row's pending token is the previous step's row 1
    seqs = [_seq(prompt, output, params, pending_row=1), _seq(prompt, [], SamplingParams())]
    scratch = Sampler().penalty_scratch
    edited = logits.clone()
    _controls(seqs, previous).apply_before_mask(edited, scratch)
    torch.testing.assert_close(edited[0], reference_logits(logits[0], prompt, output + [5], params))
    assert torch.equal(edited[1], logits[1])
    assert not scratch.counts(1, torch.device("cpu")).any()  # the scratch is clean again


def test_allowed_tokens_and_conditional_bans():
    logits = torch.zeros(3, VOCAB)
    logits[:, 9] = 4.0
    seqs = [
        _seq([1], [], SamplingParams(allowed_token_ids=[3, 4])),
        _seq([1], [2], SamplingParams(), pending_row=0),
        _seq([1], [2], SamplingParams(), pending_row=1),
    ]
    previous = torch.tensor([8, 2])
    controls = _controls(seqs, previous, conditional=[[], [(9, 8)], [(9, 8)]])
    controls.apply_after_mask(logits)
    assert torch.isfinite(logits[0]).nonzero().squeeze(1).tolist() == [3, 4]
    assert logits[1, 9] == float("-inf")  # its pending token is 8: banned
    assert logits[2, 9] == 4.0  # its pending token is 2: not


def test_no_controls_build_nothing():
    seqs = [_seq([1, 2], [3], SamplingParams(temperature=0.5, top_k=3))]
    assert _controls(seqs) is None


def hf_greedy_with(hf, prompt, num_tokens, params: SamplingParams) -> list[int]:
    """Greedy decoding by full HF forward passes, the logits edited by the definitions."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
            logits = reference_logits(logits, prompt, ids[len(prompt) :], params)
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(repetition_penalty=1.8),
        SamplingParams(presence_penalty=2.0),
        SamplingParams(frequency_penalty=1.0),
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.6, presence_penalty=0.3),
        SamplingParams(logit_bias={17: 8.0, 100: -100}),
    ],
    ids=["repetition", "presence", "frequency", "all", "bias"],
)
def test_greedy_outputs_equal_transformers_with_the_definitions(hf_and_dir, params):
    hf, path = hf_and_dir
    prompts = [_tokens(n, seed=50 + n) for n in (6, 17)]
    params = SamplingParams(
        temperature=0,
        max_tokens=20,
        ignore_eos=True,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        logit_bias=params.logit_bias,
    )
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outputs = run_all(make_engine(path), prompts, params)
    unpenalized = run_all(make_engine(path), prompts, plain)
    for prompt, out, free in zip(prompts, outputs, unpenalized):
        assert out.token_ids == hf_greedy_with(hf, prompt, 20, params)
        assert out.token_ids != free.token_ids  # the control changed the answer


def hf_greedy_processed(hf, prompt, num_tokens, processor) -> list[int]:
    """Greedy decoding by full HF forward passes through one transformers processor,
    which sees prompt and output as one sequence, as `generate` gives it."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = hf(torch.tensor([ids])).logits[:, -1].float()
            ids.append(int(processor(torch.tensor([ids]), logits)[0].argmax()))
    return ids[len(prompt) :]


def _ends_with_a_words_start(prompt: list[int], words: list[list[int]]) -> bool:
    """Whether the prompt ends with a word's first j tokens (j < its length): where
    transformers and tokenmill part (the module docstring)."""
    return any(
        prompt[-j:] == word[:j] for word in words for j in range(1, len(word)) if j <= len(prompt)
    )


GREEDY_24 = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_bad_words_equal_transformers_no_bad_words_processor(hf_and_dir):
    """Words of one, two and three tokens taken from the free answers, so each ban fires:
    the banned run equals transformers' greedy with NoBadWordsLogitsProcessor given the
    same token sequences."""
    hf, path = hf_and_dir
    engine = make_engine(path)
    prompts = [_tokens(n, seed=400 + n) for n in (7, 13, 10)]
    free = run_all(engine, prompts, GREEDY_24)
    decode = engine.tokenizer.decode
    words = [
        decode(free[0].token_ids[4:6]),
        decode(free[1].token_ids[8:11]),
        decode(free[2].token_ids[2:3]),
    ]
    sequences = bad_words_token_ids(engine.tokenizer, words)
    assert [len(s) for s in sequences] == [2, 3, 1]
    assert not any(_ends_with_a_words_start(p, sequences) for p in prompts)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, bad_words=words)
    banned = run_all(engine, prompts, params)
    processor = NoBadWordsLogitsProcessor(sequences, eos_token_id=None)
    for prompt, out in zip(prompts, banned):
        assert out.token_ids == hf_greedy_processed(hf, prompt, 24, processor)
        assert not any(_sequence_with(out.token_ids, word) for word in sequences)
    assert [o.token_ids for o in banned] != [o.token_ids for o in free]


def test_a_bad_word_begun_in_the_prompt_is_transformers_ban_not_ours(hf_and_dir):
    """The documented difference: the word (the prompt's last token, the answer's first)
    is banned by transformers, which matches across the prompt, and not by tokenmill."""
    hf, path = hf_and_dir
    engine = make_engine(path)
    prompt = _tokens(9, seed=77)
    first = run_all(engine, [prompt], GREEDY_24)[0].token_ids[0]
    word = [prompt[-1], first]
    text = engine.tokenizer.decode(word)
    assert bad_words_token_ids(engine.tokenizer, [text]) == [word]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, bad_words=[text])
    ours = run_all(engine, [prompt], params)[0].token_ids
    theirs = hf_greedy_processed(hf, prompt, 4, NoBadWordsLogitsProcessor([word], None))
    assert ours[0] == first and theirs[0] != first


def test_allowed_token_ids_equal_transformers_prefix_allowed_tokens(hf_and_dir):
    """allowed_token_ids against transformers' prefix-allowed function returning the same
    set at every step; the set leaves out each free answer's tokens, so it matters."""
    hf, path = hf_and_dir
    engine = make_engine(path)
    prompts = [_tokens(n, seed=500 + n) for n in (6, 15)]
    free = run_all(engine, prompts, GREEDY_24)
    used = {t for o in free for t in o.token_ids}
    allowed = sorted(set(random.Random(3).sample(range(VOCAB), 60)) - used)
    assert len(allowed) >= 20
    params = SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, allowed_token_ids=allowed
    )
    processor = PrefixConstrainedLogitsProcessor(lambda batch_id, ids: allowed, num_beams=1)
    for prompt, out in zip(prompts, run_all(engine, prompts, params)):
        assert out.token_ids == hf_greedy_processed(hf, prompt, 24, processor)
        assert set(out.token_ids) <= set(allowed)


def _sequence_with(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i : i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


def test_bad_words_allowed_tokens_and_bias_under_overlapped_steps(hf_and_dir):
    """Overlapped steps (the CUDA default) give the very outputs of plain steps, with
    penalties counting the pending token and bad words waiting on it."""
    _, path = hf_and_dir
    engine = make_engine(path)
    tokenizer = engine.tokenizer
    prompts = [_tokens(n, seed=300 + n) for n in (5, 12, 8, 21)]
    free = run_all(engine, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    # Two-token words the free outputs produce, so each ban really fires.
    words = [tokenizer.decode(o.token_ids[5:7]) for o in free[:2]]
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, bad_words=[words[0]]),
        SamplingParams(
            temperature=0.8,
            seed=4,
            max_tokens=24,
            ignore_eos=True,
            bad_words=words,
            repetition_penalty=1.4,
            logprobs=2,
        ),
        SamplingParams(
            temperature=0,
            max_tokens=24,
            ignore_eos=True,
            frequency_penalty=0.8,
            presence_penalty=0.4,
            logit_bias={free[2].token_ids[0]: -100},
        ),
        SamplingParams(
            temperature=0.9,
            top_p=0.9,
            seed=8,
            max_tokens=24,
            ignore_eos=True,
            allowed_token_ids=list(range(20, 60)),
        ),
    ]
    plain = run_all(make_engine(path, overlap_steps=False), prompts, params)
    overlapped = run_all(make_engine(path, overlap_steps=True), prompts, params)
    assert [o.token_ids for o in overlapped] == [o.token_ids for o in plain]
    for a, b in zip(overlapped[1].outputs[0].logprobs, plain[1].outputs[0].logprobs):
        assert list(a.values()) == pytest.approx(list(b.values()), abs=1e-5)
    word_ids = [tokenizer.encode(w, add_special_tokens=False) for w in words]
    assert _sequence_with(free[0].token_ids, word_ids[0])
    assert not _sequence_with(plain[0].token_ids, word_ids[0])
    assert not any(_sequence_with(plain[1].token_ids, w) for w in word_ids)
    assert free[2].token_ids[0] not in plain[2].token_ids
    assert set(plain[3].token_ids) <= set(range(20, 60))


def test_penalties_and_bias_compose_with_structured_outputs(tmp_path):
    """The grammar mask comes after the penalties and the bias: the output still matches,
    and a bias the grammar forbids cannot let a token through."""
    path = build_tiny_model(tmp_path)
    engine = make_engine(path)
    constraint = StructuredOutputs(regex="[a-d]{12}")
    prompt = engine.tokenizer.encode("Write letters:")
    free = SamplingParams(temperature=0, max_tokens=30, structured_outputs=constraint)
    x_id = engine.tokenizer.encode("x", add_special_tokens=False)[0]
    penalized = SamplingParams(
        temperature=0,
        max_tokens=30,
        structured_outputs=constraint,
        frequency_penalty=2.0,
        logit_bias={x_id: 100.0},
    )
    plain, out = run_all(engine, [prompt, prompt], [free, penalized])
    for o in (plain, out):
        assert o.outputs[0].structured_output_complete is True
        assert len(o.text) == 12 and set(o.text) <= set("abcd"), o.text
    assert out.text != plain.text


def test_ids_outside_the_vocabulary_fail_the_request(hf_and_dir):
    _, path = hf_and_dir
    engine = make_engine(path)
    params = [
        SamplingParams(max_tokens=3, logit_bias={VOCAB: 1.0}),
        SamplingParams(max_tokens=3, allowed_token_ids=[1, VOCAB + 5]),
        SamplingParams(max_tokens=3, temperature=0, repetition_penalty=1.1),
    ]
    outputs = run_all(engine, [[1, 2, 3]] * 3, params)
    assert "logit_bias" in outputs[0].error and "allowed_token_ids" in outputs[1].error
    assert outputs[2].error is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias keys"),
        ({"logit_bias": {5: 101}}, "[-100, 100]"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
    ],
)
def test_invalid_controls_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**kwargs)


def test_logit_bias_takes_the_ids_text():
    assert SamplingParams(logit_bias={"28": -100}).logit_bias == {28: -100.0}
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams(bad_words="hello").bad_words == ["hello"]


def test_seeded_penalized_rows_sample_the_same_whatever_the_batch(hf_and_dir):
    _, path = hf_and_dir
    prompt = _tokens(7, seed=9)
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=16, presence_penalty=1.0)
    alone = run_all(make_engine(path), [prompt], params)[0].token_ids
    others = [_tokens(n, seed=n) for n in (3, 15)]
    crowd = run_all(
        make_engine(path),
        [prompt, *others],
        [params, SamplingParams(temperature=0.7, max_tokens=10), SamplingParams(max_tokens=12)],
    )
    assert crowd[0].token_ids == alone


def test_batch_without_controls_has_none():
    params = [SamplingParams(temperature=0)]
    batch = SamplingBatch.build(params, [None], [[]], torch.device("cpu"))
    assert batch.controls is None
