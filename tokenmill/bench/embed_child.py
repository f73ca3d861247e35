"""The embedding benchmark's child process: one system embeds the workload once.

    python -m tokenmill.bench.embed_child run SYSTEM.json WORKLOAD.json RESULT.json
    python -m tokenmill.bench.embed_child export MODEL_DIR MODEL.onnx

Systems (each in a fresh process, so its threads, caches and peak RSS are its own):

    tokenmill   LLM(model, dtype=...).embed(texts): packed batches, no padding
    st          sentence-transformers' encode(texts, batch_size=32): its default path,
                texts sorted by length, each batch padded to its longest text
    onnx        ONNX Runtime on the model exported by torch.onnx (dynamo), driven the way
                sentence-transformers' backend="onnx" drives it: the same sorting,
                batching, padding, mean pooling and normalisation

Model loading and a warm-up pass over a few texts are not timed. The embeddings are
saved (float32 .npy) so the harness can compare every system with the reference.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from tokenmill.bench.embed_workload import EmbedWorkload
from tokenmill.bench.result import cpu_seconds, load_avg_1m, peak_rss_bytes

WARMUP_TEXTS = 64
BATCH_SIZE = 32  # sentence-transformers' default


@dataclass
class EmbedSystem:
    label: str
    kind: str  # tokenmill | st | onnx
    dtype: str = "float32"
    model_dir: str = ""
    onnx_path: str | None = None
    engine_args: dict = field(default_factory=dict)
    threads: int | None = None


@dataclass
class EmbedRun:
    label: str
    wall_s: float
    lengths: list[int]  # tokens each text was computed with (after truncation)
    num_computed_tokens: int  # through the model, padding included
    num_input_tokens: int  # the texts' tokens before truncation
    embeddings_path: str
    cpu_s: float = 0.0
    peak_rss_bytes: int = 0
    load_avg_1m: float = 0.0
    extra: dict = field(default_factory=dict)


def run(system: EmbedSystem, workload: EmbedWorkload, result_path: Path) -> EmbedRun:
    if system.threads:
        import torch

        torch.set_num_threads(system.threads)
    runner = {"tokenmill": _tokenmill, "st": _sentence_transformers, "onnx": _onnx}[system.kind]
    embed, lengths_of, padded_tokens = runner(system)
    texts = workload.texts
    embed(texts[:WARMUP_TEXTS])
    cpu0, start = cpu_seconds(), time.perf_counter()
    vectors = embed(texts)
    wall = time.perf_counter() - start
    cpu = cpu_seconds() - cpu0
    lengths = lengths_of(texts)
    path = result_path.with_suffix(".npy")
    np.save(path, np.asarray(vectors, dtype=np.float32))
    return EmbedRun(
        label=system.label,
        wall_s=wall,
        lengths=lengths,
        num_computed_tokens=padded_tokens(texts, lengths),
        num_input_tokens=_input_tokens(system.model_dir, texts),
        embeddings_path=str(path),
        cpu_s=cpu,
        peak_rss_bytes=peak_rss_bytes(),
        load_avg_1m=load_avg_1m(),
    )


def _tokenmill(system: EmbedSystem):
    from tokenmill.engine import LLM

    llm = LLM(system.model_dir, dtype=system.dtype, device="cpu", **system.engine_args)
    outputs: dict[str, list] = {}

    def embed(texts):
        done = llm.embed(texts)
        outputs["last"] = done
        return np.stack([o.data.numpy() for o in done])

    def lengths_of(texts):
        return [len(o.prompt_token_ids) for o in outputs["last"]]

    return embed, lengths_of, lambda texts, lengths: sum(lengths)  # packed: no padding


def _sorted_batches(texts: list[str]) -> list[list[int]]:
    """sentence-transformers' order: longest text (in characters) first, in batches."""
    order = np.argsort([-len(t) for t in texts], kind="stable").tolist()
    return [order[i : i + BATCH_SIZE] for i in range(0, len(order), BATCH_SIZE)]


def _padded(texts: list[str], lengths: list[int]) -> int:
    return sum(len(b) * max(lengths[i] for i in b) for b in _sorted_batches(texts))


def _sentence_transformers(system: EmbedSystem):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(system.model_dir, device="cpu")

    def embed(texts):
        return model.encode(texts, batch_size=BATCH_SIZE, show_progress_bar=False)

    def lengths_of(texts):
        mask = model.tokenize(texts)["attention_mask"]
        return mask.sum(1).tolist()

    return embed, lengths_of, _padded


def _onnx(system: EmbedSystem):
    import onnxruntime as ort
    from tokenizers import Tokenizer

    from tokenmill.engine import read_pooling_config

    config = read_pooling_config(system.model_dir, is_encoder=True)
    if config.modes != ("mean",):
        raise ValueError(f"the ONNX baseline pools by the mean only, not {config.modes}")
    tokenizer = Tokenizer.from_file(str(Path(system.model_dir) / "tokenizer.json"))
    tokenizer.enable_truncation(config.max_seq_length or 512)
    tokenizer.enable_padding()
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if system.threads:
        options.intra_op_num_threads = system.threads
    session = ort.InferenceSession(system.onnx_path, options, providers=["CPUExecutionProvider"])

    def embed(texts):
        out = np.zeros((len(texts), 0), np.float32)
        for batch in _sorted_batches(texts):
            encoded = tokenizer.encode_batch([texts[i] for i in batch])
            ids = np.array([e.ids for e in encoded], np.int64)
            mask = np.array([e.attention_mask for e in encoded], np.int64)
            hidden = session.run(None, {"input_ids": ids, "attention_mask": mask})[0]
            pooled = (hidden * mask[..., None]).sum(1) / np.maximum(
                mask.sum(1, keepdims=True), 1e-9
            )
            if config.normalize:
                pooled /= np.linalg.norm(pooled, axis=1, keepdims=True)
            if out.shape[1] == 0:
                out = np.zeros((len(texts), pooled.shape[1]), np.float32)
            out[batch] = pooled
        return out

    def lengths_of(texts):
        return [sum(e.attention_mask) for e in tokenizer.encode_batch(texts)]

    return embed, lengths_of, _padded


def _input_tokens(model_dir: str, texts: list[str]) -> int:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return sum(len(e.ids) for e in tokenizer.encode_batch_fast(texts))


def export_onnx(model_dir: str, path: str) -> None:
    """The encoder's last hidden state as an ONNX graph (batch and length dynamic)."""
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir).eval()

    class LastHidden(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    ids = torch.randint(1000, 2000, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    batch, length = torch.export.Dim("batch"), torch.export.Dim("length", max=512)
    torch.onnx.export(
        LastHidden(),
        (ids, mask),
        path,
        input_names=["input_ids", "attention_mask"],
        output_names=["last_hidden_state"],
        dynamic_shapes=({0: batch, 1: length}, {0: batch, 1: length}),
        dynamo=True,
    )


def main(argv: list[str]) -> None:
    if argv[0] == "export":
        export_onnx(argv[1], argv[2])
        return
    system = EmbedSystem(**json.loads(Path(argv[1]).read_text()))
    workload = EmbedWorkload.from_json(argv[2])
    result_path = Path(argv[3])
    result = run(system, workload, result_path)
    result_path.write_text(json.dumps(asdict(result)))


if __name__ == "__main__":
    main(sys.argv[1:])
