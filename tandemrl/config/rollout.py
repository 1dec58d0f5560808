"""The rollout's sections: `rollout.*` (the backend, its servers, the model they serve, the pause
protocol) and `rollout_buffer.*` (how many groups are in flight, wait, and how stale they may get).
The embedded engine's own keys (`rollout.engine.*`) live in config/engine.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandemrl.config.checks import (
    _check,
    _check_choice,
    _check_finite_positive,
    _check_positive,
    _is_host_port,
)
from tandemrl.config.engine import EngineOptions

# requests one engine runs at once: far above what fits on one GPU (SGLang sizes it from memory, a few
# thousand at most); 10**9 passed, and on a GPU the embedded engine would capture a graph per 16 of them
MAX_RUNNING_REQUESTS = 1 << 14

PAUSE_MODES = ("retract", "in_place", "drain")
ROLLOUT_BACKENDS = ("embedded", "sglang", "vllm")
SGLANG_BACKEND_TYPES = ("server", "engine")
HANDOFF_ORDERS = ("issue", "finish")
# the pause modes vLLM has no equivalent of (config/derive.py refuses them; rollout/vllm_client.py too)
UNSUPPORTED_PAUSE_MODES = {
    "retract": "vLLM's /pause has modes abort, wait and keep; none returns running requests to the "
    "queue with their KV cache freed (keep freezes them in place: that is our in_place)"
}


@dataclass
class ModelConfig:
    model_path: str | None = None  # None: the embedded SmolLM2 directory under $TANDEM_HOME


@dataclass
class SglangConfig:
    """The SGLang servers tandem launches (`rollout.backend: sglang` without `rollout.server_addrs`):
    `python -m sglang.launch_server` on each instance's node and GPUs, see rollout/sglang_process.py."""

    backend_type: str = "server"
    mem_fraction_static: float = 0.85  # --mem-fraction-static: GPU memory for weights + KV cache
    host: str | None = None  # --host; None: the node's address (127.0.0.1 on a one-node run)
    port: int = 30000  # --port of a node's first instance; the next ones on that node count up
    extra_args: list[str] = field(
        default_factory=list
    )  # appended verbatim, e.g. ["--attention-backend", "fa3"]
    # the interpreter that runs the server (None: tandem's own), and directories put first on its
    # PYTHONPATH for that process only (an engine installed with `pip --target`, docs/BACKENDS.md)
    python: str | None = None
    pythonpath: list[str] = field(default_factory=list)

    def __post_init__(self):
        _check_choice("rollout.sglang.backend_type", self.backend_type, SGLANG_BACKEND_TYPES)
        _check(
            0 < self.mem_fraction_static <= 1,
            "rollout.sglang.mem_fraction_static",
            self.mem_fraction_static,
            "must be in (0, 1]",
            "Use e.g. 0.85.",
        )
        _check(
            0 < self.port < 65536, "rollout.sglang.port", self.port, "is not a TCP port", "Use e.g. 30000."
        )


@dataclass
class VllmConfig:
    """The vLLM servers tandem launches (`rollout.backend: vllm` without `rollout.server_addrs`):
    `python -m vllm.entrypoints.openai.api_server` on each instance's node and GPUs (or CPU), see
    rollout/vllm_server.py."""

    gpu_memory_utilization: float = 0.85  # --gpu-memory-utilization: GPU memory for weights + KV cache
    host: str | None = None  # --host; None: the node's address (127.0.0.1 on a one-node run)
    port: int | None = None  # --port of a node's first instance, counting up; None: a free port
    cpu_kv_cache_gb: int = (
        1  # VLLM_CPU_KVCACHE_SPACE (whole GiB) on CPU; vLLM takes most of the RAM otherwise
    )
    extra_args: list[str] = field(default_factory=list)  # appended verbatim, e.g. ["--enforce-eager"]
    python: str | None = None  # as rollout.sglang.python
    pythonpath: list[str] = field(default_factory=list)  # as rollout.sglang.pythonpath

    def __post_init__(self):
        _check(
            0 < self.gpu_memory_utilization <= 1,
            "rollout.vllm.gpu_memory_utilization",
            self.gpu_memory_utilization,
            "must be in (0, 1]",
            "Use e.g. 0.85 (less when the actor shares the GPU).",
        )
        _check(
            self.port is None or 0 < self.port < 65536,
            "rollout.vllm.port",
            self.port,
            "is not a TCP port",
            "Use e.g. 8000, or null for a free port.",
        )
        _check_positive("rollout.vllm.cpu_kv_cache_gb", self.cpu_kv_cache_gb)


