"""Sampling, as batched tensor ops over a step's logits: the sampler (greedy, temperature,
top-k/p, min-p, seeds, logprobs), logit controls (penalties, logit bias, allowed and
banned tokens) and prompt log-probabilities. Grammar masks come from
`core/grammar.py`."""
