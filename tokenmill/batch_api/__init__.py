"""A self-hosted OpenAI Batch API: `tokenmill batch-api` serves /v1/files, /v1/batches
and /v1/models, so code written for OpenAI's batches runs here by changing base_url.

settings    ServerSettings: the store, the models, keys, limits - checked at start
ids         object ids, made here and checked before they reach a query or a path
schemas     requests and responses as pydantic models (OpenAI's fields)
errors      OpenAI's error shape, one handler per kind of failure
database    files and batches in SQLite or Postgres (SQLAlchemy Core)
store       files and each batch's job output on local disk or any fsspec store
uploads     multipart uploads streamed to a spool, size-limited, checked as JSON Lines
models      the served models and LoRA adapters (GET /v1/models; a line's body.model)
validation  a batch's validating step: OpenAI's rules on the whole input file
jobs        a batch as a tokenmill job: its options, stopping, output and error files
auth        API keys as bearer tokens; each key sees only its own objects
runner      the loop: admission (fair across keys), expiry, cancel; in-process shards
prefect_runner  each batch a flow run of the batch-inference flow
routers/    files, batches, models
app         create_app(settings): the FastAPI application
"""
