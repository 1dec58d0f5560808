"""`actor.param_dtype` and `actor.optim.state_dtype`: their defaults, their refusals (one line naming the key
and the fix), the compute dtype they imply, and the keys through `tandem config show`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandemrl.config.errors import ConfigError
from tandemrl.config.loader import load_config
from tandemrl.trainer.policy import resolve_compute_dtype, shard_policy

ROOT = Path(__file__).resolve().parents[2]
CPU_CONFIG = ROOT / "examples/searchr1/config/embedded_cpu_async.yaml"


def test_defaults_keep_fp32_weights_and_moments():
    actor = load_config(None, []).actor
    assert (actor.param_dtype, actor.optim.state_dtype) == ("float32", "float32")


def test_bf16_weights_refuse_fp32_compute_and_unknown_dtypes():
    with pytest.raises(
        ConfigError, match=r"actor.param_dtype='bfloat16': contradicts actor.dtype=float32"
    ) as err:
        load_config(None, ["actor.param_dtype=bfloat16", "actor.dtype=float32"])
    assert "Set actor.dtype=bfloat16 (or auto), or actor.param_dtype=float32" in str(err.value)
    with pytest.raises(ConfigError, match="actor.param_dtype"):
        load_config(None, ["actor.param_dtype=float16"])
    with pytest.raises(ConfigError, match="actor.optim.state_dtype"):
        load_config(None, ["actor.optim.state_dtype=fp8"])
    for overrides in (
        ["actor.dtype=auto"],
        ["actor.dtype=bfloat16"],
        ["actor.device=cuda", "actor.cpu_offload=true"],
    ):
        assert load_config(None, ["actor.param_dtype=bfloat16", *overrides]).actor.param_dtype == "bfloat16"


def test_bf16_weights_compute_in_bf16_on_any_device():
    """auto resolves to fp32 on the CPU, except over bf16 weights; the actor refuses a contradiction the
    config could not see."""
    cpu = torch.device("cpu")
    assert resolve_compute_dtype("auto", cpu) == torch.float32
    assert resolve_compute_dtype("auto", cpu, "bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="actor.param_dtype=bfloat16 with compute dtype float32"):
        shard_policy(torch.nn.Module(), cpu, torch.float32, param_dtype=torch.bfloat16)


def _tandem(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tandemrl.cli", *args], capture_output=True, text=True, cwd=ROOT
    )


def test_config_show_carries_the_keys_and_refuses_in_one_line():
    shown = _tandem(
        "config", "show", str(CPU_CONFIG), "actor.param_dtype=bfloat16", "actor.optim.state_dtype=bfloat16"
    )
    assert shown.returncode == 0, shown.stderr
    assert "  param_dtype: bfloat16" in shown.stdout.splitlines()
    assert "    state_dtype: bfloat16" in shown.stdout.splitlines()
    bad = _tandem("config", "show", str(CPU_CONFIG), "actor.param_dtype=bfloat16", "actor.dtype=float32")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "actor.param_dtype" in bad.stderr
