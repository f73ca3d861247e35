"""Does a frequency penalty let small models finish schema-constrained outputs?

A small model under a JSON schema can fall into a loop - a number or a digit repeated
(`10.20,10.20,...`, `000000...`) until max_tokens - and the row comes back cut short
(`length`, structured_output_complete false). This runs extraction prompts of the kind
batch jobs send, constrained, greedy, with each frequency penalty given, and counts the
rows that finished (a complete, schema-valid output) and those cut by max_tokens, with
the tail of each cut output so the loops can be seen. A penalty also pushes against
values the text really repeats, so for `readings` it counts the finished rows whose
serial and readings equal the text's (`exact`).

Two prompt sets: `extract64` (the bench's company-record extraction, tokenmill/bench/
extract.py) and `readings` - records with unbounded arrays of numbers and digit strings
(sensor logs, invoice lines), where the loops show up most.

Run:  python benchmarks/penalties_structured.py [--penalties 0 0.5 1.0] [--max-tokens 256]
      [--sets extract64 readings] [--num-prompts 64] [--num-readings 32]
"""

from __future__ import annotations

import argparse
import json
import random

import jsonschema

from tokenmill import LLM, SamplingParams, StructuredOutputs
from tokenmill.bench.extract import EXTRACT_SCHEMA, extract_prompts

READINGS_SCHEMA = {
    "type": "object",
    "properties": {
        "device": {"type": "string", "maxLength": 40},
        "serial": {"type": "string", "pattern": "^[0-9]{6,12}$"},
        "unit": {"enum": ["C", "F", "kPa", "V"]},
        "readings": {"type": "array", "items": {"type": "number"}, "minItems": 1},
        "invoice_lines": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[0-9]{4,8}$"},
                    "amount": {"type": "number"},
                },
                "required": ["sku", "amount"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["device", "serial", "unit", "readings", "invoice_lines"],
    "additionalProperties": False,
}


def readings_prompts(num_prompts: int, seed: int = 0) -> tuple[list[str], list[dict]]:
    """Logs with repetitive numbers (what small models loop on), and for each the
    serial and readings the text holds."""
    fields = json.dumps(READINGS_SCHEMA["properties"], separators=(",", ":"))
    prompts, truths = [], []
    for i in range(num_prompts):
        rng = random.Random(f"readings:{seed}:{i}")
        base = rng.choice([10.2, 0.5, 101.3, 3.3])
        values = [
            round(base + rng.choice([0, 0, 0.05, -0.05]), 2) for _ in range(rng.randint(3, 6))
        ]
        serial = "".join(rng.choice("0001") for _ in range(rng.randint(6, 10)))
        lines = [(f"{rng.randint(0, 99):04d}", rng.choice([10.2, 10.25, 0.0])) for _ in range(2)]
        text = (
            f"Device TH-{rng.randint(1, 9)} (serial {serial}) logged "
            + ", ".join(f"{v}" for v in values)
            + f" {rng.choice(['C', 'kPa', 'V'])}. Invoice: "
            + "; ".join(f"SKU {sku} at {amount}" for sku, amount in lines)
            + "."
        )
        prompts.append(
            f"Extract the record from the text as JSON with these fields: {fields}\n\nText: {text}"
        )
        truths.append({"serial": serial, "readings": values})
    return prompts, truths


def run(
    llm: LLM,
    prompts: list[str],
    truths: list[dict] | None,
    schema: dict,
    penalty: float,
    max_tokens: int,
):
    params = SamplingParams(
        temperature=0,
        max_tokens=max_tokens,
        frequency_penalty=penalty,
        structured_outputs=StructuredOutputs(json=schema),
    )
    outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    finished, exact, cut = 0, 0, []
    for index, out in enumerate(outputs):
        completion = out.outputs[0]
        if completion.finish_reason == "stop" and completion.structured_output_complete:
            record = json.loads(completion.text)
            jsonschema.validate(record, schema)
            finished += 1
            truth = truths[index] if truths else None
            exact += truth is not None and all(record[k] == v for k, v in truth.items())
        else:
            cut.append(completion.text[-40:])
    return finished, (exact if truths else None), cut


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--penalties", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--num-readings", type=int, default=32)
    parser.add_argument("--sets", nargs="+", default=["extract64", "readings"])
    args = parser.parse_args()
    llm = LLM(dtype=args.dtype)
    sets = {
        "extract64": (extract_prompts(args.num_prompts), None, EXTRACT_SCHEMA),
        "readings": (*readings_prompts(args.num_readings), READINGS_SCHEMA),
    }
    print(f"# greedy, max_tokens {args.max_tokens}, dtype {args.dtype}")
    print("| prompts | frequency_penalty | finished | exact | cut by max_tokens |")
    print("|---|---|---|---|---|")
    tails = {}
    for name in args.sets:
        prompts, truths, schema = sets[name]
        for penalty in args.penalties:
            finished, exact, cut = run(llm, prompts, truths, schema, penalty, args.max_tokens)
            shown = "-" if exact is None else f"{exact} / {len(prompts)}"
            print(
                f"| {name} | {penalty:g} | {finished} / {len(prompts)} | {shown} | {len(cut)} |",
                flush=True,
            )
            tails[(name, penalty)] = cut
    for (name, penalty), cut in tails.items():
        for tail in cut[:4]:
            print(f"cut ({name}, penalty {penalty:g}): ...{tail!r}")


if __name__ == "__main__":
    main()
