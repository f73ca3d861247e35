"""The served models and their LoRA adapters: what GET /v1/models lists and what a line's
`body.model` may name.

A model is named by the id its jobs' ledgers and responses give it (the model's
description, `tokenmill.engine.describe_model`) or by what the server was started with
(an alias, a path); an adapter by its name. Adapters belong to the first model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenmill.engine import describe_model


@dataclass(frozen=True)
class ServedModel:
    id: str  # the model's name, as responses and ledgers give it
    spec: str | None  # what the server was started with (None: the default model)
    adapters: dict[str, str] = field(default_factory=dict)  # name -> path or Hub id

    def names(self) -> set[str]:
        return {self.id, *([self.spec] if self.spec else [])}


@dataclass
class ServedModels:
    models: list[ServedModel]
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def describe(cls, specs: tuple[str | None, ...], lora: dict[str, str] | None) -> ServedModels:
        """Describe each model (no weights are loaded); adapters go with the first.

        Raises:
            ValueError: two models with one name, or an adapter named like a model.
        """
        models = []
        for index, spec in enumerate(specs):
            description = describe_model(spec)
            adapters = dict(lora or {}) if index == 0 else {}
            models.append(ServedModel(description.name, spec, adapters))
        ids = [m.id for m in models]
        if len(set(ids)) != len(ids):
            raise ValueError(f"two --model options name one model: {ids}")
        clash = sorted(set(lora or {}) & {n for m in models for n in m.names()})
        if clash:
            raise ValueError(f"LoRA adapter names must differ from the models': {clash}")
        return cls(models)

    @property
    def default(self) -> ServedModel:
        return self.models[0]

    def find(self, name: str) -> ServedModel | None:
        """The model a line's body.model names (an adapter's name: its base model)."""
        for model in self.models:
            if name in model.names() or name in model.adapters:
                return model
        return None

    def listing(self) -> list[tuple[str, str]]:
        """(id, owned_by) of every model and adapter, as GET /v1/models lists them."""
        rows = []
        for model in self.models:
            rows.append((model.id, "tokenmill"))
            rows += [(name, model.id) for name in model.adapters]
        return rows
