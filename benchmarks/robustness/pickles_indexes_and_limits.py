"""Hostile-input probe of crafted checkpoint pickles, index builds and size / encoding limits (issue 30,
the second round): the input classes requests_and_configs.py does not cover.

- checkpoints: a crafted DCP `.metadata` and a crafted shard item that run code when unpickled, a
  pickled / truncated / grown data.pt, a truncated or missing shard, garbage meta.pt, a truncated
  `.metadata`, through `tandem config show runner.resume_from=...` and `tandem export`;
- index builds: a record without id beside ids, duplicate ids, a rebuild with changed text, an empty
  corpus, contents that are not text (number, list, lone surrogate, blank), records that are not
  objects, a non-UTF-8 corpus, a symlink loop, a failed build (must leave no index.json), an empty
  index served;
- configs: a YAML alias bomb (10**9 values expanded), 100,000 levels of nesting, an 18 MB list, a
  5,000-digit integer, the same in overrides, integers beyond 64 bits, a 5,000-item list where a string
  goes (the message must stay short), non-UTF-8 override bytes, a symlink loop, a list as a key,
  agentloop.max_turns=0, vLLM without server_addrs, a model path that does not exist;
- the engine: non-UTF-8 Authorization headers, absurd weight versions, RoPE buffers and repeated names
  in an update, stop_token_ids beyond the vocabulary, int64-overflowing sampling integers, lone
  surrogates in text and stop strings, a body with neither text nor input_ids, `serve-engine` on
  0.0.0.0 without a key, a port in use;
- the retrieval server: empty and blank queries, non-UTF-8 and deeply nested bodies, a non-UTF-8 key
  header, /health showing the index path, a port in use.

Every case runs in a real process (the `tandem` command, or HTTP to a real server), so it measures
whatever `tandemrl` is on PYTHONPATH, an older tree included:

    python -m benchmarks.robustness.pickles_indexes_and_limits [--out benchmarks/results/robustness/hostile_inputs_round2.json]

Classification, as in requests_and_configs.py: refused with a message naming the expected field (or handled
as it must be: a rebuild that holds the new text) is clear; a traceback, a 5xx, a killed process or code
that ran is a crash; no answer in time is a hang; a bad input taken (exit 0, 2xx, a server that keeps
serving) is accepted.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import pickle
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import write_json

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples/searchr1/config/embedded_cpu_async.yaml"
KEY = "probe-key-0123456789"
OUTCOMES = ("clear", "unclear", "accepted", "hang", "crash")  # worst last
cases: dict[str, tuple[str, str]] = {}  # case -> (its worst outcome, what was seen)
code_ran: list[str] = []


def record(name: str, outcome: str, detail: str = "") -> None:
    """The outcome of case `name`; a second finding about the same case keeps the worse of the two."""
    if outcome == "code_ran":
        code_ran.append(name)
        outcome, detail = "crash", "the checkpoint ran code"
    previous = cases.get(name)
    if previous is None or OUTCOMES.index(outcome) > OUTCOMES.index(previous[0]):
        cases[name] = (outcome, detail[:160])


def summary() -> dict:
    report = {"inputs_tried": len(cases), "clear_errors": sum(o == "clear" for o, _ in cases.values())}
    for outcome in OUTCOMES[1:]:
        report[outcome] = [f"{n}: {d}" if d else n for n, (o, d) in cases.items() if o == outcome]
    report["code_ran"] = code_ran
    return report


def classify(name: str, code: int | None, text: str, field: str, ok_codes=(2,)) -> None:
    """A command's outcome: exit code (None: timed out) and its output."""
    if code is None:
        record(name, "hang")
    elif "Traceback" in text or code < 0 or code not in (*ok_codes, 0):
        record(name, "crash", text.strip().splitlines()[-1] if text.strip() else f"exit {code}")
    elif code == 0:
        record(name, "accepted")
    elif field.lower() in text.lower() and len(text) < 4000:
        record(name, "clear")
    else:
        record(name, "unclear", text)


