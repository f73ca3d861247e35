"""The host's time per engine step, with the model's compute taken out.

    python benchmarks/host_overhead.py [--seqs 256] [--prompts 1024] [--rounds 3]

On a GPU the device finishes a small model's decode step in about 2 ms (SmolLM2-135M,
256 sequences, H200: benchmarks/README.md); whatever the host spends scheduling,
preparing inputs and turning sampled ids into sequence updates on top of that leaves the
device idle. This runs the real scheduler, block manager, input preparation, sampling
batch and step resolution on the CPU over a model whose forward pass returns at once, so
the figure is the engine's own bookkeeping per step: the number to drive down.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from tiny_model import build_tiny_model  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402


class InstantModel(torch.nn.Module):
    """The model's interface with no compute: hidden states and logits of zeros."""

    def __init__(self, model: torch.nn.Module, vocab_size: int) -> None:
        super().__init__()
        self.model = model.model
        self.hidden = torch.zeros(8192, 8)
        self.logits = torch.zeros(1024, vocab_size)
        self.logits[:, 0] = 1.0  # every row's argmax: token 0

    def forward(self, input_ids, cos, sin, meta):
        return self.hidden[: input_ids.shape[0]]

    def compute_logits(self, hidden):
        return self.logits[: hidden.shape[0]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, default=256, help="max_num_seqs")
    parser.add_argument("--prompts", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the host's work is one Python thread; keep torch beside it

    model_dir = build_tiny_model(tempfile.mkdtemp(), max_position_embeddings=1024)
    llm = LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        max_num_seqs=args.seqs,
        max_num_batched_tokens=8192,
        kv_cache_memory=1 << 30,
        overlap_steps=True,
    )
    vocab = llm.model_config.vocab_size
    runner = llm.engine.runner
    runner.model = InstantModel(runner.model, vocab)
    runner.use_attention_backend("portable")  # the cheapest metadata; no kernel runs anyway
    rng = random.Random(0)
    shared = [rng.randrange(vocab) for _ in range(256)]
    prompts = [
        (shared if i % 2 else []) + [rng.randrange(vocab) for _ in range(rng.randrange(50, 150))]
        for i in range(args.prompts)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    per_step = []
    for _ in range(args.rounds):
        steps_before = llm.stats().num_steps
        # CPU time, not wall time: on a shared machine it counts only our own work.
        start = time.process_time()
        llm.generate(prompts, params)
        seconds = time.process_time() - start
        num_steps = llm.stats().num_steps - steps_before
        per_step.append(1000 * seconds / num_steps)
        # The prefix cache keeps the prompts: later rounds are all decode, as on a GPU.
    print(
        f"{args.prompts} prompts, max_num_seqs {args.seqs}: host CPU ms per step "
        + " / ".join(f"{x:.2f}" for x in per_step)
        + f" (median {statistics.median(per_step):.2f})"
    )


if __name__ == "__main__":
    main()
