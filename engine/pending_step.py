"""A launched step whose sampled tokens may still be on the device.

On CUDA the engine overlaps steps: it launches step N, then - while the GPU computes it -
turns step N-1's sampled tokens into sequence updates, finished requests and the next
schedule. Each sampling sequence of a launched step holds a placeholder token until the
step is resolved; the next step reads the real ids on the device (`ModelRunner` gathers
them from `token_ids`), so the host never waits for them before launching.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.engine.sampler import SamplerOutput
from tokenmill.engine.sequence import Sequence

# Stands for a token id not known yet; never a valid id, so a bug that lets one reach the
# model fails loudly (an out-of-range embedding index) instead of computing quietly.
PLACEHOLDER_TOKEN_ID = -1


@dataclass
class PendingStep:
    """The sampling sequences of one launched step, in row order, and what they sampled."""

    seqs: list[Sequence]
    sampled: SamplerOutput  # on the device
    _host: SamplerOutput | None = field(default=None, repr=False)  # pinned copies (CUDA)
    _copied: torch.cuda.Event | None = field(default=None, repr=False)

    @classmethod
    def launch(cls, seqs: list[Sequence], sampled: SamplerOutput) -> PendingStep:
        """Start copying what was sampled to the host, without waiting for it."""
        step = cls(seqs, sampled)
        if sampled.token_ids.device.type == "cuda":

            def pinned(t: torch.Tensor | None) -> torch.Tensor | None:
                if t is None:
                    return None
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                return host.copy_(t, non_blocking=True)

            step._host = SamplerOutput(
                token_ids=pinned(sampled.token_ids),
                sampled_logprobs=pinned(sampled.sampled_logprobs),
                top_logprobs=pinned(sampled.top_logprobs),
                top_token_ids=pinned(sampled.top_token_ids),
            )
            step._copied = torch.cuda.Event()
            step._copied.record()
        return step

    @property
    def device_token_ids(self) -> torch.Tensor:
        """[num_rows] the sampled ids, on the device (for the next step's inputs)."""
        return self.sampled.token_ids

    def host_sampled(self) -> SamplerOutput:
        """What was sampled, on the host; waits only for this step's copies."""
        if self._copied is None:
            return self.sampled
        self._copied.synchronize()
        return self._host
