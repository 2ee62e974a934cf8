#!/usr/bin/env bash
# Create kdflow's two work pools on the Prefect server (type `process`; existing pools are left as they are):
#   gpu  teacher and student work: precompute-shards, train-student, pipeline. One worker per GPU, each
#        started with --limit 1 by infra/start-workers.sh, so a GPU never holds two teachers at once.
#   cpu  materialise, tokenise and the precompute coordinator (which only fans shard ranges out to `gpu`).
#
#   infra/create-pools.sh            # uses PREFECT_API_URL, else the server infra/start-server.sh started
#   KDFLOW_GPU_POOL_LIMIT=8 infra/create-pools.sh   # also cap the whole gpu pool at 8 concurrent runs
set -euo pipefail
. "$(dirname "$0")/lib.sh"

PREFECT_API_URL=$(api_url)
export PREFECT_API_URL
GPU_POOL_LIMIT=${KDFLOW_GPU_POOL_LIMIT:-}
[ -z "$GPU_POOL_LIMIT" ] || [[ "$GPU_POOL_LIMIT" =~ ^[1-9][0-9]*$ ]] \
  || die "KDFLOW_GPU_POOL_LIMIT must be a positive whole number, got '$GPU_POOL_LIMIT'"
export GPU_POOL_LIMIT

# One Python process instead of a CLI call per step: each `prefect` command costs seconds of imports.
"$(python_bin)" - <<'PY'
import asyncio
import os
import sys

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
from prefect.exceptions import ObjectNotFound
from prefect.workers.process import ProcessWorker

POOLS = {
    "gpu": "kdflow teacher and student work; one process worker per GPU (CUDA_VISIBLE_DEVICES=i, --limit 1)",
    "cpu": "kdflow CPU work: materialise, tokenise, and the precompute coordinator that fans out to gpu",
}


async def ensure_pools() -> None:
    limit = int(os.environ["GPU_POOL_LIMIT"]) if os.environ.get("GPU_POOL_LIMIT") else None
    async with get_client() as client:
        for name, description in POOLS.items():
            try:
                pool = await client.read_work_pool(name)
            except ObjectNotFound:
                await client.create_work_pool(WorkPoolCreate(
                    name=name, type="process", description=description,
                    base_job_template=ProcessWorker.get_default_base_job_template()))
                print(f"[kdflow infra] created work pool '{name}' (process)", file=sys.stderr)
            else:
                if pool.type != "process":
                    sys.exit(f"error: work pool '{name}' exists with type '{pool.type}'; kdflow needs 'process' "
                             f"(delete it with `prefect work-pool delete {name}` and rerun)")
                print(f"[kdflow infra] work pool '{name}' already exists", file=sys.stderr)
        if limit is not None:
            await client.update_work_pool("gpu", WorkPoolUpdate(concurrency_limit=limit))
            print(f"[kdflow infra] work pool 'gpu' capped at {limit} concurrent runs", file=sys.stderr)


asyncio.run(ensure_pools())
PY
