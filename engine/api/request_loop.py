"""What every `LLM` call does once its requests are queued: step the engine until they
are all answered, and give each caller's hooks what they asked for.

`generate`, `chat` and `encode` differ in what they queue, not in how they wait for it,
so the loop (and its rule for a failed step) is written once, here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tokenmill.engine.types.outputs import EngineStats


def per_prompt(value: Any, kind: type, num_prompts: int, what: str) -> list:
    """`value` for each of `num_prompts` prompts: one value (an instance of `kind`, or
    None) for all of them, or a sequence of one each.

    Raises:
        ValueError: a sequence of another length.
    """
    if value is None or isinstance(value, kind):
        return [value] * num_prompts
    values = list(value)
    if len(values) != num_prompts:
        raise ValueError(f"got {len(values)} {what} for {num_prompts} prompts")
    return values


def run_to_completion(
    engine: Any,
    request_ids: Sequence[str],
    *,
    on_output: Callable[[Any], None] | None = None,
    on_step: Callable[[EngineStats], None] | None = None,
    annotate: Callable[[int, Any], None] | None = None,
) -> list:
    """Step `engine` until it has nothing unfinished; the outputs of `request_ids` (all
    queued already), in their order.

    Args:
        engine: an LLMEngine or EncoderEngine.
        request_ids: the requests whose outputs to return.
        on_output: called with each output as its request finishes.
        on_step: called after each step with the engine's cumulative stats; an
            exception it raises ends the call as a failed step does.
        annotate: called with (index, output) before on_output sees the output.

    Raises:
        Whatever a step raises: every queued request is dropped first (`abort_all`), so
        none is left for the next call and the engine stays usable.
    """
    position = {rid: i for i, rid in enumerate(request_ids)}
    results: list = [None] * len(request_ids)
    try:
        while engine.has_unfinished:
            for output in engine.step():
                index = position[output.request_id]
                if annotate is not None:
                    annotate(index, output)
                results[index] = output
                if on_output is not None:
                    on_output(output)
            if on_step is not None:
                on_step(engine.stats)
    except BaseException:
        engine.abort_all()
        raise
    return results
