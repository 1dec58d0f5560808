"""SGLang's update_weights_from_distributed route, as far as one GPU takes it: the calls tandem's broadcast
route makes (rollout/weight_sync.py WeightSender: init_weights_update_group, one
update_weights_from_distributed per bucket, then the cache flush of finish_weight_update), with the bodies of
rollout/client.py, sent to a real SGLang server. Two NCCL ranks cannot share one GPU, so the group runs on
gloo there (`--group-backend`; nccl where the trainer side has a GPU of its own). Every call's answer, or the
error it raised, is recorded; then the actor scores the engine's greedy output under the pushed weights, as
the run's weights check does (benchmarks/engine/engines_gpu.py `check_push`).

    python -m benchmarks.engine.sglang_distributed --sglang-pythonpath /tmp/eng_site_sglang   # launches SGLang
        [--url http://HOST:PORT [--api-key KEY]]          # or a server that is up already
        [--model DIR] [--group-backend gloo|nccl] [--out benchmarks/results/engine/sglang_distributed_h200.json]

The model (default: the cold-started SmolLM2, else the base one) is what the server serves; the pushed
weights are it with every MLP down-projection halved, so a push that landed changes the greedy output.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import torch

from benchmarks.engine.engines_gpu import check_push, default_smollm2, engine_overrides, start_server

ROOT = Path(__file__).resolve().parents[2]
WEIGHT_CALLS = ("init_weights_update_group", "update_weights_from_distributed", "finish_weight_update")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--url", default=None, help="an SGLang server that is up (default: launch one as tandem does)"
    )
    p.add_argument("--api-key", default=None, help="the --url server's API key, if it has one")
    p.add_argument("--sglang-python", default=None, help="interpreter that runs sglang (a launch)")
    p.add_argument("--sglang-pythonpath", default=None, help="put first on its PYTHONPATH (a launch)")
    p.add_argument("--model", default=None, help="the served model's directory (default: SmolLM2)")
    p.add_argument("--group-backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--bucket-mb", type=int, default=64, help="bucket size: several buckets, several updates")
    p.add_argument("--probe-tokens", type=int, default=8)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.bucket_mb < 1:
        p.error(f"--bucket-mb {args.bucket_mb}: at least 1")
    if args.probe_tokens < 1:
        p.error(f"--probe-tokens {args.probe_tokens}: at least 1")
    gpu = torch.cuda.is_available()
    name = "sglang_distributed_h200.json" if gpu else "sglang_distributed_cpu.json"
    args.out = args.out or str(ROOT / "benchmarks" / "results" / "engine" / name)
    if not gpu and "h200" in Path(args.out).name:
        p.error(f"--out {args.out}: GPU figures come from a GPU run")
    if not gpu and args.url is None:
        p.error("SGLang runs on GPUs only: on CPU, name a server with --url")
    return args


class RecordingClient:
    """The engine client, with every weight-update call's arguments (tensor lists summarised) and answer,
    or the error it raised, appended to `calls`."""

    def __init__(self, client, calls: list[dict]):
        self._client, self.calls = client, calls

    def __getattr__(self, name: str):
        attribute = getattr(self._client, name)
        if name not in WEIGHT_CALLS:
            return attribute

        async def recorded(*args, **kwargs):
            call = {"call": name, "args": [summarise(a) for a in args], "kwargs": kwargs}
            self.calls.append(call)
            started = time.perf_counter()
            try:
                call["answer"] = await attribute(*args, **kwargs)
            except Exception as error:
                call["error"] = f"{type(error).__name__}: {error}"
                raise
            finally:
                call["seconds"] = time.perf_counter() - started
            return call["answer"]

        return recorded


def summarise(value):
    """A list of names, dtypes or shapes as its length and first entry (a bucket holds hundreds)."""
    if isinstance(value, list | tuple) and len(value) > 2:
        return {"len": len(value), "first": value[0]}
    return value


async def probe(args, url: str, key: str | None, model_dir: Path, device: str) -> dict:
    from tandemrl.rollout.backends import make_client
    from tandemrl.rollout.weight_sync import WeightSender

    calls: list[dict] = []
    client = make_client("sglang", url, api_key=key)
    pushing = RecordingClient(make_client("sglang", url, api_key=key), calls)
    sender = WeightSender(
        [pushing],
        backend=args.group_backend,
        bucket_mb=args.bucket_mb,
        engine_kind="sglang",
        flush_cache=True,  # nothing generates during the push: the idle modes' flush (rollout/client.py)
    )
    result: dict = {"calls": calls}
    try:
        result.update(await check_push(client, sender, model_dir, device, args.probe_tokens))
        result["weight_version_after"] = await client.get_weight_version()
    except Exception as error:  # noqa: BLE001  the answer is the result: recorded, then written
        result["failed"] = f"{type(error).__name__}: {error}"
    finally:
        await client.close()
    return result


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_dir = Path(args.model) if args.model else default_smollm2()
    report = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "model": str(model_dir),
        "group_backend": args.group_backend,
        "bucket_mb": args.bucket_mb,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    server = None
    if args.url is None:
        launch = argparse.Namespace(
            vllm_python=None, vllm_pythonpath=None, sglang_python=args.sglang_python,
            sglang_pythonpath=args.sglang_pythonpath,
        )  # fmt: skip
        overrides = engine_overrides(launch, "sglang", device)
        server, key, report["startup_s"] = start_server("sglang", model_dir, overrides, 16, 2048)
        url = server.url
    else:
        url, key = args.url, args.api_key
    try:
        report.update(asyncio.run(probe(args, url, key, model_dir, device)))
    finally:
        if server is not None:
            server.stop()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str) + "\n")
    answered = [(c["call"], "error" if "error" in c else "ok") for c in report["calls"]]
    print(f"calls: {answered}")
    print(f"weights_check {report.get('weights_check')}, failed: {report.get('failed')}; wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
