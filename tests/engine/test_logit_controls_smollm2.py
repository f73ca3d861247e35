"""Penalties and logit bias on the real default model, SmolLM2-135M-Instruct, in fp32:
greedy outputs equal HF transformers' `generate` with its own processors for the
repetition penalty and the logit bias (`repetition_penalty=`, `sequence_bias=`) and with
OpenAI's presence/frequency formula over the generated tokens."""

from __future__ import annotations

import pytest
import torch
from model_fixtures import converted_smollm2_dir, smollm2_gguf_path
from transformers import LogitsProcessor, LogitsProcessorList

from tokenmill import LLM, SamplingParams
from tokenmill.engine.loader.model_files import ModelFilesError

NUM_TOKENS = 32
QUESTIONS = ["List five fruits, one per line.", "Write the numbers from one to twenty in words."]


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's definition over the generated tokens: logit -= presence * (count > 0) +
    frequency * count."""

    def __init__(self, num_prompt_tokens: int, presence: float, frequency: float) -> None:
        self.start, self.presence, self.frequency = num_prompt_tokens, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[:, self.start :]
        counts = torch.zeros_like(scores).scatter_add_(
            1, generated, torch.ones_like(generated, dtype=scores.dtype)
        )
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


@pytest.fixture(scope="module")
def models():
    try:
        smollm2_gguf_path()
    except ModelFilesError as error:
        pytest.skip(str(error))
    import transformers

    path = converted_smollm2_dir()
    llm = LLM(str(path), dtype="float32", device="cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = []
    for question in QUESTIONS:
        text = llm.tokenizer.apply_chat_template([{"role": "user", "content": question}])
        prompts.append(llm.tokenizer.encode(text, add_special_tokens=False))
    return llm, hf, prompts


def hf_greedy(hf, prompt: list[int], **kwargs) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=NUM_TOKENS,
            do_sample=False,
            eos_token_id=None,  # the engine is asked to ignore EOS too
            pad_token_id=0,
            **kwargs,
        )
    return out[0, len(prompt) :].tolist()


def ours(llm, prompts, **controls) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, **controls)
    return [o.token_ids for o in llm.generate(prompts, params)]


def test_repetition_penalty_equals_transformers(models):
    llm, hf, prompts = models
    got = ours(llm, prompts, repetition_penalty=1.3)
    for prompt, tokens in zip(prompts, got):
        assert tokens == hf_greedy(hf, prompt, repetition_penalty=1.3)
    assert got != ours(llm, prompts)  # it changed the answers


@pytest.mark.parametrize("presence, frequency", [(1.5, 0.0), (0.0, 1.0)])
def test_presence_and_frequency_penalties_equal_openais_formula(models, presence, frequency):
    llm, hf, prompts = models
    got = ours(llm, prompts, presence_penalty=presence, frequency_penalty=frequency)
    for prompt, tokens in zip(prompts, got):
        processor = OpenAIPenalties(len(prompt), presence, frequency)
        assert tokens == hf_greedy(hf, prompt, logits_processor=LogitsProcessorList([processor]))
    assert got != ours(llm, prompts)


def test_logit_bias_equals_transformers_sequence_bias(models):
    llm, hf, prompts = models
    free = ours(llm, prompts)
    # Ban each answer's first token and favour a token it did not use.
    bias = {free[0][0]: -100.0, free[1][0]: -100.0, 28: 5.0}
    got = ours(llm, prompts, logit_bias=bias)
    sequence_bias = {(token,): value for token, value in bias.items()}
    for prompt, tokens in zip(prompts, got):
        assert tokens == hf_greedy(hf, prompt, sequence_bias=sequence_bias)
        assert free[0][0] not in tokens and free[1][0] not in tokens