def tandem(*args: str, timeout: float = 120, mem_gb: float = 4.0) -> tuple[int | None, str]:
    """`tandem ARGS` in a process of its own, memory capped (an alias bomb must not take the machine)."""

    def cap():
        limit = int(mem_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT))}
    env.pop("TANDEM_ENGINE_API_KEY", None)
    env.pop("TANDEM_RETRIEVAL_API_KEY", None)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tandemrl.cli", *args],
            capture_output=True,
            timeout=timeout,
            env=env,
            preexec_fn=cap,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired:
        return None, ""
    return done.returncode, (done.stderr + done.stdout).decode(errors="replace")


# ---- checkpoints ----------------------------------------------------------------------------------------


class RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def make_checkpoint(model_dir: Path, root: Path) -> Path:
    import torch

    from benchmarks.robustness.fixtures import cpu_actor, make_samples
    from tandemrl.trainer.checkpoint import checkpoint_dir

    torch.set_num_threads(1)
    actor = cpu_actor(model_dir, "algorithm.n_minibatches=2", "actor.micro_batch_tokens=96")
    actor.train_step(make_samples(seed=0, num_samples=4))
    return actor.save_checkpoint(checkpoint_dir(root, 1), extra={"data/data.pt": {"step": 1}})


def _manifest(ckpt: Path) -> None:
    """Rewrite the manifest to match (an attacker would), if this tree writes one."""
    if (ckpt / "manifest.json").exists():
        files = {
            str(p.relative_to(ckpt)): p.stat().st_size
            for p in sorted(ckpt.rglob("*"))
            if p.is_file() and p.name != "manifest.json"
        }
        (ckpt / "manifest.json").write_text(json.dumps({"format": 1, "files": files}))


def _metadata(ckpt: Path):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(ckpt / "actor")).read_metadata()


def crafted_metadata(ckpt: Path, marker: Path) -> None:
    metadata = _metadata(ckpt)
    metadata.planner_data = RunsCode(marker)
    (ckpt / "actor" / ".metadata").write_bytes(pickle.dumps(metadata))
    _manifest(ckpt)


def crafted_shard_item(ckpt: Path, marker: Path) -> None:
    metadata = _metadata(ckpt)
    info = next(s for i, s in metadata.storage_data.items() if i.fqn == "optim.param_groups.0.lr")
    shard = ckpt / "actor" / info.relative_path
    payload, data = pickle.dumps(RunsCode(marker)), shard.read_bytes()
    shard.write_bytes(data + payload)
    info.offset, info.length = len(data), len(payload)
    (ckpt / "actor" / ".metadata").write_bytes(pickle.dumps(metadata))
    _manifest(ckpt)


def _truncate(rel: str):
    def damage(ckpt: Path, marker: Path) -> None:
        path = ckpt / rel
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    return damage


def _pickled_data(ckpt: Path, marker: Path) -> None:
    (ckpt / "data" / "data.pt").write_bytes(pickle.dumps(RunsCode(marker)))
    _manifest(ckpt)


CHECKPOINT_CASES = {
    "crafted .metadata": (crafted_metadata, "system"),
    "crafted shard item": (crafted_shard_item, "system"),
    "pickled data.pt": (_pickled_data, "data.pt"),
    "truncated data.pt": (_truncate("data/data.pt"), "data.pt"),
    "truncated shard": (_truncate("actor/__0_0.distcp"), "distcp"),
    "truncated .metadata": (_truncate("actor/.metadata"), ".metadata"),
    "truncated rng state": (_truncate("actor/rng_rank0.pt"), "rng_rank0.pt"),
    "garbage meta.pt": (lambda c, m: (c / "actor" / "meta.pt").write_bytes(os.urandom(1499)), "meta.pt"),
    "missing shard": (lambda c, m: (c / "actor" / "__0_0.distcp").unlink(), "distcp"),
    "grown data.pt": (lambda c, m: (c / "data" / "data.pt").open("ab").write(b"\0" * 16), "data.pt"),
}


def checkpoint_probe(model_dir: Path, tmp: Path) -> None:
    saved = make_checkpoint(model_dir, tmp / "saved")
    for name, (damage, field) in CHECKPOINT_CASES.items():
        # `tandem export` reads no data.pt: its damage is an input for resuming only
        for command in ("resume",) if "data.pt" in name else ("resume", "export"):
            ckpt = tmp / "ckpt" / name.replace(" ", "_") / command / "global_step_1"
            shutil.copytree(saved, ckpt)
            marker = ckpt.parent / "created-by-the-checkpoint"
            damage(ckpt, marker)
            if command == "resume":
                code, text = tandem("config", "show", str(CONFIG), f"runner.resume_from={ckpt}")
                if code == 0:  # config show took it; `tandem train` would start every service, then load
                    code, text = _load_in_actor(model_dir, ckpt)
            else:
                code, text = tandem("export", str(ckpt), "--out", str(ckpt.parent / "exported"))
            label = f"checkpoint {name} ({command})"
            classify(label, code, text, field)
            if marker.exists():
                record(label, "code_ran")


