"""The FastAPI application: routers per resource, one error shape, the runner's life.

`create_app(settings)` opens the database and the store, describes the served models,
and starts the runner with the application (stopping it with the application too).
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI

from tokenmill.batch_api.database import Database
from tokenmill.batch_api.errors import install_error_handlers
from tokenmill.batch_api.jobs import ServerState
from tokenmill.batch_api.models import ServedModels
from tokenmill.batch_api.routers import batches, files, models
from tokenmill.batch_api.runner import LocalRunner, Runner
from tokenmill.batch_api.settings import ServerSettings
from tokenmill.batch_api.store import Store
from tokenmill.version import __version__


def make_runner(state: ServerState) -> Runner:
    if state.settings.runner == "prefect":
        from tokenmill.batch_api.prefect_runner import PrefectRunner

        return PrefectRunner(state)
    return LocalRunner(state)


def create_app(settings: ServerSettings, *, start_runner: bool = True) -> FastAPI:
    """The Batch API application for `settings`.

    Args:
        settings: how the server runs.
        start_runner: start the runner with the application (tests drive it by hand).
    """
    store = Store(settings.store, settings.storage_options)
    state = ServerState(
        settings=settings,
        db=Database(settings.database),
        store=store,
        models=ServedModels.describe(settings.models, settings.lora),
    )
    runner = make_runner(state)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if start_runner:
            runner.start()
        try:
            yield
        finally:
            runner.close()
            state.db.close()

    app = FastAPI(
        title="tokenmill Batch API",
        version=__version__,
        lifespan=lifespan,
        # The API is OpenAI's: its reference is theirs, and the docs pages say the rest.
        docs_url=None,
        redoc_url=None,
    )
    app.state.server = state
    app.state.runner = runner
    install_error_handlers(app)
    for router in (files.router, batches.router, models.router):
        app.include_router(router)
    return app
