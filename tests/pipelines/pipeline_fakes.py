"""Fakes for the pipelines tests: a character tokenizer and a scripted LLM."""

from __future__ import annotations

import time
from pathlib import Path

from tokenmill.engine.types.outputs import (
    CompletionOutput,
    EngineStats,
    RequestMetrics,
    RequestOutput,
)
from tokenmill.engine.types.sampling_params import SamplingParams

BOS = 1


class CharTokenizer:
    """One token per character (its code point); raw text gets a BOS token.

    Its chat template renders `<role>content</>` turns and an `<assistant>` header;
    `CharTokenizer(chat_template=None)` is a model without one.
    """

    eos_token_ids = [2]

    def __init__(self, chat_template: str | None = "<role>content</>") -> None:
        self.chat_template = chat_template

    def encode_batch(self, texts, add_special_tokens=True):
        return [([BOS] if add_special_tokens else []) + [ord(c) for c in t] for t in texts]

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i > 2)

    def apply_chat_template(self, messages, *, add_generation_prompt=True, tokenize=False):
        if self.chat_template is None:
            raise ValueError("this model has no chat template")
        for m in messages:
            if m["role"] == "assistant" and m["content"] == "BOOM":
                raise ValueError("template rejects this conversation")
        text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


class FakeLLM:
    """Answers each prompt with its token count; counts its generate calls.

    Prefix caching is imitated: a prompt's tokens shared with any earlier prompt's
    leading tokens count as cached. `on_step` is called once per request, with
    counters that grow as the engine's do.
    """

    def __init__(
        self, *, model_dir, max_model_len=4096, device="cpu", fail_on=None, chat_template=True
    ):
        self.max_model_len = max_model_len
        self.device = device
        self.model_dir = Path(model_dir)
        self.tokenizer = CharTokenizer() if chat_template else CharTokenizer(chat_template=None)
        self.calls: list[int] = []
        self.fail_on = fail_on  # a token id whose presence makes the engine error
        self._seen: list[list[int]] = []
        self.engine_stats = EngineStats()

    def stats(self):
        return self.engine_stats

    def generate(self, prompts, sampling_params=None, *, on_output=None, on_step=None):
        self.calls.append(len(prompts))
        params = sampling_params
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompts)
        outs = []
        for i, (ids, sp) in enumerate(zip(prompts, params)):
            cached = max((_common(ids, s) for s in self._seen), default=0)
            cached = min(cached, len(ids) - 1)
            self._seen.append(list(ids))
            now = time.perf_counter()
            metrics = RequestMetrics(arrival_time=now - 0.01 * (i + 1), finish_time=now)
            if self.fail_on is not None and self.fail_on in ids:
                out = RequestOutput(
                    str(i),
                    None,
                    list(ids),
                    [CompletionOutput(0, "", [], "error")],
                    len(ids),
                    0,
                    0,
                    metrics,
                    error="engine refused",
                )
            else:
                n = min(sp.max_tokens, 3)
                text = f"len={len(ids)}"
                reason = "length" if n == sp.max_tokens else "stop"
                out = RequestOutput(
                    str(i),
                    None,
                    list(ids),
                    [CompletionOutput(0, text, [5] * n, reason)],
                    len(ids),
                    cached,
                    n,
                    metrics,
                )
            outs.append(out)
            stats = self.engine_stats
            stats.computed_prompt_tokens += out.prompt_tokens - out.cached_tokens
            stats.cached_prompt_tokens += out.cached_tokens
            stats.generated_tokens += out.completion_tokens
            if on_output is not None:
                on_output(out)
            if on_step is not None:
                on_step(stats)
        return outs


def _common(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