def _load_in_actor(model_dir: Path, ckpt: Path) -> tuple[int | None, str]:
    """What resuming does after the services started: exit 0 when the actor loaded the checkpoint, 1
    (a crash: found late, with a traceback) when it failed."""
    script = (
        "from benchmarks.robustness.fixtures import cpu_actor; "
        f"a = cpu_actor({str(model_dir)!r}, 'algorithm.n_minibatches=2'); "
        f"a.load_checkpoint({str(ckpt)!r}); print('loaded')"
    )
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT))}
    try:
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, timeout=180, env=env, cwd=ROOT
        )
    except subprocess.TimeoutExpired:
        return None, ""
    text = (done.stderr + done.stdout).decode(errors="replace")
    return (0 if done.returncode == 0 and "loaded" in text else 1), text


# ---- index builds ---------------------------------------------------------------------------------------


def _corpus(path: Path, lines: list) -> Path:
    path.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    return path


def _rec(pid, contents) -> str:
    return json.dumps({"contents": contents} if pid is None else {"id": pid, "contents": contents})


INDEX_CASES = {
    "record without id beside ids": ([_rec("1", "alpha text"), _rec(None, "beta text")], ":2"),
    "duplicate id": ([_rec("a", "first"), _rec("a", "second")], "appears on lines"),
    "empty corpus": (["", " "], "no passages"),
    "contents a number": ([_rec("a", 5)], "contents"),
    "contents a list": ([_rec("a", ["x"])], "contents"),
    "contents a lone surrogate": (['{"id": "a", "contents": "x\\ud800"}'], "contents"),
    "contents blank": ([_rec("a", "   ")], "contents"),
    "id a lone surrogate": (['{"id": "\\udfff", "contents": "t"}'], "'id'"),
    "id null": (['{"id": null, "contents": "t"}'], "'id'"),
    "id a float": (['{"id": 1.5, "contents": "t"}'], "'id'"),
    "record a JSON array": (['["a", "b"]'], ":1"),
    "record a number": (["7"], ":1"),
    "not UTF-8": ([b'{"id": "a", "contents": "caf\xe9"}'], "UTF-8"),
    "5000-digit id": (['{"id": ' + "9" * 5000 + ', "contents": "t"}'], ":1"),
    "nested 100000 deep": (['{"id": "a", "contents": "t", "x": ' + "[" * 100000 + "]" * 100000 + "}"], ":1"),
}


def index_probe(tmp: Path) -> None:
    root = tmp / "index_cases"
    root.mkdir()
    for name, (lines, field) in INDEX_CASES.items():
        corpus = _corpus(root / f"{name.replace(' ', '_')}.jsonl", lines)
        index = root / f"{name.replace(' ', '_')}.index"
        code, text = tandem("index", "build", "--corpus", str(corpus), "--index", str(index))
        classify(f"index {name}", code, text, field)
        if code not in (0, None) and (index / "index.json").exists():
            record(f"index {name}", "accepted", "the failed build left an index.json")
    loop = root / "loop.jsonl"
    loop.symlink_to(loop)
    classify(
        "index symlink loop",
        *tandem("index", "build", "--corpus", str(loop), "--index", str(root / "l")),
        "loop",
    )
    # a failed build into a fresh directory leaves nothing; a rebuild replaces the text
    bad = _corpus(root / "bad_last.jsonl", [_rec("n1", "one"), '{"id": "n2", "contents": 2}'])
    code, _ = tandem("index", "build", "--corpus", str(bad), "--index", str(root / "fresh"))
    record(
        "index failed build leaves index.json",
        "accepted" if (root / "fresh" / "index.json").exists() else "clear",
    )
    old = _corpus(root / "old.jsonl", [_rec("p1", "old text one"), _rec("p2", "old text two")])
    new = _corpus(root / "new.jsonl", [_rec("p1", "new text one"), _rec("p3", "new text three")])
    index = root / "rebuilt"
    tandem("index", "build", "--corpus", str(old), "--index", str(index))
    code, text = tandem("index", "build", "--corpus", str(new), "--index", str(index))
    stored = _stored(index)
    if code != 0:
        record("index rebuild with changed text", "crash" if "Traceback" in text else "unclear", text)
    else:
        record(
            "index rebuild with changed text",
            "clear" if stored == {"p1": "new text one", "p3": "new text three"} else "accepted",
            str(stored),
        )


