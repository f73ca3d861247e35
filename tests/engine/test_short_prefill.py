"""Short prefill chunks are attended by the decode kernel, one row per token."""

from __future__ import annotations

import pytest
from hf_models import build_hf_model, hf_greedy, make_engine, run_all
from test_hf_parity import mixed_prompts

from tokenmill.engine import model_runner
from tokenmill.engine.sampling_params import SamplingParams


def _record_steps(runner) -> list[tuple[int, int, list[int]]]:
    """Per step: (decoding sequences, kernel rows, query tokens of each SDPA span)."""
    steps = []
    prepare = runner._prepare

    def recording(out):
        prepared = prepare(out)
        meta = prepared[2]
        steps.append(
            (len(out.decodes), meta.num_decode_tokens, [s.num_query_tokens for s in meta.prefills])
        )
        return prepared

    runner._prepare = recording
    return steps


@pytest.mark.parametrize("short_prefill", [model_runner.SHORT_PREFILL, 0])
def test_folded_and_unfolded_prefills_match_transformers(short_prefill, tmp_path, monkeypatch):
    monkeypatch.setattr(model_runner, "SHORT_PREFILL", short_prefill)
    hf = build_hf_model("llama", tmp_path)
    # A 24-token budget cuts the longer prompts into chunks that continue from cached
    # context, and the shared prefix makes later prompts start past cached blocks.
    engine = make_engine(tmp_path, max_num_batched_tokens=24, enable_prefix_caching=True)
    assert engine.runner.fold_short_prefills, "the native kernel did not build"
    steps = _record_steps(engine.runner)
    prompts = mixed_prompts(256, seed=4)
    outputs = run_all(engine, prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(hf, prompt, 8)[0]
    folded = sum(rows - decodes for decodes, rows, _ in steps)
    spans = [n for _, _, step_spans in steps for n in step_spans]
    if short_prefill:
        assert folded > 0 and all(n > short_prefill for n in spans)
    else:
        assert folded == 0 and spans
