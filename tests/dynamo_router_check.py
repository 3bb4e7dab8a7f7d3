"""NVIDIA Dynamo's KV router fed by radixd's ZMQ events, in Dynamo's venv (tests/test_dynamo_router.py runs it).

    python tests/dynamo_router_check.py tcp://HOST:PORT BLOCK_SIZE

A Dynamo runtime in process (discovery "mem", request plane "tcp", event plane "zmq"), a served endpoint with a
registered model card (without it the router knows no worker and drops every event), a `KvEventPublisher` relaying
radixd's PUB socket as a worker's events, and a `KvRouter` on that endpoint. It prints `ready`, then answers each
JSON line {"tokens": [...], "lora": str|null, "salt": str|null} on stdin with one JSON line: the worker's leading
blocks on the device and on device or host, as `KvRouter.get_overlap_scores` reports them.
"""
from __future__ import annotations

import asyncio
import json
import sys
import tempfile

from dynamo.llm import KvEventPublisher, KvRouter, KvRouterConfig, ModelInput, ModelType, WorkerType, register_model
from dynamo.runtime import DistributedRuntime


async def main(pub: str, block: int) -> None:
    runtime = DistributedRuntime(asyncio.get_running_loop(), "mem", "tcp", event_plane="zmq")
    endpoint = runtime.endpoint("radixd.worker.generate")

    async def generate(request, context=None):  # never called: the router is only asked for overlaps
        yield {"token_ids": []}

    serving = asyncio.ensure_future(endpoint.serve_endpoint(generate))
    await register_model(ModelInput.Tokens, ModelType.Completions, endpoint, tempfile.mkdtemp(), "m",
                         worker_type=WorkerType.Aggregated, kv_cache_block_size=block, skip_model_assets=True)
    publisher = KvEventPublisher(endpoint, kv_block_size=block, zmq_endpoint=pub)
    router = KvRouter(endpoint, block, KvRouterConfig())
    print("ready", flush=True)
    reader = asyncio.StreamReader()
    await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        q = json.loads(line)
        got = await router.get_overlap_scores(q["tokens"], lora_name=q.get("lora"), cache_namespace=q.get("salt"))
        row = got["workers"][0] if got["workers"] else {}
        print(json.dumps({"GPU": row.get("device_blocks", 0), "any": row.get("host_pinned_blocks", 0)}), flush=True)
    del publisher, serving


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