def _stored(index: Path) -> dict:
    from tandemrl.retrieval.retriever import IndexMeta
    from tandemrl.retrieval.store import QdrantStore

    store = QdrantStore(index, None, IndexMeta.load(index).collection)
    try:
        points, _ = store.client.scroll(store.collection, limit=100, with_payload=True)
        return {p.payload["document"]["id"]: p.payload["document"]["contents"] for p in points}
    finally:
        store.close()


# ---- configs ----------------------------------------------------------------------------------------------


def _bomb(levels: int) -> str:
    names = "abcdefghij"
    lists = ["&a [" + ",".join(["lol"] * 10) + "]"]
    lists += [f"&{names[i]} [" + ",".join([f"*{names[i - 1]}"] * 10) + "]" for i in range(1, levels)]
    return "[" + ", ".join(lists) + "]"


def config_probe(tmp: Path) -> None:
    root = tmp / "configs"
    root.mkdir()
    files = {
        "alias bomb (10**9 values)": ("agentloop:\n  task_name: " + _bomb(9) + "\n", "expands"),
        "100000 levels": ("agentloop: " + "[" * 100_000 + "]" * 100_000 + "\n", "deeper"),
        "18 MB list": ("data:\n  train_data_paths: [" + ",".join(["x"] * 9_000_000) + "]\n", "KiB"),
        "5000-digit integer": ("runner:\n  max_steps: " + "7" * 5000 + "\n", "line 2"),
        "list as a key": ("? [a, b]\n: 1\n", "key"),
        "integer key": ("runner:\n  5: 3\n", "key 5"),
    }
    for name, (text, field) in files.items():
        path = root / f"{name.split()[0]}.yaml"
        path.write_text(text)
        classify(f"config {name}", *tandem("config", "show", str(path), timeout=90), field)
    loop = root / "loop.yaml"
    loop.symlink_to(loop)
    classify("config symlink loop", *tandem("config", "show", str(loop)), "loop")
    overrides = {
        "alias bomb override": ("agentloop.task_name=" + _bomb(7), "expands"),
        "deep override": ("agentloop.task_name=" + "[" * 30_000 + "]" * 30_000, "deeper"),
        "integer beyond 64 bits": ("runner.max_steps=1" + "0" * 30, "runner.max_steps"),
        "5000-item list for a string": ("agentloop.task_name=[" + ",".join(["1"] * 5000) + "]", "task_name"),
        "non-UTF-8 override bytes": (os.fsdecode(b"runner.name=caf\xff"), "UTF-8"),
        "max_turns 0": ("agentloop.max_turns=0", "max_turns"),
        "max_turns huge": ("agentloop.max_turns=100000000", "max_turns"),
        "vllm without server_addrs": ("rollout.backend=vllm", "server_addrs"),
        "missing model path": (f"rollout.model.model_path={root / 'no-model'}", "model_path"),
    }
    for name, (override, field) in overrides.items():
        classify(f"config {name}", *tandem("config", "show", str(CONFIG), override), field)


# ---- servers ----------------------------------------------------------------------------------------------


def _raw(url: str, method: str, path: str, headers: dict, body: bytes = b"") -> tuple[int | None, str]:
    host, port = url.split("//")[1].split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=20)
    try:
        connection.putrequest(method, path)
        for key, value in headers.items():
            connection.putheader(key, value)
        connection.putheader("Content-Length", str(len(body)))
        connection.endheaders(body)
        response = connection.getresponse()
        return response.status, response.read().decode(errors="replace")
    except TimeoutError:
        return None, ""
    except (ConnectionError, http.client.HTTPException) as error:
        return 599, f"dropped connection: {error!r}"
    finally:
        connection.close()


