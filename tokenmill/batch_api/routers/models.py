"""GET /v1/models: the served models and their LoRA adapters."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from tokenmill.batch_api.auth import caller, server_state
from tokenmill.batch_api.jobs import ServerState
from tokenmill.batch_api.schemas import Model, ModelList

router = APIRouter(prefix="/v1/models", tags=["models"])


@router.get("", response_model=ModelList)
def list_models(
    owner: str = Depends(caller), state: ServerState = Depends(server_state)
) -> ModelList:
    created = state.models.created
    return ModelList(
        data=[
            Model(id=model_id, created=created, owned_by=owned_by)
            for model_id, owned_by in state.models.listing()
        ]
    )
