"""How the checkpoints beside this script were made: a random one-layer Llama (bf16)
quantized data-free by llm-compressor 0.14 (compressed-tensors 0.19, transformers 5.17),
in its own virtual environment - the tests never need it:

    python make_checkpoints.py OUT W4A16_ASYM W8A8 FP8_DYNAMIC
"""

import sys
from pathlib import Path

import torch
import transformers
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier


def main(out: Path, schemes: list[str]) -> None:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(7)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out / "float")
    for scheme in schemes:
        # oneshot reads the model's name_or_path: it must come from a directory.
        model = transformers.AutoModelForCausalLM.from_pretrained(
            out / "float", dtype=torch.bfloat16
        )
        recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
        oneshot(model=model, recipe=recipe)
        model.save_pretrained(out / scheme, save_compressed=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
