"""What `tandem train` refuses before it starts a service, in two levels.

`check_startable` (run by `tandem config show` and `tandem train`): `load_config` checks the keys and
their combinations; these checks need the machine: the engines tandem can launch (a launched vLLM or
SGLang server's interpreter imports its engine, rollout/engine_python.py), the MPS control
daemon `cluster.mps` needs, room for a local Ray's sockets under its temp dir, the model directories
this node reads (the driver loads the tokenizer from the model path, the actor its weights), the
optional tracker packages, and the plug-ins (`reward.function` and `tools.<name>.function` import;
the reward's dry call returns a finite number).
Files only, no torch. On a cluster (`cluster.num_nodes > 1`) model paths live on the nodes and are not
checked here, nor is `coldstart`, the model `tandem sft` is about to write.

`check_before_services` (run by `tandem train` after its placement plan, and by `tandem config show
--check`): every other check `train` makes before it starts anything: placeholder paths, an output
directory that can be one, the external engines of `rollout.server_addrs` accepting a connection, the
model directory the driver reads its tokenizer from (on node 0 also for a cluster) and the context its
config.json allows (`rollout.max_context_len`), the retrieval index a
launched server would open (its index.json), and every question file read whole (data/dataset.py).
Plain `config show` leaves these out on purpose: it shows a config for another machine (a cluster's paths) and the defaults,
and reading a large training set takes seconds.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from tandemrl.config.errors import ConfigError
from tandemrl.host.files import creatable_problem

if TYPE_CHECKING:
    from tandemrl.config.rollout import RolloutConfig
    from tandemrl.config.schema import TandemConfig


def check_startable(config: TandemConfig) -> None:
    """Raise ConfigError for what `tandem train` could not start with."""
    check_resume(config)
    from tandemrl.agent.tools import check_plugins
    from tandemrl.metrics.trackers import check_installed

    check_installed(config.metrics.trackers)  # the optional extras, with their install line
    # reward.function and tools.<name>.function import, and the reward's dry call
    check_plugins(config.agentloop, config.tools, config.reward)
    rollout = config.rollout
    if rollout.backend == "sglang" and not rollout.server_addrs and not config.cluster.use_ray:
        raise ConfigError(
            "rollout.backend=sglang with cluster.use_ray=false: tandem launches SGLang servers as Ray actors on "
            "their GPUs. Set cluster.use_ray=true, or start them yourself (rollout.server_addrs)."
        )
    _check_mps(config)
    _check_ray_temp_dir(config)
    if config.cluster.num_nodes > 1:
        return  # the engines' interpreters and the model paths live on the nodes
    _check_engine_imports(rollout)
    from tandemrl.config.derive import is_copied_model_path
    from tandemrl.host.home import default_coldstart_dir

    coldstart = str(default_coldstart_dir())
    for key, path in (
        ("rollout.model.model_path", rollout.model.model_path),
        ("actor.model.model_path", config.actor.model.model_path),
    ):
        if is_copied_model_path(config, key):  # the other key's value: the error names that one
            continue
        if path is not None and path != coldstart and not Path(path).is_dir():
            raise ConfigError(
                f"{key}={path!r} is not a directory. Run `tandem prepare model` for the embedded "
                "SmolLM2, or point it at a Hugging Face model directory."
            )


def check_resume(config: TandemConfig) -> None:
    """`runner.resume_from` is a tandemrl checkpoint whose every byte matches its manifest
    (trainer/checkpoint_check.py: files and pickles parsed, no torch), before any service starts."""
    resume_from = config.runner.resume_from
    if not resume_from:
        return
    from tandemrl.trainer.checkpoint_check import DATA_FILE, CheckpointError, verify_checkpoint

    state = Path(resume_from) / DATA_FILE
    if not state.exists() and not state.is_symlink():  # a link or a FIFO there: the check names it
        raise ConfigError(
            f"runner.resume_from={resume_from!r}: {state} does not exist, so this is not a tandemrl "
            "checkpoint directory. Point it at <output_dir>/checkpoints/global_step_N."
        )
    try:
        verify_checkpoint(resume_from, need_data=True)
    except CheckpointError as error:
        raise ConfigError(f"runner.resume_from={resume_from!r}: {error}") from None


def _check_engine_imports(rollout: RolloutConfig) -> None:
    """A launched vLLM or SGLang server runs `rollout.<backend>.python` with `.pythonpath`: that
    interpreter must import the engine (rollout/engine_python.py), on this node."""
    if rollout.server_addrs or rollout.backend not in ("vllm", "sglang"):
        return
    from tandemrl.rollout.engine_python import engine_import_message, import_error

    section = getattr(rollout, rollout.backend)
    said = import_error(rollout.backend, section.python, section.pythonpath)
    if said is not None:
        raise ConfigError(engine_import_message(rollout.backend, section.python, section.pythonpath, said))


def _check_ray_temp_dir(config: TandemConfig) -> None:
    """A Ray this run starts on its own machine binds Unix sockets under its temp dir, whose path has room for
    107 bytes only (a cluster's Ray was started by `ray start`, with its own)."""
    cluster = config.cluster
    if not cluster.use_ray or cluster.ray_address or cluster.num_nodes > 1:
        return
    from tandemrl.cluster.ray_nodes import local_ray_socket_problem

    problem = local_ray_socket_problem()
    if problem:
        raise ConfigError(problem)


def _check_mps(config: TandemConfig) -> None:
    """`cluster.mps` starts NVIDIA's MPS control daemon for the run; without it (no NVIDIA driver, so no
    GPU for MPS to share) or on CPU devices the key means nothing, and train would fail on it."""
    from tandemrl.cluster.mps import CONTROL

    if not config.cluster.mps:
        return
    cpu_only = [
        key
        for key, device in (("actor.device", config.actor.device), ("rollout.device", config.rollout.device))
        if device == "cpu"
    ]
    if len(cpu_only) == 2:
        raise ConfigError(
            "cluster.mps=true with actor.device=cpu and rollout.device=cpu: MPS lets processes share a GPU, "
            "and this run uses none. Set cluster.mps=false."
        )
    if shutil.which(CONTROL) is None:
        raise ConfigError(
            f"cluster.mps=true, but {CONTROL} is not on PATH here (it comes with the NVIDIA driver's "
            "utilities: this machine has no NVIDIA GPU for MPS to share, or its tools are not installed). Set "
            "cluster.mps=false, or install the driver's utilities."
        )


PLACEHOLDER_PREFIXES = ("/path/to/", "path/to/")


def check_before_services(config: TandemConfig) -> None:
    """Raise ConfigError for what `tandem train` would refuse before it starts a service (see above)."""
    from tandemrl.runner.services import index_dir, model_path

    _check_placeholders(config)
    _check_output_dir(config)
    _check_external_engines(config)
    if config.retrieval.launch:
        index_dir(config)
    if config.rollout.backend != "sglang" or config.rollout.model.model_path is not None:
        from tandemrl.config.derive import check_context_len, check_logit_head

        model_dir = Path(model_path(config))  # the driver's tokenizer, on this node; what the actor trains
        check_context_len(config, model_dir)
        check_logit_head(model_dir)
    _check_data_files(config)


ENGINE_CONNECT_TIMEOUT_S = 5.0


def _check_output_dir(config: TandemConfig) -> None:
    """`runner.output_dir` is a directory this user can write, or can become one (train creates and locks
    it, runner/output_lock.py; nothing is created here)."""
    path = config.runner.output_dir or "."
    problem = creatable_problem(path)
    if problem:
        raise ConfigError(
            f"runner.output_dir={str(path)!r} cannot be used: {problem}, so the run could not write there; "
            "give a directory this user can create and write."
        )


def _check_external_engines(config: TandemConfig) -> None:
    """Each engine in `rollout.server_addrs` accepts a connection: the run talks to them from its first
    step, after Ray and the actor have started, and an address nothing answers at is a typo or a server
    not started yet. A connection only (no request), so an engine that is busy still passes."""
    import socket

    for index, addr in enumerate(config.rollout.server_addrs):
        host, _, port = addr.removeprefix("http://").removeprefix("https://").rstrip("/").rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=ENGINE_CONNECT_TIMEOUT_S).close()
        except OSError as error:
            raise ConfigError(
                f"rollout.server_addrs[{index}]={addr!r}: nothing accepts a connection there "
                f"({error.strerror or error}). Start the {config.rollout.backend} server first, or fix the "
                "address (or leave rollout.server_addrs empty and let tandem launch the servers)."
            ) from None


