"""Generated tokens' log-probabilities as a results column: token text and bytes, the
sampled token's logprob and the requested number of likeliest alternatives.

Pure functions. The engine gives each generated token a {token id: logprob} dict - the
sampled token plus its request's top k (`SamplingParams.logprobs`), the sampled one among
them when it is one of the k; this turns it into OpenAI's shape, which the OpenAI batch
writer reads back for chat (`logprobs.content`) and completions (the legacy lists).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa

from tokenmill.engine import CompletionOutput, SamplingParams

TOKEN_TYPE = pa.struct(
    [("token", pa.string()), ("logprob", pa.float64()), ("bytes", pa.list_(pa.int32()))]
)
LOGPROBS_TYPE = pa.list_(pa.struct([*TOKEN_TYPE, pa.field("top_logprobs", pa.list_(TOKEN_TYPE))]))

# token ids -> each token's bytes (`Tokenizer.token_bytes`).
TokenBytes = Callable[[list[int]], list[bytes]]


class LogprobsColumn:
    """Builds a completion's `logprobs` value for its row's params.

    Args:
        token_bytes: the model's tokenizer's `token_bytes`.
        params: the job's distinct SamplingParams (rows refer to them by index).
    """

    def __init__(self, token_bytes: TokenBytes, params: Sequence[SamplingParams]) -> None:
        self._token_bytes = token_bytes
        self._params = params

    def __call__(self, params_index: int, completion: CompletionOutput) -> list[dict] | None:
        """[{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}] per generated
        token; None when the row asked for none."""
        k = getattr(self._params[params_index], "logprobs", None)  # pooling rows: none
        if k is None or completion.logprobs is None:
            return None
        steps = []
        for token_id, entry in zip(completion.token_ids, completion.logprobs):
            top = sorted(entry.items(), key=lambda item: -item[1])[:k]
            steps.append((token_id, entry[token_id], top))
        ids = sorted({t for t, _, top in steps for t in [t, *(a for a, _ in top)]})
        described = dict(zip(ids, self._token_bytes(ids)))
        return [
            {
                **_token(described, token_id, logprob),
                "top_logprobs": [_token(described, a, lp) for a, lp in top],
            }
            for token_id, logprob, top in steps
        ]


def _token(described: dict[int, bytes], token_id: int, logprob: float) -> dict[str, Any]:
    raw = described[token_id]
    return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}