def classify_http(name: str, status: int | None, text: str, field: str) -> None:
    if status is None:
        record(name, "hang")
    elif status >= 500 or "Traceback" in text:
        record(name, "crash", f"{status} {text}")
    elif 200 <= status < 300:
        record(name, "accepted", text)
    elif field.lower() in text.lower():
        record(name, "clear")
    else:
        record(name, "unclear", f"{status} {text}")


def _post(url: str, path: str, body, headers: dict | None = None) -> tuple[int | None, str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return _raw(url, "POST", path, {"Content-Type": "application/json", **(headers or {})}, data)


def engine_probe(model_dir: Path) -> None:
    from tandemrl.rollout.engine_process import EngineProcess

    auth = {"Authorization": f"Bearer {KEY}"}
    with EngineProcess(model_dir, max_context_len=256, api_key=KEY, weight_update_timeout_s=5) as proc:
        for value in (b"Bearer \xff\xfe", b"\xff", f"Bearer {KEY}".encode() + b"\x80"):
            status, text = _post(proc.url, "/generate", {"input_ids": [1, 2]}, {"Authorization": value})
            classify_http(f"engine key header {value[:12]!r}", status, text, "API key")
        generate = {
            "stop_token_ids beyond the vocabulary": (
                {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [10**12]}},
                "stop_token_ids",
            ),
            "stop_token_ids just beyond int32": (
                {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [2**31]}},
                "stop_token_ids",
            ),
            "top_k 10**30": ({"input_ids": [1, 2], "sampling_params": {"top_k": 10**30}}, "top_k"),
            "max_new_tokens 10**30": (
                {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10**30}},
                "max_new_tokens",
            ),
            "1000 stop strings": ({"input_ids": [1, 2], "sampling_params": {"stop": ["a"] * 1000}}, "stop"),
            "text with a lone surrogate": (b'{"text": "caf\\ud800"}', "text"),
            "stop with a lone surrogate": (
                b'{"input_ids": [1], "sampling_params": {"stop": ["\\udc00"]}}',
                "stop",
            ),
            "empty body object": ({}, "input_ids"),
            "only sampling_params": ({"sampling_params": {"max_new_tokens": 1}}, "input_ids"),
        }
        for name, (body, field) in generate.items():
            classify_http(f"engine generate {name}", *_post(proc.url, "/generate", body, auth), field)
        status, text = _raw(proc.url, "GET", "/health", {})
        record(
            "engine alive after the bad /generate bodies",
            "clear" if status == 200 else "crash",
            f"{status} {text}",
        )
    with EngineProcess(model_dir, max_context_len=256, api_key=KEY, weight_update_timeout_s=5) as proc:
        rope = "model.layers.0.self_attn.rotary_emb.inv_freq"
        updates = {
            "weight_version 10**30": ({"weight_version": 10**30}, "weight_version"),
            "weight_version string of 40 digits": ({"weight_version": "9" * 40}, "weight_version"),
            "weight_version 2**31": ({"weight_version": 2**31}, "weight_version"),
            "RoPE inv_freq": ({"names": [rope], "shapes": [[4]], "dtypes": ["float32"]}, "RoPE"),
            "repeated name": (
                {"names": ["model.norm.weight"] * 2, "shapes": [[64], [64]], "dtypes": ["float32"] * 2},
                "twice",
            ),
        }
        for index, (name, (extra, field)) in enumerate(updates.items()):
            group_name = f"g{index}"  # a fresh group each: an accepted update that times out drops its group
            _join(proc.url, group_name, auth)
            body = {
                "names": ["model.norm.weight"],
                "shapes": [[64]],
                "dtypes": ["float32"],
                "group_name": group_name,
                **extra,
            }
            status, text = _post(proc.url, "/update_weights_from_distributed", body, auth)
            classify_http(f"engine update {name}", status, text, field)
    _serve_engine_cases(model_dir)


def _join(url: str, group_name: str, auth: dict) -> None:
    """Form a gloo group with the engine (this process is rank 0, as a trainer is)."""
    import threading

    from tandemrl.engine.weight_transport import new_process_group
    from tandemrl.host.child_server import free_port

    port, groups = free_port(), []
    thread = threading.Thread(
        target=lambda: groups.append(new_process_group("127.0.0.1", port, 0, 2, group_name, "gloo", 20.0))
    )
    thread.start()
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
    status, text = _post(url, "/init_weights_update_group", {**body, "group_name": group_name}, auth)
    thread.join()
    assert status == 200, f"group join failed: {status} {text}"


