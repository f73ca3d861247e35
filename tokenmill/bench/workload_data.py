"""`Workload`: a benchmark's concrete requests - data only, shared by the presets that
draw token ids (workload.py) and the ones built from text (extract.py) - and the
vocabulary the drawn ones (and the image prompts, image_workload.py) draw from."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class Workload:
    """Concrete requests: prompt token ids and how many tokens to generate for each.

    prefix_group[i] is the prefix group of request i (None for a unique prompt) and
    shared_len[i] the number of its leading tokens shared with the rest of its group.
    """

    name: str
    prompt_ids: list[list[int]]
    output_lens: list[int]
    prefix_group: list[int | None]
    shared_len: list[int]
    spec: dict = field(default_factory=dict)
    # A structured workload: the JSON schema its constrained runs enforce.
    json_schema: dict | None = None
    # Requests run one at a time, each submitted when the previous one has finished;
    # their latencies count from their own submission.
    sequential: bool = False
    # A LoRA workload: the adapter of each request (WorkloadSpec.num_adapters).
    adapters: list[int] | None = None

    @property
    def num_requests(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_unique_prompt_tokens(self) -> int:
        """Prompt tokens left to compute when each group's shared prefix is computed once."""
        seen: set[int] = set()
        total = 0
        for ids, group, shared in zip(self.prompt_ids, self.prefix_group, self.shared_len):
            skip = shared if group is not None and group in seen else 0
            if group is not None:
                seen.add(group)
            total += len(ids) - skip
        return total

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self)))

    @classmethod
    def from_json(cls, path: str | Path) -> Workload:
        return cls(**json.loads(Path(path).read_text()))


def ordinary_token_ids(tokenizer_json: str | Path) -> list[int]:
    """Every id of a `tokenizer.json` vocabulary except added/special tokens, sorted.

    Args:
        tokenizer_json: path of the HF `tokenizers` file.

    Returns:
        The ids prompts may be drawn from.
    """
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(tokenizer_json))
    added = set(backend.get_added_tokens_decoder())
    return [i for i in range(backend.get_vocab_size(with_added_tokens=True)) if i not in added]