def _check_placeholders(config: TandemConfig) -> None:
    keys = {
        "rollout.model.model_path": config.rollout.model.model_path,
        "actor.model.model_path": config.actor.model.model_path,
        "retrieval.index_dir": config.retrieval.index_dir,
        "retrieval.corpus_path": config.retrieval.corpus_path,
        "runner.resume_from": config.runner.resume_from,
    }
    for name in ("train_data_paths", "val_data_paths"):
        for index, path in enumerate(getattr(config.data, name)):
            keys[f"data.{name}[{index}]"] = path
    for key, value in keys.items():
        if isinstance(value, str) and (value.startswith(PLACEHOLDER_PREFIXES) or "<" in value):
            raise ConfigError(
                f"{key}={value!r} is a placeholder from an example config: replace it with the real path "
                "(set it in your copy of the config, or as an override KEY=PATH)."
            )


def _check_data_files(config: TandemConfig) -> None:
    """Every question file the run reads, read and checked whole (the driver reads them at start-up)."""
    from tandemrl.agent.evaluate import split_paths
    from tandemrl.data.loader import load_prompts

    splits = ["train"]
    if config.runner.val_interval or config.runner.val_before_train:
        splits.append("val")
    for split in splits:
        key = f"data.{split}_data_paths"
        try:
            load_prompts(split_paths(config.data, config.retrieval, split))
        except (ValueError, FileNotFoundError) as error:  # InputFileError is a ValueError
            message = " ".join(str(error).split())
            raise ConfigError(message if message.startswith(key) else f"{key}: {message}") from None