def _serve_engine_cases(model_dir: Path) -> None:
    from tandemrl.host.child_server import free_port

    name = "serve-engine on 0.0.0.0 without a key"
    flags = ["--model", str(model_dir), "--device", "cpu"]
    code, text = tandem("serve-engine", *flags, "--host", "0.0.0.0", "--port", str(free_port()), timeout=60)
    if code is None:
        record(name, "accepted", "still serving after 60 s")
    else:
        classify(name, code, text, "--api-key")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, text = tandem("serve-engine", *flags, "--port", str(port), timeout=60)
    classify("serve-engine on a port in use", code, text, "already in use")
    if "serving" in text.lower():
        record("serve-engine on a port in use", "unclear", f"logged serving before the bind failed: {text}")


def retrieval_probe(tmp: Path) -> None:
    from tandemrl.host.child_server import free_port
    from tandemrl.retrieval.server_process import RetrievalServerProcess

    index = tmp / "where-the-index-lives" / "index"
    corpus = _corpus(
        tmp / "r.jsonl", [_rec("p1", "Alaric Venn was born in Marrowdale."), _rec("p2", "Brisa plays.")]
    )
    tandem("index", "build", "--corpus", str(corpus), "--index", str(index))
    with RetrievalServerProcess(index, api_key=KEY) as server:
        url, auth = f"http://{server.addr}", {"Authorization": f"Bearer {KEY}"}
        bodies = {
            "empty query": ({"queries": [""]}, "queries[0]"),
            "blank query": ({"queries": ["ok", " \t "]}, "queries[1]"),
            "non-UTF-8 body": (b'{"queries": ["\xff\xfe"]}', "error"),
            "body nested 100000 deep": (b"[" * 100_000 + b"]" * 100_000, "error"),
        }
        for name, (body, field) in bodies.items():
            status, text = _post(url, "/retrieve", body, auth)
            classify_http(f"retrieval {name}", status, text, field)
            if status is not None and status >= 400 and '"error"' not in text:
                record(f"retrieval {name}", "unclear", f"another error shape: {text}")
        status, text = _post(url, "/retrieve", {"queries": ["q"]}, {"Authorization": b"Bearer \xff\xfe"})
        classify_http("retrieval key header not UTF-8", status, text, "API key")
        status, text = _raw(url, "GET", "/health", {})
        leaked = str(index) in text or "where-the-index-lives" in text
        record("retrieval /health shows the index path", "accepted" if leaked else "clear", text)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, text = tandem("serve-retrieval", "--index", str(index), "--port", str(port), timeout=90)
    classify("serve-retrieval on a port in use", code, text, "already in use")
    code, text = tandem(
        "serve-retrieval", "--index", str(_empty_index(tmp)), "--port", str(free_port()), timeout=90
    )
    if code is None:
        record("serve-retrieval of an empty index", "accepted", "still serving after 90 s")
    else:
        classify("serve-retrieval of an empty index", code, text, "0 passages")


def _empty_index(tmp: Path) -> Path:
    from tandemrl.retrieval.retriever import IndexMeta
    from tandemrl.retrieval.store import QdrantStore

    empty = tmp / "empty-index"
    store = QdrantStore(empty)
    store.create(384, has_sparse=False)
    store.close()
    IndexMeta(encoder="minilm", dim=384).save(empty)
    return empty


def main() -> None:
    from benchmarks.engine.model_shapes import make_tiny_model_dir
    from tandemrl.data.prepare_model import prepare_model

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/robustness/hostile_inputs_round2.json")
    args = parser.parse_args()
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        model_dir = make_tiny_model_dir(tmp / "tiny", prepare_model())
        config_probe(tmp)
        index_probe(tmp)
        retrieval_probe(tmp)
        engine_probe(model_dir)
        checkpoint_probe(model_dir, tmp)
    report = summary()
    report["seconds"] = round(time.monotonic() - start, 1)
    print(json.dumps(report, indent=1))
    write_json(args.out, report, indent=1)


if __name__ == "__main__":
    main()
