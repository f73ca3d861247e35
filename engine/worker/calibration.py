"""One float forward pass over a text, recording the inputs of chosen layers: the
statistics int8 quantization smooths its activations with (`quant/calibrate.py`)."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.engine.core.step import ScheduledChunk, SchedulerOutput, Sequence
from tokenmill.engine.types.config import EngineConfig
from tokenmill.engine.types.sampling_params import SamplingParams
from tokenmill.engine.worker.kv_cache import default_kv_cache_format
from tokenmill.engine.worker.model_runner import ModelRunner

_BLOCK_SIZE = 16


@torch.inference_mode()
def input_absmax(
    model: nn.Module, layers: list[nn.Module], token_ids: list[int], *, dtype: torch.dtype
) -> dict[nn.Module, torch.Tensor]:
    """max|x| per input channel of each of `layers`, over one forward pass of token_ids.

    Args:
        model: the loaded float model (its own config, CPU).
        layers: modules inside it whose inputs are measured (the lm_head's too: it is
            read from what the decoder stack returns).
        token_ids: the text to run (at least 2 tokens).
        dtype: the model's dtype.
    Returns:
        layer -> fp32 [in_features].
    """
    config = model.config
    num_blocks = -(-len(token_ids) // _BLOCK_SIZE)
    device = torch.device("cpu")
    # A pass over a few hundred tokens: its cache is too small for huge pages to matter.
    kv_cache = default_kv_cache_format().allocate(
        config, num_blocks, _BLOCK_SIZE, dtype, device, huge_pages=False
    )
    runner = ModelRunner(
        model,
        config,
        kv_cache,
        EngineConfig(block_size=_BLOCK_SIZE),
        max_model_len=len(token_ids),
        device=device,
        dtype=dtype,
    )
    seq = Sequence(
        seq_id=-1,
        request_id="calibration",
        index=0,
        token_ids=list(token_ids),
        num_prompt_tokens=len(token_ids),
        params=SamplingParams(max_tokens=1),
        block_table=list(range(num_blocks)),
    )
    stats: dict[nn.Module, torch.Tensor] = {}

    def add(layer: nn.Module, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
        stats[layer] = torch.maximum(stats[layer], x) if layer in stats else x

    hooks = []
    for layer in layers:
        if layer is getattr(model, "lm_head", None):
            # A pass that samples nothing never calls the lm_head; its input at every
            # position is what the decoder stack returns (the final norm's output).
            hooks.append(
                model.model.register_forward_hook(
                    lambda _module, _inputs, output, head=layer: add(head, output)
                )
            )
        else:
            hooks.append(
                layer.register_forward_hook(lambda module, inputs, _output: add(module, inputs[0]))
            )
    try:
        # All but the last token: a chunk that does not reach the end samples nothing.
        runner.run(SchedulerOutput(prefills=[ScheduledChunk(seq, len(token_ids) - 1)]), None)
    finally:
        for hook in hooks:
            hook.remove()
    return stats
