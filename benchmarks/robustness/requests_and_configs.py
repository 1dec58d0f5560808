"""Hostile-input probe: bad /generate bodies, bad weight updates, unauthenticated control and oversize
bodies against a real engine process (a tiny random Llama); a poison query among 60 good ones and
oversize requests against the retrieval app; bad configurations through `tandem config show`. Prints
the counts the reliability work is judged by (inputs tried, clear errors, crashes, hangs, accepted,
good requests lost) and, as timings, how long /health and a 1-query retrieval wait beside a large
request. Runs against whatever `tandemrl` is importable, so the same script measures an older tree:

    python -m benchmarks.robustness.requests_and_configs [--out benchmarks/results/robustness/hostile_inputs.json]

Classification: a 4xx whose text names the expected field is a clear error; a 5xx, a traceback or a
dropped connection is a crash; no answer in 10 s is a hang; a 2xx for bad input is "accepted".
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from pathlib import Path

import aiohttp
import httpx

from benchmarks import write_json
from tandemrl.rollout.engine_process import EngineProcess

KEY = "probe-key-123456"
results = {"clear": 0, "unclear": [], "crash": [], "hang": [], "accepted": [], "lost": 0}


def record(name, status, text, field):
    if status is None:
        results["hang"].append(name)
    elif status >= 500 or "Traceback" in text:
        results["crash"].append(f"{name}: {status} {text[:80]}")
    elif 200 <= status < 300:
        results["accepted"].append(name)
    elif field.lower() in text.lower():
        results["clear"] += 1
    else:
        results["unclear"].append(f"{name}: {status} {text[:100]}")


async def post(url, path, body, headers, timeout=10):
    try:
        async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as s:
            data = body if isinstance(body, str) else None
            async with s.post(url + path, data=data, json=None if isinstance(body, str) else body) as r:
                return r.status, await r.text()
    except asyncio.TimeoutError:
        return None, ""


P = [1, 504, 3237, 28, 9]
GEN = [
    ("text+ids", {"input_ids": P, "text": "hi"}, "text"),
    ("temp inf", '{"input_ids": [1,2], "sampling_params": {"temperature": Infinity}}', "temperature"),
    ("temp nan", '{"input_ids": [1,2], "sampling_params": {"temperature": NaN}}', "temperature"),
    ("temp str", {"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}, "temperature"),
    ("top_k 0", {"input_ids": [1, 2], "sampling_params": {"top_k": 0}}, "top_k"),
    ("top_k -2", {"input_ids": [1, 2], "sampling_params": {"top_k": -2}}, "top_k"),
    ("top_p 0", {"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "top_p"),
    ("bool ids", {"input_ids": [1, True, 2]}, "input_ids"),
    ("float ids", {"input_ids": [1, 2.5]}, "input_ids"),
    ("neg ids", {"input_ids": [1, -2]}, "input_ids"),
    ("huge ids", {"input_ids": [1, 10**30]}, "input_ids"),
    ("empty ids", {"input_ids": []}, "input_ids"),
    ("nested ids", {"input_ids": [[1, 2]]}, "input_ids"),
    ("stop int", {"input_ids": [1, 2], "sampling_params": {"stop": 5}}, "stop"),
    ("stop_ids int", {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": 7}}, "stop_token_ids"),
    ("ignore_eos str", {"input_ids": [1, 2], "sampling_params": {"ignore_eos": "yes"}}, "ignore_eos"),
    ("max_new bool", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": True}}, "max_new_tokens"),
    ("max_new neg", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ("params list", {"input_ids": [1, 2], "sampling_params": [1]}, "sampling_params"),
    ("unknown param", {"input_ids": [1, 2], "sampling_params": {"max_tokens": 3}}, "sampling_params"),
    ("return_logprob str", {"input_ids": [1, 2], "return_logprob": "no"}, "return_logprob"),
    ("rid dict", {"input_ids": [1, 2], "rid": {"a": 1}}, "rid"),
    ("text list", {"text": ["a", "b"]}, "text"),
    ("unknown field", {"input_ids": [1, 2], "bogus": 1}, "bogus"),
    ("not json", "{nope", "JSON"),
    ("json array", "[1,2]", "object"),
    ("deep nesting", "[" * 100000 + "]" * 100000, "nested"),
    ("stream str", {"input_ids": [1, 2], "stream": "yes"}, "stream"),  # stream=true is served (one event)
    ("too long", {"input_ids": list(range(1, 300))}, "max_context_len"),
]
UPD = [  # refused while parsing, on main too
    ("bad dtype", {"names": ["model.norm.weight"], "dtypes": ["float99"], "shapes": [[64]]}, "dtype"),
    ("names str", {"names": "x", "dtypes": [], "shapes": []}, "names"),
    ("len mismatch", {"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[1]]}, "length"),
    ("missing names", {"dtypes": [], "shapes": []}, "names"),
    ("version str", {"names": [], "dtypes": [], "shapes": [], "weight_version": "abc"}, "weight_version"),
    ("version -5", {"names": [], "dtypes": [], "shapes": [], "weight_version": -5}, "weight_version"),
]
UPD_LATE = [  # main receives before it checks: probed last (a hang there blocks the loop)
    ("neg shape", {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[-1]]}, "shape"),
    (
        "absurd shape",
        {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[10**12, 10**12]]},
        "shape",
    ),
    ("int dtype", {"names": ["model.norm.weight"], "dtypes": ["int64"], "shapes": [[64]]}, "dtype"),
    ("unknown name", {"names": ["model.bogus"], "dtypes": ["float32"], "shapes": [[4]]}, "bogus"),
]


async def engine_probe(model_dir):
    kwargs = {"api_key": KEY} if "api_key" in inspect.signature(EngineProcess).parameters else {}
    with EngineProcess(model_dir, max_context_len=256, **kwargs) as proc:
        auth = {"Authorization": f"Bearer {KEY}"}
        from tandemrl.engine.weight_transport import new_process_group
        from tandemrl.host.child_server import free_port

        port = free_port()
        join = asyncio.to_thread(new_process_group, "127.0.0.1", port, 0, 2, "g", "gloo", 10.0)
        body = {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "g",
        }
        group, (status, _) = await asyncio.gather(
            join, post(proc.url, "/init_weights_update_group", body, auth)
        )
        assert status == 200
        for name, body, field in GEN:
            record("generate " + name, *(await post(proc.url, "/generate", body, auth)), field)
        for name, body, field in UPD:
            body = dict(body, group_name="g")
            status, text = await post(proc.url, "/update_weights_from_distributed", body, auth)
            record("update " + name, status, text, field)
        # unauthenticated control: 6 endpoints
        for path, body in [
            ("/pause_generation", {"mode": "abort"}),
            ("/continue_generation", {}),
            ("/abort_request", {"abort_all": True}),
            ("/flush_cache", {}),
            ("/generate", {"input_ids": P}),
            ("/update_weights_from_distributed", {"names": []}),
        ]:
            status, text = await post(proc.url, path, body, {})
            record("no key " + path, status, text, "key")
        big = json.dumps({"input_ids": [1] * 7_000_000})  # ~21 MB
        record("20MB body", *(await post(proc.url, "/generate", big, auth, timeout=30)), "too large")
        for name, body, field in UPD_LATE:
            status, text = await post(
                proc.url, "/update_weights_from_distributed", dict(body, group_name="g"), auth
            )
            record("update " + name, status, text, field)


async def retrieval_probe():
    from tandemrl.retrieval.batcher import MicroBatcher
    from tandemrl.retrieval.server import create_app

    def search(queries, topks):
        """Fake stand-in for the retriever: raises on a query it cannot encode, as the encoder does."""
        for q in queries:
            q.encode("utf-8")
        return [[] for _ in queries]

    batcher = MicroBatcher(search, max_wait_s=0.05)
    app = create_app(batcher, {})
    await batcher.start()
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=30
        ) as c:
            poison = c.post(
                "/retrieve", content='{"queries": ["\\ud800"]}', headers={"content-type": "application/json"}
            )
            good = [c.post("/retrieve", json={"queries": ["ok"]}) for _ in range(60)]
            bad, *goods = await asyncio.gather(poison, *good)
            record("retrieval surrogate", bad.status_code, bad.text, "queries")
            results["lost"] += sum(r.status_code != 200 for r in goods)
            too_many = await c.post("/retrieve", json={"queries": ["q"] * 5000})
            record("retrieval 5000 queries", too_many.status_code, too_many.text, "queries")
            r = await c.post("/retrieve", json={"queries": ["x" * 5000] * 1000})
            record("retrieval 5MB body", r.status_code, r.text, "too large")
    finally:
        await batcher.stop()


def config_probe(tmp):
    import contextlib
    import io

    from tandemrl.cli import main as cli_main

    tmp = Path(tmp)
    (tmp / "bin").write_bytes(bytes(range(256)) * 4)
    (tmp / "dup.yaml").write_text("runner:\n  max_steps: 3\n  max_steps: 5\n")
    (tmp / "m").mkdir(exist_ok=True)
    (tmp / "m" / "config.json").write_text("{")
    cfg = "examples/searchr1/config/embedded_cpu_async.yaml"
    cases = [
        ("binary", [str(tmp / "bin")], "UTF-8"),
        ("dir", ["/tmp"], "directory"),
        ("devnull", ["/dev/null"], "regular"),
        ("dup", [str(tmp / "dup.yaml")], "twice"),
        ("ctx16", [cfg, "rollout.max_context_len=16"], "max_context_len"),
        ("turn", [cfg, "agentloop.max_new_tokens_per_turn=2000"], "max_new_tokens_per_turn"),
        ("inflight", [cfg, "rollout_buffer.max_inflight_groups=9"], "max_inflight_groups"),
        ("minib", [cfg, "algorithm.n_minibatches=9"], "n_minibatches"),
        ("g1", [cfg, "algorithm.group_size=1"], "group_size"),
        ("lrinf", [cfg, "actor.optim.lr=.inf"], "lr"),
        ("t0", [cfg, "tools.search.timeout_s=0"], "timeout_s"),
        ("resume", [cfg, "runner.resume_from=/nope"], "resume_from"),
        ("badmodel", [cfg, f"rollout.model.model_path={tmp / 'm'}"], "config.json"),
    ]
    for name, args, field in cases:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                code = cli_main(["config", "show", *args])
        except BaseException as error:  # a traceback in a real process
            record("config " + name, 500, repr(error), field)
            continue
        text = err.getvalue()
        if code == 0:
            results["accepted"].append("config " + name)
        else:
            record("config " + name, 400, text, field)


async def health_beside_large_body(model_dir) -> float:
    """Seconds /health takes while a 10 MB `text` body is being handled by the same engine."""
    kwargs = {"api_key": KEY} if "api_key" in inspect.signature(EngineProcess).parameters else {}
    with EngineProcess(model_dir, max_context_len=256, **kwargs) as proc:
        auth = {"Authorization": f"Bearer {KEY}"}
        large = asyncio.create_task(
            post(proc.url, "/generate", {"text": "word " * 2_000_000}, auth, timeout=60)
        )
        await asyncio.sleep(0.3)
        start = time.perf_counter()
        async with aiohttp.ClientSession() as s:
            async with s.get(proc.url + "/health") as r:
                await r.text()
        seconds = time.perf_counter() - start
        await large
        return seconds


async def small_beside_large_retrieval() -> float:
    """Seconds a 1-query request waits beside a 1,024-query one (fake search: 2 ms per query)."""
    from tandemrl.retrieval.batcher import MicroBatcher
    from tandemrl.retrieval.server import create_app

    def search(queries, topks):
        """Fake stand-in for encoder + Qdrant: 2 ms per query."""
        time.sleep(0.002 * len(queries))
        return [[] for _ in queries]

    batcher = MicroBatcher(search)
    app = create_app(batcher, {})
    await batcher.start()
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60
        ) as c:
            large = asyncio.create_task(c.post("/retrieve", json={"queries": [f"q{i}" for i in range(1024)]}))
            await asyncio.sleep(0.05)
            start = time.perf_counter()
            await c.post("/retrieve", json={"queries": ["one"]})
            seconds = time.perf_counter() - start
            await large
            return seconds
    finally:
        await batcher.stop()


def main() -> None:
    import argparse
    import tempfile

    from benchmarks.engine.model_shapes import make_tiny_model_dir
    from tandemrl.data.prepare_model import prepare_model

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/robustness/hostile_inputs.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model_dir(Path(tmp) / "tiny", prepare_model())
        asyncio.run(engine_probe(model_dir))
        asyncio.run(retrieval_probe())
        config_probe(tmp)
        timings = {
            "health_s_beside_10mb_text": asyncio.run(health_beside_large_body(model_dir)),
            "small_retrieval_s_beside_1024_queries": asyncio.run(small_beside_large_retrieval()),
        }
    num_tried = results["clear"] + sum(len(v) for v in results.values() if isinstance(v, list))
    report = {"inputs_tried": num_tried, "clear_errors": results["clear"]}
    report.update({k: v for k, v in results.items() if k != "clear"})
    report.update(timings)
    print(json.dumps(report, indent=1))
    write_json(args.out, report, indent=1)


if __name__ == "__main__":
    main()
