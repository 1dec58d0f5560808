"""Derived values and the rules that span several sections.

Invariant: after `derive_and_validate(config)` every derived key holds a concrete value and
`config.derived[key]` says how it was obtained, so it can be logged and shown by `tandem config show`.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections import Counter
from pathlib import Path

from tandemrl.config.actor import ActorSetup
from tandemrl.config.engine import model_context_limit
from tandemrl.config.errors import value_summary
from tandemrl.config.rollout import UNSUPPORTED_PAUSE_MODES
from tandemrl.config.schema import ConfigError, TandemConfig

log = logging.getLogger(__name__)

INFLIGHT_HEADROOM = 1.2  # issue slightly more groups than the engines can run, so they never idle


def derive_and_validate(config: TandemConfig) -> list[str]:
    """Fill derived keys, check cross-section rules; returns the warnings (also logged)."""
    config.derived.clear()
    _check_placement(config)
    _derive_model_paths(config)
    _derive_instances(config)
    _derive_buffer_limits(config)
    _derive_output_dir(config)
    _derive_off_policy_correction(config)
    _derive_recompute_logprobs(config)
    _derive_pause_mode(config)
    _derive_startup_timeout(config)
    _derive_cpus_per_engine(config)
    _derive_prefix_cache_age(config)
    _validate_cross_section(config)
    _validate_sizes(config)
    _validate_paths(config)
    return _warnings(config)


COLDSTART = "coldstart"  # model_path alias: the embedded policy after `tandem sft`


def _derive_model_paths(config: TandemConfig) -> None:
    """`coldstart` names the cold-started embedded policy; one model path: the actor trains what the
    rollout serves (a model path set on the rollout side alone would otherwise leave the actor on the
    default SmolLM2 until the first weight push failed), and two different paths are an error unless
    `actor.allow_different_model` says they differ on purpose."""
    from tandemrl.host.home import default_coldstart_dir

    for key, model in (
        ("rollout.model.model_path", config.rollout.model),
        ("actor.model.model_path", config.actor.model),
    ):
        if model.model_path == COLDSTART:
            model.model_path = str(default_coldstart_dir())
            config.derived[key] = f"{model.model_path} (coldstart: the output of `tandem sft`)"
    rollout_path, actor_path = config.rollout.model.model_path, config.actor.model.model_path
    if actor_path is None and rollout_path is not None:
        config.actor.model.model_path = rollout_path
        config.derived["actor.model.model_path"] = f"{rollout_path} (= rollout.model.model_path)"
    elif rollout_path is None and actor_path is not None:
        config.rollout.model.model_path = actor_path
        config.derived["rollout.model.model_path"] = f"{actor_path} (= actor.model.model_path)"
    elif actor_path != rollout_path and not config.actor.allow_different_model:
        raise ConfigError(
            f"actor.model.model_path={actor_path!r} differs from rollout.model.model_path={rollout_path!r}: "
            "the actor would train other weights than the engines serve, and the first weight push would fail "
            "or silently replace them. Set only rollout.model.model_path (the actor follows it), or, to start "
            "the actor from other weights of the same architecture on purpose, set "
            "actor.allow_different_model=true."
        )


def _derive_instances(config: TandemConfig) -> None:
    rollout = config.rollout
    if rollout.instances is not None:
        return
    keys = [key for key in config.cluster.component_placement if "rollout" in key.split(",")]
    spec = config.cluster.component_placement[keys[0]] if keys else None
    if spec is None:
        rollout.instances = 1
        config.derived["rollout.instances"] = "1 (no rollout placement in cluster.component_placement)"
        return
    num_gpus = len(parse_gpu_range(spec, f"cluster.component_placement.{keys[0]}"))
    if num_gpus % rollout.tensor_parallel_size:
        raise ConfigError(
            f"cluster.component_placement.{keys[0]}={spec!r}: {num_gpus} GPUs cannot be split into engines of "
            f"rollout.tensor_parallel_size={rollout.tensor_parallel_size}. Give the rollout a multiple of "
            "tensor_parallel_size GPUs."
        )
    rollout.instances = num_gpus // rollout.tensor_parallel_size
    config.derived["rollout.instances"] = (
        f"{rollout.instances} = {num_gpus} rollout GPUs / tensor_parallel_size {rollout.tensor_parallel_size}"
    )


# GPU ids, actor ranks and engine instances stay below this: '0-1000000000000' built a list until memory ran
# out, and actor.num_ranks=1e18 a plan that never finished printing
MAX_GPUS = 1 << 16
# a step's trajectories live in the driver's memory together (100 million of them ran a 24 GiB machine out of
# memory before step 1); the largest published recipes use about 8,192 (DAPO: 512 prompts x 16)
MAX_TRAJECTORIES_PER_STEP = 1 << 16
_GPU_RANGE = re.compile(r"\s*([0-9]+)\s*(?:-\s*([0-9]+)\s*)?")  # ASCII digits: int() also reads '٣', '1_0'


def parse_gpu_range(spec: str, key: str) -> list[int]:
    """'0-7' -> [0..7]; '0,2,4-5' -> [0, 2, 4, 5]; each GPU once, ranges ascending, ids below MAX_GPUS."""
    gpus: list[int] = []
    for part in str(spec).split(","):
        match = _GPU_RANGE.fullmatch(part)
        if match is None:
            raise ConfigError(f"{key}={spec!r}: not a GPU range. Use e.g. '0-7' or '0,1,4-5'.")
        low, high = int(match[1]), int(match[2] or match[1])
        if not low <= high < MAX_GPUS:
            raise ConfigError(
                f"{key}={spec!r}: {part.strip()!r} is not a range of GPU ids: it must go up (low-high) and stay "
                f"below {MAX_GPUS}. Use e.g. '0-7'."
            )
        gpus.extend(range(low, high + 1))
    twice = sorted(gpu for gpu, count in Counter(gpus).items() if count > 1)
    if twice:
        raise ConfigError(
            f"{key}={spec!r} names GPU {', '.join(map(str, twice[:4]))} more than once: each GPU runs one process of a "
            "component. List each GPU once (to share a GPU between the actor and the rollout, use the key "
            "'actor,rollout')."
        )
    return gpus


def _check_placement(config: TandemConfig) -> None:
    """Every GPU range parses (the actor's too, which only the plan reads), and the process counts stay
    plannable: ranks without a placement run on node 0's GPUs, so no more of them than the node has."""
    cluster, actor, rollout = config.cluster, config.actor, config.rollout
    for key, spec in cluster.component_placement.items():
        parse_gpu_range(spec, f"cluster.component_placement.{key}")
    for key, count in (("actor.num_ranks", actor.num_ranks), ("rollout.instances", rollout.instances)):
        if count is not None and count > MAX_GPUS:
            raise ConfigError(
                f"{key}={count}: at most {MAX_GPUS} (one process per GPU). Fix the value of {key}."
            )
    has_actor_gpus = any("actor" in key.split(",") for key in cluster.component_placement)
    per_node = cluster.num_gpus_per_node
    if actor.device == "cuda" and not has_actor_gpus and per_node and actor.num_ranks > per_node:
        raise ConfigError(
            f"actor.num_ranks={actor.num_ranks} with actor.device=cuda and no actor GPUs in "
            f"cluster.component_placement: the ranks run on node 0, one per GPU, and cluster.num_gpus_per_node="
            f"{per_node}. Lower actor.num_ranks to at most {per_node}, or place the ranks across nodes with "
            f"cluster.component_placement.actor (e.g. '0-{actor.num_ranks - 1}')."
        )


def _derive_buffer_limits(config: TandemConfig) -> None:
    buffer = config.rollout_buffer
    batch = config.data.rollout_batch_size
    if buffer.max_inflight_groups is None:
        rollout, group_size = config.rollout, config.algorithm.group_size
        buffer.max_inflight_groups = derived_inflight_groups(config)
        config.derived["rollout_buffer.max_inflight_groups"] = (
            f"{buffer.max_inflight_groups} = ceil(max_running_requests {rollout.max_running_requests} x "
            f"instances {rollout.instances} x {INFLIGHT_HEADROOM} / group_size {group_size})"
        )
    if buffer.max_buffered_groups is None:
        buffer.max_buffered_groups = 2 * batch
        config.derived["rollout_buffer.max_buffered_groups"] = (
            f"{buffer.max_buffered_groups} = 2 x rollout_batch_size {batch}"
        )
    if buffer.max_dropped_groups_per_step is None:
        buffer.max_dropped_groups_per_step = 10 * batch
        config.derived["rollout_buffer.max_dropped_groups_per_step"] = (
            f"{buffer.max_dropped_groups_per_step} = 10 x rollout_batch_size {batch}"
        )


def actor_setup(config: TandemConfig, total_updates: int | None = None) -> ActorSetup:
    """The actor's part of the run's config; `total_updates` replaces the RL run's schedule length
    (the cold start counts its own updates, trainer/sft.py)."""
    return ActorSetup(
        config.actor,
        config.algorithm,
        config.agentloop.temperature or 1.0,
        total_updates or config.runner.max_steps * config.algorithm.n_minibatches,
    )


def derived_inflight_groups(config: TandemConfig) -> int:
    rollout, group_size = config.rollout, config.algorithm.group_size
    return math.ceil(rollout.max_running_requests * rollout.instances * INFLIGHT_HEADROOM / group_size)


def _derive_output_dir(config: TandemConfig) -> None:
    if config.runner.output_dir is None:
        config.runner.output_dir = f"runs/{config.runner.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        config.derived["runner.output_dir"] = "runs/<runner.name>-<start time>"


def _derive_off_policy_correction(config: TandemConfig) -> None:
    """Unset: decoupled PPO in async, where a batch was sampled by weights older than the actor's (on the
    H200 recipe the clip against those older weights held async's val EM 0.075 below sync, decoupled
    within 0.025: docs/LEARNING.md, Off-policy correction), unless algorithm.recompute_logprobs=false says
    to keep the rollout's logprobs; none in sync, where they are the same."""
    algorithm = config.algorithm
    if algorithm.off_policy_correction is not None:
        return
    if (
        config.runner.async_mode
        and algorithm.recompute_logprobs is False
        and algorithm.proximal_logprobs == "recompute"
    ):
        algorithm.off_policy_correction = "none"
        why = "async, but algorithm.recompute_logprobs=false keeps the rollout's logprobs as the old ones"
    elif config.runner.async_mode:
        algorithm.off_policy_correction = "decoupled"
        why = "async: the batch was sampled by older weights; the clip is centred on the actor's own"
    else:
        algorithm.off_policy_correction = "none"
        why = "sync: the rollout's weights are the actor's"
    config.derived["algorithm.off_policy_correction"] = f"{algorithm.off_policy_correction} ({why})"
    algorithm.check_correction()


def _derive_recompute_logprobs(config: TandemConfig) -> None:
    algorithm = config.algorithm
    if algorithm.recompute_logprobs is None:
        correction = algorithm.off_policy_correction
        needs = correction != "none" and algorithm.proximal_logprobs == "recompute"
        algorithm.recompute_logprobs = needs
        if needs:
            why = "its importance weight needs the proximal logprobs"
        elif correction == "none":
            why = "no correction"
        else:
            why = {
                "current": "algorithm.proximal_logprobs=current takes them from each minibatch's own forward",
                "loglinear": "algorithm.proximal_logprobs=loglinear interpolates them between the rollout's "
                "and each minibatch's own forward",
            }[algorithm.proximal_logprobs]
        config.derived["algorithm.recompute_logprobs"] = (
            f"{str(needs).lower()} (algorithm.off_policy_correction={correction}: {why})"
        )


def _derive_pause_mode(config: TandemConfig) -> None:
    rollout = config.rollout
    if rollout.pause_mode is None:
        rollout.pause_mode = "in_place" if rollout.backend == "vllm" else "retract"
        config.derived["rollout.pause_mode"] = (
            f"{rollout.pause_mode} (the default for rollout.backend={rollout.backend})"
        )
    if rollout.backend == "vllm" and rollout.pause_mode in UNSUPPORTED_PAUSE_MODES:
        raise ConfigError(
            f"rollout.pause_mode={rollout.pause_mode!r} with rollout.backend=vllm: "
            f"{UNSUPPORTED_PAUSE_MODES[rollout.pause_mode]}. Set rollout.pause_mode=in_place (vLLM's keep) or "
            "drain, or leave it unset."
        )


STARTUP_TIMEOUT_S = {"embedded": 300.0, "vllm": 900.0, "sglang": 900.0}  # see rollout.startup_timeout_s


def _derive_startup_timeout(config: TandemConfig) -> None:
    rollout = config.rollout
    if rollout.startup_timeout_s is None:
        rollout.startup_timeout_s = STARTUP_TIMEOUT_S[rollout.backend]
        config.derived["rollout.startup_timeout_s"] = (
            f"{rollout.startup_timeout_s:g} (the default for rollout.backend={rollout.backend})"
        )


_SERVER_PROCESSES = "its server runs several processes of its own, left to the OS"
# see cluster.cpus_per_engine: the cores pinned to each engine, and why
CPUS_PER_ENGINE = {
    "embedded": (2, "its loop thread paces the engine"),
    "vllm": (0, _SERVER_PROCESSES),
    "sglang": (0, _SERVER_PROCESSES),
}


def _derive_cpus_per_engine(config: TandemConfig) -> None:
    cluster, backend = config.cluster, config.rollout.backend
    if cluster.cpus_per_engine is None:
        cluster.cpus_per_engine, why = CPUS_PER_ENGINE[backend]
        config.derived["cluster.cpus_per_engine"] = (
            f"{cluster.cpus_per_engine} (rollout.backend={backend}: {why})"
        )


def _derive_prefix_cache_age(config: TandemConfig) -> None:
    """The embedded engine's `prefix_cache_max_age`: 1 where rollouts are in flight across an update (the
    async runner: the previous weights' K/V keeps serving, as in_place pausing keeps it for running
    requests), 0 where none are (the sync runner, and the async runner at max_head_offpolicyness 0, which
    runs its schedule): there exact K/V costs one prefill of the shared prefix per update."""
    engine = config.rollout.engine
    if config.rollout.backend != "embedded" or engine.prefix_cache_max_age is not None:
        return
    if not config.runner.async_mode:
        age, why = 0, "sync: nothing is in flight at an update, so K/V stays exact"
    elif config.rollout_buffer.max_head_offpolicyness == 0:
        age, why = 0, "async at max_head_offpolicyness 0: the sync schedule, exact K/V"
    else:
        age = 1
        why = "async: the previous weights' K/V keeps serving, as in_place pausing keeps it for running requests"
    engine.prefix_cache_max_age = age
    config.derived["rollout.engine.prefix_cache_max_age"] = f"{engine.prefix_cache_max_age} ({why})"


def _validate_cross_section(config: TandemConfig) -> None:
    buffer, batch = config.rollout_buffer, config.data.rollout_batch_size
    if buffer.max_buffered_groups < batch:
        raise ConfigError(
            f"rollout_buffer.max_buffered_groups={buffer.max_buffered_groups} is smaller than "
            f"data.rollout_batch_size={batch}: the buffer could never hold one step's worth of groups, so "
            f"training would wait forever. Set rollout_buffer.max_buffered_groups >= {batch} (default "
            f"{2 * batch}), or lower data.rollout_batch_size."
        )
    if config.runner.async_mode and not config.agentloop.task_name:
        raise ConfigError(
            "agentloop.task_name is unset but runner.async_mode=true: async training keys the rollout "
            "buffer's per-task state by it and stamps it on every rollout request. Set "
            "agentloop.task_name, e.g. agentloop.task_name=searchr1."
        )
    _validate_colocated_policy(config)
    _validate_sync_runner_keys(config)
    rollout = config.rollout
    if rollout.backend == "embedded" and rollout.tensor_parallel_size > 1 and not rollout.server_addrs:
        raise ConfigError(
            f"rollout.tensor_parallel_size={rollout.tensor_parallel_size} with rollout.backend=embedded: the "
            "embedded engine runs a model on one device and has no tensor parallelism. Set "
            "rollout.tensor_parallel_size=1 (more engines: give the rollout more GPUs), or use "
            "rollout.backend=sglang."
        )
    _validate_runner_steps(config)
    cpu_sides = [
        f"{side}.device=cpu" for side in ("actor", "rollout") if getattr(config, side).device == "cpu"
    ]
    if rollout.weight_sync in ("nccl", "cuda_ipc") and cpu_sides:
        raise ConfigError(
            f"rollout.weight_sync={rollout.weight_sync} with {' and '.join(cpu_sides)}: NCCL and CUDA IPC move "
            "CUDA tensors, and a CPU side keeps its weights in host memory, so the first weight push would fail. "
            "Set rollout.weight_sync=auto (gloo for a CPU side) or gloo, or run both sides on cuda."
        )
    if config.runner.async_mode and config.rollout.sglang.backend_type != "server":
        raise ConfigError(
            f"rollout.sglang.backend_type={config.rollout.sglang.backend_type!r} with runner.async_mode=true: "
            "async mode pauses the engines and syncs weights through the server protocol, which only the "
            "server backend has. Set rollout.sglang.backend_type=server, or runner.async_mode=false."
        )


def _validate_colocated_policy(config: TandemConfig) -> None:
    """time_share stands the engines down with a pause that keeps what they generated, and gives each side
    the whole GPU in turn: drain (nothing kept, in-flight groups finished first) and SM caps (for sides
    running at once) contradict it."""
    cluster, pause_mode = config.cluster, config.rollout.pause_mode
    if cluster.colocated_policy != "time_share":
        return
    if pause_mode == "drain":
        raise ConfigError(
            "cluster.colocated_policy=time_share with rollout.pause_mode=drain: time-sharing stands the engines "
            "down while the actor trains and keeps what they generated, and drain instead finishes every "
            "in-flight group before each weight push. Set rollout.pause_mode=retract or in_place, or "
            "cluster.colocated_policy=concurrent."
        )
    if cluster.mps_sm_percent:
        raise ConfigError(
            f"cluster.mps_sm_percent={cluster.mps_sm_percent!r} with cluster.colocated_policy=time_share: the "
            "caps split the SMs between an actor and engines that run at once, and time-sharing runs them in "
            "turn, each on the whole GPU. Remove cluster.mps_sm_percent, or set "
            "cluster.colocated_policy=concurrent."
        )


def _validate_sync_runner_keys(config: TandemConfig) -> None:
    """Keys of the async runner that the sync runner never reads: set with it, they would be silently
    ignored. The sync runner generates exactly one step's groups and trains on them before generating
    again, so nothing overlaps (no GPU to time-share) and every group is on-policy (staleness 0)."""
    if config.runner.async_mode:
        return
    cluster, buffer = config.cluster, config.rollout_buffer
    if cluster.colocated_policy == "time_share":
        raise ConfigError(
            "cluster.colocated_policy=time_share with runner.async_mode=false: the sync runner already runs "
            "rollout and training in turn, so there is nothing to time-share and the key would be ignored. "
            "Remove it (or set cluster.colocated_policy=auto), or set runner.async_mode=true."
        )
    if buffer.max_head_offpolicyness is not None:
        raise ConfigError(
            f"rollout_buffer.max_head_offpolicyness={buffer.max_head_offpolicyness} with "
            "runner.async_mode=false: the sync runner trains each batch under the weights that generated it "
            "(staleness 0), so this admission limit never binds and would be ignored. Remove it, or set "
            "runner.async_mode=true."
        )
    staleness = config.agentloop.max_actor_accept_staleness
    if staleness is not None:
        raise ConfigError(
            f"agentloop.max_actor_accept_staleness={staleness} with runner.async_mode=false: the sync runner "
            "trains each batch under the weights that generated it (staleness 0), so no group is ever dropped "
            "as stale and the key would be ignored. Remove it, or set runner.async_mode=true."
        )


def _validate_runner_steps(config: TandemConfig) -> None:
    """Step numbers and probe lengths that name work the run will never do."""
    runner = config.runner
    late = [step for step in runner.profile_steps if step > runner.max_steps]
    if late:
        raise ConfigError(
            f"runner.profile_steps={value_summary(runner.profile_steps)}: step(s) {value_summary(late)} are past "
            f"runner.max_steps={runner.max_steps}, so they never run and nothing would be profiled. List steps "
            f"from 1 to {runner.max_steps}."
        )
    if runner.weights_check_tokens:
        # the probes are at most a few dozen tokens; the check's output must fit the engine's context
        room = config.rollout.max_context_len - PROBE_PROMPT_TOKENS
        if runner.weights_check_tokens > room:
            raise ConfigError(
                f"runner.weights_check_tokens={runner.weights_check_tokens} does not fit "
                f"rollout.max_context_len={config.rollout.max_context_len} after the probe prompts (up to "
                f"{PROBE_PROMPT_TOKENS} tokens). Use at most {max(room, 0)}, e.g. 16."
            )


PROBE_PROMPT_TOKENS = 64  # runner/weights_check.py's PROBES are shorter than this in any tokenizer


def _validate_sizes(config: TandemConfig) -> None:
    """Limits that contradict each other: each would make a run useless or stall, found only later."""
    agent, rollout, algo = config.agentloop, config.rollout, config.algorithm
    if rollout.max_context_len <= agent.max_response_tokens:
        raise ConfigError(
            f"rollout.max_context_len={rollout.max_context_len} is not larger than "
            f"agentloop.max_response_tokens={agent.max_response_tokens}: the prompt and the response share the "
            "engine's context, so no trajectory could reach its response budget. Raise rollout.max_context_len "
            f"(e.g. to {agent.max_response_tokens + 1024}) or lower agentloop.max_response_tokens."
        )
    buffer = config.rollout_buffer
    # a derived value above the buffer is harmless (the buffer binds first); a value the user chose is not
    is_inflight_chosen = buffer.max_inflight_groups != derived_inflight_groups(config)
    if is_inflight_chosen and buffer.max_inflight_groups > buffer.max_buffered_groups:
        raise ConfigError(
            f"rollout_buffer.max_inflight_groups={buffer.max_inflight_groups} is larger than "
            f"rollout_buffer.max_buffered_groups={buffer.max_buffered_groups}: in-flight groups count against the "
            "buffer, so the in-flight limit could never bind. Lower max_inflight_groups to at most "
            f"{buffer.max_buffered_groups}, or leave it unset to derive it."
        )
    num_trajectories = config.data.rollout_batch_size * algo.group_size
    if num_trajectories > MAX_TRAJECTORIES_PER_STEP:
        raise ConfigError(
            f"data.rollout_batch_size={config.data.rollout_batch_size} x algorithm.group_size={algo.group_size} "
            f"= {num_trajectories:,} trajectories a step, more than {MAX_TRAJECTORIES_PER_STEP:,}: one step's "
            "trajectories are held in memory together, so the run would run out of memory before its first "
            "step. Large recipes use a few thousand (e.g. 512 prompts x 16); lower either key."
        )
    if algo.n_minibatches > num_trajectories:
        raise ConfigError(
            f"algorithm.n_minibatches={algo.n_minibatches} is larger than the {num_trajectories} trajectories of "
            f"one step (data.rollout_batch_size {config.data.rollout_batch_size} x algorithm.group_size "
            f"{algo.group_size}): some minibatches would be empty. Set algorithm.n_minibatches <= "
            f"{num_trajectories}."
        )
    if algo.group_size < 2:
        raise ConfigError(
            f"algorithm.group_size={algo.group_size}: GRPO's advantage is a reward minus its group's mean, so "
            "with one trajectory per group every advantage is 0 and nothing is learned. Use "
            "algorithm.group_size >= 2 (e.g. 4)."
        )


def _validate_paths(config: TandemConfig) -> None:
    """Paths the run reads long after start-up, checked now (no torch: files and JSON only)."""
    # runner.resume_from is checked whole by commands/preflight.py (`check_resume`), before any service
    for key, path in (
        ("rollout.model.model_path", config.rollout.model.model_path),
        ("actor.model.model_path", config.actor.model.model_path),
    ):
        if path and not is_copied_model_path(config, key):
            check_model_dir(Path(path), key)


def is_copied_model_path(config: TandemConfig, key: str) -> bool:
    """Whether `key` (rollout or actor .model.model_path) holds the other one's value (`_derive_model_paths`):
    an error about that path names the key the user set."""
    return config.derived.get(key, "").endswith(
        ("(= rollout.model.model_path)", "(= actor.model.model_path)")
    )


def check_model_dir(path: Path, key: str) -> None:
    """A model directory that exists must be one: its config.json, when present, a JSON object naming
    a `model_type` (a broken one otherwise fails deep inside transformers with chained tracebacks)."""
    if path.exists() and not path.is_dir():
        raise ConfigError(
            f"{key}={str(path)!r} is a file, not a model directory. Point it at a Hugging Face model directory."
        )
    config_json = path / "config.json"
    if not config_json.is_file():
        return
    try:
        hf_config = json.loads(config_json.read_text(encoding="utf-8"))
    except (ValueError, OSError) as error:
        raise ConfigError(
            f"{key}={str(path)!r}: its config.json is not valid JSON ({error}). Re-export the model, or "
            "point the key at a Hugging Face model directory (e.g. from `tandem prepare model`)."
        ) from None
    if not isinstance(hf_config, dict) or not isinstance(hf_config.get("model_type"), str):
        raise ConfigError(
            f"{key}={str(path)!r}: its config.json has no model_type, so it is not a Hugging Face model "
            "config. Point the key at a Hugging Face model directory (e.g. from `tandem prepare model`)."
        )


def _readable_hf_config(model_dir: Path) -> dict:
    """The model's config.json as a dict; {} when there is none to read (check_model_dir and the loader
    name that)."""
    try:
        hf_config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return hf_config if isinstance(hf_config, dict) else {}


def check_context_len(config: TandemConfig, model_dir: Path) -> None:
    """`rollout.max_context_len` within what the served model allows (its config.json): past it the
    positions were never trained, and an absurd length sizes the engine's tables and KV cache by it (1e12
    tokens ran a 24 GiB machine out of memory at start-up)."""
    limit = model_context_limit(_readable_hf_config(model_dir))
    wanted = config.rollout.max_context_len
    if limit is not None and wanted > limit:
        raise ConfigError(
            f"rollout.max_context_len={wanted:,} is longer than the {limit:,} tokens the model at "
            f"{str(model_dir)!r} allows (its config.json's max_position_embeddings, with any RoPE scaling). "
            f"Set rollout.max_context_len <= {limit}."
        )


def check_logit_head(model_dir: Path) -> None:
    """The actor computes its logprobs from the last hidden state through its own chunked head
    (trainer/policy.py `head_logit_scale`), which has no tanh: a model whose forward soft-caps its
    logits (config.json `final_logit_softcapping`, Gemma 2) is refused here, before a service starts."""
    cap = _readable_hf_config(model_dir).get("final_logit_softcapping")
    if cap:
        raise ConfigError(
            f"the model at {str(model_dir)!r} soft-caps its logits (config.json final_logit_softcapping={cap}), "
            "and the actor's chunked logprob head (trainer/policy.py) applies no soft cap, so its logprobs "
            "would not be the model's. Choose a model without a final soft cap."
        )


def _warnings(config: TandemConfig) -> list[str]:
    warnings = []
    staleness = config.agentloop.max_actor_accept_staleness
    buffered, batch = config.rollout_buffer.max_buffered_groups, config.data.rollout_batch_size
    natural = math.ceil(buffered / batch)
    head = config.rollout_buffer.max_head_offpolicyness
    if staleness is not None and staleness < natural and (head is None or staleness < head):
        warnings.append(
            f"agentloop.max_actor_accept_staleness={staleness} is below ceil(max_buffered_groups {buffered} / "
            f"rollout_batch_size {batch}) = {natural}: groups that wait their turn in a full buffer will "
            "routinely be dropped as stale, wasting rollouts. Raise the staleness limit, lower "
            "rollout_buffer.max_buffered_groups, or bound admission with "
            f"rollout_buffer.max_head_offpolicyness <= {staleness}."
        )
    warnings += _ignored_keys(config)
    for warning in warnings:
        log.warning(warning)
    return warnings


def _ignored_keys(config: TandemConfig) -> list[str]:
    """Keys whose value nothing reads in this config: warned about, not refused (each is harmless)."""
    runner, cluster, retrieval = config.runner, config.cluster, config.retrieval
    ignored = []
    if runner.val_interval > runner.max_steps:
        ignored.append(
            f"runner.val_interval={runner.val_interval} is past runner.max_steps={runner.max_steps}: no "
            "validation runs during training. Lower it, or set runner.val_before_train=true for one at the start."
        )
    if cluster.mps_sm_percent and not runner.async_mode:
        ignored.append(
            f"cluster.mps_sm_percent={value_summary(cluster.mps_sm_percent)} with runner.async_mode=false: the "
            "sync runner never overlaps the actor and the engines, so each gets the whole GPU and the caps are "
            "ignored."
        )
    if not retrieval.launch and retrieval.index_dir is not None:
        ignored.append(
            f"retrieval.index_dir={retrieval.index_dir!r} with retrieval.launch=false: the run searches the "
            f"server at tools.search.server_addr={config.tools.search.server_addr} and opens no index. Remove "
            "it, or set retrieval.launch=true."
        )
    return ignored


def describe_derived(config: TandemConfig) -> list[str]:
    return [f"{key} derived: {how}" for key, how in config.derived.items()]
