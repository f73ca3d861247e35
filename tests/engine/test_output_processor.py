"""The output processor (core/output_processor.py) on its own: finish reasons in their
order of precedence, stop strings cut from the text, bans, and the outputs it builds -
with no scheduler, model or device."""

from __future__ import annotations

import torch

from tokenmill.engine.core.detokenizer import IncrementalDetokenizer
from tokenmill.engine.core.output_processor import OutputProcessor
from tokenmill.engine.core.step import SamplerOutput, Sequence, SequenceStatus
from tokenmill.engine.types.outputs import EngineStats
from tokenmill.engine.types.sampling_params import SamplingParams

EOS = 0
LETTERS = "_abcdefgh "  # token id i decodes to LETTERS[i]; 0 is EOS


class Letters:
    """A tokenizer whose token i is one letter (EOS decodes to nothing)."""

    eos_token_ids = (EOS,)

    def decode(self, ids, skip_special_tokens=True):
        return "".join(LETTERS[i] for i in ids if i != EOS)

    def encode(self, text, add_special_tokens=False):
        return [LETTERS.index(c) for c in text]


def processor(max_seq_len: int = 64) -> OutputProcessor:
    return OutputProcessor(Letters(), {EOS}, max_seq_len, EngineStats())


def sequence(params: SamplingParams, prompt=(1, 2, 3)) -> Sequence:
    return Sequence(
        seq_id=0,
        request_id="r",
        index=0,
        token_ids=list(prompt),
        num_prompt_tokens=len(prompt),
        params=params,
        detokenizer=IncrementalDetokenizer(Letters()) if params.stop else None,
    )


def feed(proc: OutputProcessor, seq: Sequence, token_ids: list[int]) -> list[str | None]:
    """Resolve each token as the engine loop does; the reasons returned, one per token."""
    sampled = SamplerOutput(torch.tensor(token_ids), torch.zeros(len(token_ids)))
    reasons = []
    for row, token_id in enumerate(token_ids):
        seq.token_ids.append(token_id)
        reasons.append(proc.add_token(seq, token_id, sampled, row, now=1.0))
    return reasons


def test_eos_stops_only_after_min_tokens_and_max_tokens_gives_length():
    proc = processor()
    seq = sequence(SamplingParams(min_tokens=2, max_tokens=4))
    assert feed(proc, seq, [EOS, 5, EOS]) == [None, None, "stop"]
    seq = sequence(SamplingParams(max_tokens=3, ignore_eos=True))
    assert feed(proc, seq, [EOS, EOS, EOS]) == [None, None, "length"]
    seq = sequence(SamplingParams(max_tokens=8, stop_token_ids=[4]))
    assert feed(proc, seq, [5, 4]) == [None, "stop"]


def test_the_context_ends_a_sequence_with_length():
    proc = processor(max_seq_len=5)
    seq = sequence(SamplingParams(max_tokens=100))
    assert feed(proc, seq, [5, 6]) == [None, "length"]


def test_a_stop_string_cuts_the_text_and_the_output_carries_it():
    proc = processor()
    params = SamplingParams(max_tokens=20, stop=["ce"])
    seq = sequence(params)
    assert feed(proc, seq, [1, 2, 3, 5]) == [None, None, None, "stop"]
    assert seq.stop_text == "ab"
    kept = sequence(SamplingParams(max_tokens=20, stop=["ce"], include_stop_str_in_output=True))
    assert feed(proc, kept, [1, 3, 5]) == [None, None, "stop"]
    assert kept.stop_text == "ace"
    request = proc.new_request(
        "r", [1, 2, 3], kept.params, prompt="abc", arrival_time=0.5, pooling=None
    )
    kept.status, kept.finish_reason = SequenceStatus.FINISHED, "stop"
    request.seqs.append(kept)
    out = proc.output(request, now=2.0)
    assert (out.text, out.token_ids, out.finish_reason) == ("ace", [1, 3, 5], "stop")
    assert (out.prompt_tokens, out.completion_tokens, out.cached_tokens) == (3, 3, 0)
    assert out.metrics.latency == 1.5 and out.metrics.time_to_first_token == 0.5
    assert proc.stats.prompt_tokens == 3


def test_bans_before_min_tokens_and_bad_words():
    proc = processor()
    params = SamplingParams(min_tokens=2, stop_token_ids=[7], bad_words=["g", "ab"])
    request = proc.new_request("r", [1], params, prompt=None, arrival_time=None, pooling=None)
    assert request.bad_words == [[7], [1, 2]]
    seq = sequence(params, prompt=(3,))
    # Before min_tokens: stop ids, EOS and the one-token bad word.
    assert proc.bans(seq, request) == ([EOS, 7], [])
    seq.token_ids += [4, 1]  # the output ends with "a": "b" would complete "ab"
    assert proc.bans(seq, request) == ([2, 7], [])


def test_an_error_output_is_counted_and_says_why():
    proc = processor()
    request = proc.new_request(
        "r", [], SamplingParams(), prompt="", arrival_time=None, pooling=None
    )
    out = proc.error_output(request, "prompt is empty (0 tokens)")
    assert out.finish_reason == "error" and out.error == "prompt is empty (0 tokens)"
    assert out.metrics.finish_time is not None and proc.stats.num_errors == 1
