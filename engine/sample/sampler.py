"""Turn a step's logits into next tokens: greedy, temperature, top-k, top-p, min-p.

Before sampling, in this order: penalties and logit bias (`sample/logit_controls.py`),
the structured outputs mask - a bit-packed mask of each constrained row's allowed tokens
(engine/core/grammar.py) - then allowed_token_ids and the bans. All are tensor ops on the
logits' device, so every later step - logprobs, temperature, filters, sampling - sees
the distribution they leave.

Sampling draws Gumbel-style exponential noise and takes argmax(probs / noise), which
samples exactly from probs. Requests with a seed draw their noise from their own
generator, so a seeded request samples the same tokens whatever else is in the batch.

Everything vocabulary-wide is one tensor op over the batch. On CPU a full sort of a large
vocabulary costs far more than taking its best candidates, so top-k and top-p work on each
row's best 1,024 and only a row whose nucleus is wider is sorted whole; the noise is
-log(rand()), a quarter of exponential_()'s cost (docs/design.md, "Sampling on the
CPU"). On CUDA the sort is cheap and needs no host decision. Every argmax on CPU is the
native one (kernels/argmax.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenmill.engine.core.step import SamplerOutput
from tokenmill.engine.kernels.argmax import argmax_rows
from tokenmill.engine.sample.logit_controls import LogitControls, PenaltyScratch
from tokenmill.engine.types.config import EngineConfig
from tokenmill.engine.types.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.engine.core.grammar import TokenBitmask


@dataclass
class SamplingBatch:
    """Per-row sampling settings for a step, as tensors on the logits' device, plus the
    host-side facts the sampler branches on (so it never reads the device to decide)."""

    temperature: torch.Tensor  # [num_rows] float, 0 for greedy rows
    top_k: torch.Tensor  # [num_rows] long, 0 = off
    top_p: torch.Tensor  # [num_rows] float, 1 = off
    min_p: torch.Tensor  # [num_rows] float, 0 = off
    generators: list[torch.Generator | None]  # per row; None = the shared generator
    # Token ids masked out per row (EOS before min_tokens), as (row, token id) pairs.
    banned_rows: torch.Tensor | None  # [num_banned] long
    banned_token_ids: torch.Tensor | None  # [num_banned] long
    all_greedy: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    max_logprobs: int | None  # None when no row asked for logprobs
    token_bitmask: TokenBitmask | None = None  # allowed tokens of constrained rows
    # Penalties, logit bias, allowed tokens, bans on a pending token (None: no row has any).
    controls: LogitControls | None = None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        banned_token_ids: list[list[int]],
        device: torch.device,
        token_bitmask: TokenBitmask | None = None,
        controls: LogitControls | None = None,
    ) -> SamplingBatch:
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        banned = [(row, t) for row, ids in enumerate(banned_token_ids) for t in ids]

        def put(values: list, dtype: torch.dtype) -> torch.Tensor:
            host = torch.tensor(values, dtype=dtype)
            if device.type == "cuda":  # from pinned memory: the copy does not wait
                return host.pin_memory().to(device, non_blocking=True)
            return host

        return cls(
            temperature=put([p.temperature for p in params], torch.float32),
            top_k=put([p.top_k for p in params], torch.int64),
            top_p=put([p.top_p for p in params], torch.float32),
            min_p=put([p.min_p for p in params], torch.float32),
            generators=generators,
            banned_rows=put([r for r, _ in banned], torch.int64) if banned else None,
            banned_token_ids=put([t for _, t in banned], torch.int64) if banned else None,
            all_greedy=all(p.is_greedy for p in params),
            use_top_k=any(p.top_k > 0 and not p.is_greedy for p in params),
            use_top_p=any(p.top_p < 1 and not p.is_greedy for p in params),
            use_min_p=any(p.min_p > 0 and not p.is_greedy for p in params),
            max_logprobs=max(wanted) if wanted else None,
            token_bitmask=token_bitmask,
            controls=controls,
        )


class Sampler:
    """Samples on the logits' device; only the chosen ids (and logprobs, when asked for)
    ever need to come back to the host."""

    def __init__(self, seed: int = EngineConfig.seed, device: torch.device | None = None) -> None:
        device = device or torch.device("cpu")
        # Noise for rows without a seed of their own, drawn where the logits are.
        self.shared_generator = torch.Generator(device).manual_seed(seed)
        self.penalty_scratch = PenaltyScratch()

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits: [num_rows, vocab] fp32 -> one token per row."""
        controls = batch.controls
        if controls is not None:
            logits = logits.contiguous()
            controls.apply_before_mask(logits, self.penalty_scratch)
        if batch.token_bitmask is not None:
            batch.token_bitmask.apply(logits)
        if controls is not None:
            controls.apply_after_mask(logits)
        if batch.banned_rows is not None:
            logits[batch.banned_rows, batch.banned_token_ids] = float("-inf")
        if batch.all_greedy:
            token_ids = argmax_rows(logits)
        else:
            token_ids = self._sample(logits, batch)
        out = SamplerOutput(token_ids=token_ids)
        if batch.max_logprobs is not None:
            # Logprobs of the distribution before temperature and filtering but after
            # penalties, bias, the grammar and the bans: what the request could sample.
            logprobs = torch.log_softmax(logits, dim=-1)
            out.sampled_logprobs = logprobs.gather(1, token_ids[:, None]).squeeze(1)
            if batch.max_logprobs > 0:
                out.top_logprobs, out.top_token_ids = logprobs.topk(batch.max_logprobs, dim=-1)
        return out

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        is_greedy = batch.temperature == 0
        greedy_ids = argmax_rows(logits)
        temperature = torch.where(is_greedy, torch.ones_like(batch.temperature), batch.temperature)
        logits = logits / temperature[:, None]
        if batch.use_top_k or batch.use_top_p:
            logits = apply_top_k_top_p(
                logits,
                batch.top_k,
                batch.top_p,
                use_top_k=batch.use_top_k,
                use_top_p=batch.use_top_p,
            )
        probs = logits.softmax(dim=-1)
        if batch.use_min_p:
            threshold = batch.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < threshold, 0.0)
        noise = self._exponential_noise(probs, batch.generators)
        sampled = argmax_rows(probs / noise)
        return torch.where(is_greedy, greedy_ids, sampled)

    def _exponential_noise(self, probs: torch.Tensor, generators) -> torch.Tensor:
        # Each seeded row draws from its own generator, so its stream - and therefore its
        # sample - depends only on the request's seed and its position, never on the batch.
        # The generators live on the logits' device: CPU and CUDA streams differ.
        # -log(U) is Exp(1), and U ~ rand() costs a quarter of exponential_() on CPU; U = 0
        # gives +inf noise, which only rules that token out.
        num_rows, vocab = probs.shape
        device = probs.device
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if len(unseeded) == num_rows:
            uniform = torch.rand(num_rows, vocab, device=device, generator=self.shared_generator)
            return uniform.log_().neg_()
        uniform = torch.empty(num_rows, vocab, device=device)
        if unseeded:
            rows = torch.tensor(unseeded, device=device)
            uniform[rows] = torch.rand(
                len(unseeded), vocab, device=device, generator=self.shared_generator
            )
        for row, generator in enumerate(generators):
            if generator is not None:
                torch.rand(vocab, device=device, generator=generator, out=uniform[row])
        return uniform.log_().neg_()


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    *,
    use_top_k: bool = True,
    use_top_p: bool = True,
) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p nucleus with -inf (rows with
    top_k 0 and top_p 1 keep every logit). use_top_k/use_top_p=False skip a filter no
    row uses, decided on the host.

    Top-k keeps the k best tokens; top-p then keeps the smallest run of best tokens whose
    probability (after top-k) reaches top_p, the token that crosses it included.
    """
    if logits.device.type == "cpu":
        return _top_k_top_p_on_candidates(logits, top_k, top_p)
    return _top_k_top_p_sorted(logits, top_k, top_p, use_top_k=use_top_k, use_top_p=use_top_p)


# Candidates per row for top-p on CPU: a nucleus rarely holds more than this many tokens,
# and a row whose does is sorted in full.
TOP_P_CANDIDATES = 1024


def _top_k_top_p_on_candidates(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """apply_top_k_top_p over each row's best candidates (torch.topk) instead of the whole
    sorted vocabulary; it reads the device to decide, which costs nothing on CPU."""
    has_top_k, has_top_p = top_k > 0, top_p < 1
    is_filtered = has_top_k | has_top_p
    if not bool(is_filtered.any()):
        return logits
    vocab = logits.shape[-1]
    k = torch.where(has_top_k, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
    needed = torch.where(has_top_k, k, torch.full_like(k, min(vocab, TOP_P_CANDIDATES)))
    num_candidates = int(needed[is_filtered].max())
    candidates, order = logits.topk(num_candidates, dim=-1)  # best first
    positions = torch.arange(num_candidates, device=logits.device)
    candidates = candidates.masked_fill(positions >= k[:, None], float("-inf"))
    is_wide = torch.zeros_like(has_top_p)
    if bool(has_top_p.any()):
        # Probabilities over the whole vocabulary (over the top k where top-k is on).
        normalizer = torch.where(has_top_k, candidates.logsumexp(dim=-1), logits.logsumexp(dim=-1))
        probs = (candidates - normalizer[:, None]).exp()
        mass_before = probs.cumsum(dim=-1) - probs  # the token that crosses top_p is kept
        candidates = candidates.masked_fill(mass_before >= top_p[:, None], float("-inf"))
        # A nucleus wider than the candidates: that row is sorted in full below.
        is_wide = has_top_p & ~has_top_k & (probs.sum(dim=-1) < top_p)
        is_wide &= num_candidates < vocab
    out = torch.full_like(logits, float("-inf")).scatter_(1, order, candidates)
    out = torch.where(is_filtered[:, None], out, logits)
    if bool(is_wide.any()):
        rows = is_wide.nonzero().squeeze(1)
        out[rows] = _top_k_top_p_sorted(logits[rows], top_k[rows], top_p[rows], use_top_k=False)
    return out


def _top_k_top_p_sorted(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    *,
    use_top_k: bool = True,
    use_top_p: bool = True,
) -> torch.Tensor:
    """apply_top_k_top_p by sorting the whole vocabulary of every row."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    if use_top_k:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
        kth = sorted_logits.gather(1, (k - 1)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if use_top_p:
        probs = sorted_logits.softmax(dim=-1)
        # Mass strictly before each token; the token that crosses top_p is kept.
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