def check_vllm_speculative_device(engine: EngineOptions, device: str) -> None:
    """At config time (rollout.device) and again at launch, where `auto` has become a device
    (rollout/vllm_server.py). vllm-cpu 0.32's CPU stand-in for the rejection sampler's Triton `_expand`
    (vllm/utils/cpu_triton_utils.py, `_expand_kernel_impl`) writes into an int64 copy of a float output
    and drops it, so the per-draft-token temperatures are uninitialised memory; tests/vllm/
    test_vllm_speculative.py holds both that and the greedy path, which it does not touch."""
    _check(
        engine.speculative == "none" or device != "cpu",
        "rollout.engine.speculative",
        engine.speculative,
        "vllm-cpu 0.32 samples drafted positions at garbage temperatures under speculation (its CPU "
        "_expand_kernel_impl drops float results), so T>0 rollouts are not the policy's",
        "Set rollout.engine.speculative to none for vLLM on CPU, or run vLLM on CUDA.",
    )


@dataclass
class RolloutConfig:
    pause_mode: str | None = None  # derived: retract (in_place on vLLM, which has no retract)
    backend: str = "embedded"
    sglang: SglangConfig = field(default_factory=SglangConfig)
    vllm: VllmConfig = field(default_factory=VllmConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    max_running_requests: int = 64
    instances: int | None = None  # None: 1, or derived from cluster.component_placement
    tensor_parallel_size: int = 1
    server_addrs: list[str] = field(default_factory=list)  # external engines (sglang/vllm backends)
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    max_context_len: int = 4096
    weight_sync: str = "auto"  # auto | gloo | nccl | cuda_ipc | disk (safetensors the engines reload)
    weight_sync_dir: str | None = (
        None  # disk sync: a directory the engines can read; None: <output_dir>/weight_sync
    )
    sync_bucket_mb: int = 256
    # launch to healthy, per launched engine; None: derived, 300 s for the embedded engine, 900 s for vLLM
    # and SGLang (a first vLLM start of SmolLM2-135M on a fresh H100 took 247 s: CUDA graphs, torch.compile
    # and its warm-up; a larger model loads and captures longer)
    startup_timeout_s: float | None = None
    # the embedded engine's own settings, whole and under their engine names (tandemrl/config/engine.py)
    engine: EngineOptions = field(default_factory=EngineOptions)
    # an announced weight update whose tensors do not arrive within this is aborted (old weights kept)
    weight_update_timeout_s: float = 600.0
    # key of external engines (rollout.server_addrs); None: $TANDEM_ENGINE_API_KEY or $SGLANG_API_KEY.
    # Engines the run launches get a fresh key of their own.
    api_key: str | None = None

    def __post_init__(self):
        _check_finite_positive("rollout.weight_update_timeout_s", self.weight_update_timeout_s)
        _check_finite_positive("rollout.startup_timeout_s", self.startup_timeout_s, allow_none=True)
        if self.pause_mode is not None:
            _check_choice("rollout.pause_mode", self.pause_mode, PAUSE_MODES)
        _check_choice("rollout.backend", self.backend, ROLLOUT_BACKENDS)
        _check_choice("rollout.device", self.device, ("auto", "cpu", "cuda"))
        _check_choice("rollout.dtype", self.dtype, ("auto", "float32", "bfloat16", "float16"))
        _check_choice("rollout.weight_sync", self.weight_sync, ("auto", "gloo", "nccl", "cuda_ipc", "disk"))
        _check(
            0 < self.max_running_requests <= MAX_RUNNING_REQUESTS,
            "rollout.max_running_requests",
            self.max_running_requests,
            f"must be in 1..{MAX_RUNNING_REQUESTS:,} (requests one engine decodes at once; each holds a KV block "
            "and a decode row, and the embedded engine captures a CUDA graph for every 16 rows up to it)",
            "Use e.g. 512.",
        )
        _check_positive("rollout.instances", self.instances, allow_none=True)
        _check_positive("rollout.tensor_parallel_size", self.tensor_parallel_size)
        _check_positive("rollout.max_context_len", self.max_context_len)
        _check_positive("rollout.sync_bucket_mb", self.sync_bucket_mb)
        for index, addr in enumerate(self.server_addrs):
            _check(
                _is_host_port(addr),
                f"rollout.server_addrs[{index}]",
                addr,
                "must be host:port (or http(s)://host:port) with a port from 1 to 65535",
                "Use e.g. 127.0.0.1:30000.",
            )
        _check(
            len(set(self.server_addrs)) == len(self.server_addrs),
            "rollout.server_addrs",
            self.server_addrs,
            "names an engine twice, so it would get every weight update twice and be counted as two",
            "List each engine once.",
        )
        self._check_speculative()

    def _check_speculative(self) -> None:
        """`rollout.engine.speculative` reaches launched vLLM and SGLang servers as their own n-gram flags
        (rollout/vllm_server.py, rollout/sglang_process.py): both versions verify drafts with the target
        model and return its logprobs for every accepted token, which the trainer takes as old logprobs."""
        engine = self.engine
        if engine.speculative == "none" or self.backend == "embedded":
            return
        _check(
            not self.server_addrs,
            "rollout.engine.speculative",
            engine.speculative,
            f"tandem launches no {self.backend} server to pass it to when rollout.server_addrs is set",
            "Start your servers with their own speculative flags and set rollout.engine.speculative to none.",
        )
        if self.backend == "vllm":
            check_vllm_speculative_device(engine, self.device)
            return
        _check(
            self.device != "cpu",
            "rollout.engine.speculative",
            engine.speculative,
            "SGLang 0.5.15's NGRAM speculation runs on CUDA only",
            "Set rollout.device to cuda (or auto), or rollout.engine.speculative to none.",
        )
        sizes = (engine.spec_ngram_min, engine.spec_ngram_max)
        _check(
            sizes == (EngineOptions.spec_ngram_min, EngineOptions.spec_ngram_max),
            "rollout.engine.spec_ngram_min/spec_ngram_max",
            list(sizes),
            "SGLang's NGRAM has no prompt-lookup sizes (it matches up to --speculative-ngram-max-trie-depth "
            "tokens in a trie of every request's tokens)",
            "Leave them at 1/3 and put SGLang's own --speculative-ngram-* flags in rollout.sglang.extra_args.",
        )
        _check(
            self.weight_sync != "disk",
            "rollout.engine.speculative",
            engine.speculative,
            "with rollout.weight_sync=disk kills SGLang 0.5.15's scheduler at the first push: it passes a disk "
            "update on to its draft worker, and the NGRAM worker has no update_weights_from_disk "
            "(managers/scheduler_components/weight_updater.py)",
            "Set rollout.weight_sync=auto (CUDA IPC or NCCL), or rollout.engine.speculative to none.",
        )


@dataclass
class RolloutBufferConfig:
    max_inflight_groups: int | None = None  # derived when unset
    max_buffered_groups: int | None = None  # derived: 2 x rollout_batch_size
    max_dropped_groups_per_step: int | None = None  # derived: 10 x rollout_batch_size
    # AReaL's staleness control at admission: groups are issued only while those issued and not dropped
    # stay within (weight versions so far + 1 + this) x rollout_batch_size. 0: no overlap, the sync
    # runner's schedule in the async runner; None: unlimited (only the limits above bound admission)
    max_head_offpolicyness: int | None = None
    # the order of a hand-off's groups, which the trainer cuts into contiguous minibatches. issue: the
    # loader's; finish: the order they finished in, which sorts a sync step by trajectory length (the
    # behaviour before issue 27, kept for the ablation)
    handoff_order: str = "issue"

    def __post_init__(self):
        for key in ("max_inflight_groups", "max_buffered_groups", "max_dropped_groups_per_step"):
            _check_positive(f"rollout_buffer.{key}", getattr(self, key), allow_none=True)
        _check_choice("rollout_buffer.handoff_order", self.handoff_order, HANDOFF_ORDERS)
        if self.max_head_offpolicyness is not None:
            _check(
                self.max_head_offpolicyness >= 0,
                "rollout_buffer.max_head_offpolicyness",
                self.max_head_offpolicyness,
                "must be >= 0 (weight versions a group may be issued ahead of training)",
                "Use 0 for the sync schedule in the async runner, or null for no limit.",
            )
