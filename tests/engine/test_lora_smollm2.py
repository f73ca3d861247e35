"""LoRA adapters on the real default model, SmolLM2-135M-Instruct (fp32): prompts mixed
over three random PEFT adapters and the base model, in one generate call, give the
greedy tokens of transformers running PEFT's merged model for each - and again with
chunked prefill, a shared prefix served from the cache, and preemption."""

from __future__ import annotations

import pytest
import torch
from model_fixtures import converted_smollm2_dir, smollm2_gguf_path
from peft_adapters import ALL_TARGETS, save_adapter

from tokenmill import LLM, LoRARequest, SamplingParams
from tokenmill.engine.loader.model_files import ModelFilesError

NUM_TOKENS = 10
QUESTIONS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write a haiku about rain.",
    "How many legs does a spider have?",
    "Give me a synonym for happy.",
    "What is 12 times 12?",
    "Describe the moon in one sentence.",
    "Which ocean is the largest?",
]
SYSTEM = "You are a concise assistant. Answer in one short sentence, without preamble."


@pytest.fixture(scope="module")
def model_dir():
    try:
        smollm2_gguf_path()
    except ModelFilesError as error:
        pytest.skip(str(error))
    return converted_smollm2_dir()


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2-adapters")
    specs = {
        "qv-r8": dict(r=8, alpha=16, targets=("q_proj", "v_proj"), seed=11),
        "all-r16": dict(r=16, alpha=16, targets=ALL_TARGETS, seed=12, use_rslora=True),
        "mlp-r4": dict(r=4, alpha=8, targets=("gate_proj", "up_proj", "down_proj"), seed=13),
    }
    return {
        name: save_adapter(model_dir, out / name, b_std=0.02, **spec)
        for name, spec in specs.items()
    }


@pytest.fixture(scope="module")
def base_hf(model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy continuation (KV-cached), end-of-sequence ignored."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=num_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def rows(model_dir, adapters, base_hf):
    """Each question as a chat prompt after a shared system prompt, cycling over the base
    model and the adapters; with each row's reference tokens and the base model's."""
    from tokenmill.engine.loader.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model_dir)
    requests = [None, *(LoRARequest(name, a.path) for name, a in adapters.items())]
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
            ),
            add_special_tokens=False,
        )
        for q in QUESTIONS
    ]
    requests = [requests[i % len(requests)] for i in range(len(prompts))]
    expected, base = [], []
    for prompt, request in zip(prompts, requests):
        base.append(hf_greedy(base_hf, prompt, NUM_TOKENS))
        merged = None if request is None else adapters[request.name].merged
        expected.append(base[-1] if merged is None else hf_greedy(merged, prompt, NUM_TOKENS))
    return prompts, requests, expected, base


@pytest.mark.parametrize(
    "settings",
    [
        {},
        # chunked prefill, prefix caching of the shared system prompt, preemption
        {
            "max_num_batched_tokens": 32,
            "kv_cache_memory": 10 * 16 * 2 * 30 * 3 * 64 * 4,
            "max_num_seqs": 16,  # set: admitted by their prompt alone, so decode preempts
        },
    ],
    ids=["plain", "chunked-cached-preempted"],
)
def test_mixed_adapters_match_peft_on_smollm2(model_dir, rows, settings):
    prompts, requests, expected, base = rows
    llm = LLM(str(model_dir), dtype="float32", device="cpu", **settings)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, lora_request=requests)
    assert [o.token_ids for o in outputs] == expected
    assert [o.lora_request for o in outputs] == requests
    # The adapters change the answers.
    assert sum(e != b for e, b, r in zip(expected, base, requests) if r is not None) >= 3
    if settings:
        stats = llm.stats()
        assert stats.cached_prompt_tokens > 0
        assert stats.num_preemptions > 0
