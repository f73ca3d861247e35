"""Prefect flows for tokenmill: scheduled batch inference, fanned out over Dask or Ray.

    from tokenmill.flows import batch_inference, make_task_runner

    batch_inference(input="s3://b/prompts.parquet", output="s3://b/out/")
    batch_inference.with_options(task_runner=make_task_runner(dask_workers=4))(...)

See docs/flows.md for clusters, one worker per GPU, and scheduled deployments.
"""

from tokenmill.flows.batch_flow import FLOW_NAME, batch_inference
from tokenmill.flows.runners import make_task_runner

__all__ = ["FLOW_NAME", "batch_inference", "make_task_runner"]
