"""The `extract64` workload: pull a company record out of a short text, as JSON.

A nested schema of the kind extraction jobs use - nested objects, a nullable string with
a pattern, bounded integers, an enum, an array of enums with item limits, a bounded
number - and 64 seeded texts to extract it from. The same prompts run constrained (the
schema enforced) and unconstrained (the schema only described in the prompt).
"""

from __future__ import annotations

import json
import random

from tokenmill.bench.workload_data import Workload
from tokenmill.engine import Tokenizer

INDUSTRIES = ["software", "retail", "logistics", "finance", "health", "energy", "media"]
COUNTRIES = ["US", "DE", "FR", "GB", "PT", "other"]

EXTRACT_SCHEMA: dict = {
    "type": "object",
    "properties": {
        "company": {"type": "string", "maxLength": 60},
        "contact": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 60},
                "email": {
                    "type": ["string", "null"],
                    "pattern": "^[a-z0-9._-]+@[a-z0-9-]+\\.[a-z]{2,6}$",
                },
            },
            "required": ["name", "email"],
            "additionalProperties": False,
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "postal_code": {"type": ["string", "null"], "pattern": "^[0-9]{4,5}$"},
                "country": {"enum": COUNTRIES},
            },
            "required": ["city", "postal_code", "country"],
            "additionalProperties": False,
        },
        "employees": {"type": ["integer", "null"], "minimum": 1, "maximum": 1000000},
        "founded": {"type": ["integer", "null"], "minimum": 1800, "maximum": 2030},
        "industries": {
            "type": "array",
            "items": {"enum": INDUSTRIES},
            "minItems": 1,
            "maxItems": 3,
        },
        "rating": {"type": "number", "minimum": 0, "maximum": 5},
    },
    "required": [
        "company",
        "contact",
        "address",
        "employees",
        "founded",
        "industries",
        "rating",
    ],
    "additionalProperties": False,
}

_COMPANIES = ["Acme Robotics", "Blue Harbor", "Northwind", "Kestrel Labs", "Orchid Foods",
              "Lumen Grid", "Tidewater", "Quarry & Co", "Helix Media", "Fjord Freight"]  # fmt: skip
_PEOPLE = ["Ana Costa", "Jonas Weber", "Claire Martin", "Sam Patel", "Ines Duarte",
           "Tom Becker", "Lea Rossi", "Omar Haddad"]  # fmt: skip
_CITIES = [("Lisbon", "1100", "PT"), ("Berlin", "10115", "DE"), ("Lyon", "69002", "FR"),
           ("Leeds", None, "GB"), ("Austin", "73301", "US"), ("Oslo", "0150", "other")]  # fmt: skip


def extract_instance(seed: int = 0) -> dict:
    """One company record valid against EXTRACT_SCHEMA (the facts a prompt states)."""
    rng = random.Random(f"extract:{seed}")
    company = rng.choice(_COMPANIES)
    person = rng.choice(_PEOPLE)
    city, postal_code, country = rng.choice(_CITIES)
    has_email = rng.random() < 0.7
    email = person.lower().replace(" ", ".") + "@" + company.split()[0].lower() + ".com"
    return {
        "company": company,
        "contact": {"name": person, "email": email if has_email else None},
        "address": {"city": city, "postal_code": postal_code, "country": country},
        "employees": rng.choice([12, 85, 240, 1300, None]),
        "founded": rng.choice([1998, 2004, 2011, 2019, None]),
        "industries": rng.sample(INDUSTRIES, rng.randint(1, 2)),
        "rating": round(rng.uniform(2.5, 5.0), 1),
    }


def extract_text(record: dict) -> str:
    """A short paragraph stating the record's facts in prose."""
    contact = record["contact"]
    address = record["address"]
    parts = [f"{record['company']} is a {' and '.join(record['industries'])} company"]
    if record["founded"] is not None:
        parts.append(f" founded in {record['founded']}")
    parts.append(f", based in {address['city']}")
    if address["postal_code"] is not None:
        parts.append(f" ({address['postal_code']})")
    parts.append(".")
    if record["employees"] is not None:
        parts.append(f" It employs {record['employees']} people.")
    parts.append(f" Customers rate it {record['rating']} out of 5.")
    parts.append(f" Contact: {contact['name']}")
    if contact["email"] is not None:
        parts.append(f", {contact['email']}")
    return "".join(parts) + "."


def extract_prompts(num_prompts: int = 64, seed: int = 0) -> list[str]:
    """The user messages of the workload: the text and the fields to extract."""
    schema = json.dumps(EXTRACT_SCHEMA["properties"], separators=(",", ":"))
    return [
        "Extract the company record from the text as JSON with these fields: "
        f"{schema}\n\nText: {extract_text(extract_instance(seed * 1000 + i))}"
        for i in range(num_prompts)
    ]


def build_extract_workload(
    model_dir, *, num_prompts: int = 64, output_len: int = 128, seed: int = 0
):
    """The `extract64` workload for the model in `model_dir`.

    Each prompt is a user turn in the model's chat template; the instruction and the field
    list are the same for every prompt, so they form one shared prefix group.

    Args:
        model_dir: HF-layout model directory (its tokenizer and chat template are used).
        num_prompts: number of requests.
        output_len: max_tokens of every request.
        seed: which texts are drawn.

    Returns:
        The Workload, with `json_schema` set to EXTRACT_SCHEMA.
    """
    tokenizer = Tokenizer.from_dir(model_dir)
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}])
        for p in extract_prompts(num_prompts, seed)
    ]
    prompt_ids = tokenizer.encode_batch(texts, add_special_tokens=False)
    shared = _common_prefix_len(prompt_ids)
    return Workload(
        name="extract64",
        prompt_ids=prompt_ids,
        output_lens=[output_len] * num_prompts,
        prefix_group=[0] * num_prompts,
        shared_len=[shared] * num_prompts,
        spec={"num_prompts": num_prompts, "output_len": output_len, "seed": seed},
        json_schema=EXTRACT_SCHEMA,
    )


def _common_prefix_len(sequences: list[list[int]]) -> int:
    first = sequences[0]
    n = min(map(len, sequences))
    for other in sequences[1:]:
        n = next((i for i in range(n) if other[i] != first[i]), n)
    return n
