"""`LoRARequest`: which LoRA adapter a request runs with (vLLM's shape)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter for `LLM.generate(..., lora_request=...)`.

    Args:
        name: what outputs, results and ledgers call it.
        path: the adapter's directory (adapter_config.json + adapter_model.safetensors),
            or a Hugging Face Hub repo id ("org/name"), fetched into the HF cache as a
            model is.
        revision: branch, tag or commit of a Hub repo id (default "main").

    Requests with the same files share the adapter's loaded weights and cached prefixes,
    whatever their names.
    """

    name: str
    path: str | os.PathLike
    revision: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("a LoRARequest's name must be a non-empty string")
        if not isinstance(self.path, (str, os.PathLike)) or not str(self.path):
            raise ValueError(f"LoRA adapter {self.name!r}: path must be a directory or repo id")
        if self.revision is not None and not isinstance(self.revision, str):
            raise ValueError(f"LoRA adapter {self.name!r}: revision must be a string")
