"""Runs `batch_inference` in a child process, slowed down so a test can kill it midway.

    python flow_child.py PARAMS_JSON SECONDS_PER_SHARD

Each shard sleeps after publishing its part (inside the engine lock, so shards finish
one at a time), which leaves a window to SIGKILL the flow with some shards complete
and others not. Nothing else about the flow changes.
"""

from __future__ import annotations

import json
import sys
import time

import tokenmill.flows.tasks as tasks
from tokenmill.flows import batch_inference


def main() -> None:
    params = json.loads(sys.argv[1])
    delay = float(sys.argv[2])
    run_shard = tasks.run_shard

    def slow_run_shard(*args, **kwargs):
        result = run_shard(*args, **kwargs)
        time.sleep(delay)
        return result

    tasks.run_shard = slow_run_shard
    batch_inference(**params)


if __name__ == "__main__":
    main()
