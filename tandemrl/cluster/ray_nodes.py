"""Ray start-up and the map from tandem's node ranks to Ray nodes, checked against the placement plan.

Node ranks: the driver's node (the head, where `tandem train` runs) is node 0 unless
`TANDEM_NODE_RANK` says otherwise; every other node takes the `TANDEM_NODE_RANK` it was started with
(`TANDEM_NODE_RANK=1 ray start --address=...`, read by a probe task on that node, since Ray workers
inherit the raylet's environment; RLinf's `RLINF_NODE_RANK` is an alias); nodes without one fill the
free ranks in Ray's node order.

Invariant: `NodeMap` holds exactly `cluster.num_nodes` ranks, each a live Ray node with at least
the GPUs (`cluster.gpu_resource`) the plan puts there, or construction raises `ConfigError` saying
what Ray reported. Bundles are pinned to their node with the `ray.io/node-id` label selector.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandemrl.cluster.reaper import note_ray_session
from tandemrl.config.schema import ConfigError

if TYPE_CHECKING:
    from tandemrl.cluster.placement import PlacementPlan
    from tandemrl.config.schema import TandemConfig

log = logging.getLogger(__name__)

NODE_RANK_ENV = "TANDEM_NODE_RANK"
RLINF_NODE_RANK_ENV = "RLINF_NODE_RANK"  # an alias: RLinf's name for the same thing
NODE_ID_LABEL = "ray.io/node-id"


_started_here: list[bool] = []  # whether init_ray connected this process (then shutdown_ray disconnects it)


def init_ray(config: TandemConfig) -> None:
    from tandemrl.host.startup import mark

    mark("ray import and init started", once=True)
    import ray

    if ray.is_initialized():
        return
    _started_here.append(True)
    # ray.init makes SIGTERM a bare sys.exit in the main thread; give back the handler the caller set
    # (`tandem train`'s stops the run as Ctrl-C does: exit 130, one line; commands/train.py)
    caller_sigterm = (
        signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    )
    try:
        _connect(config)
    finally:
        if caller_sigterm is not None:
            signal.signal(signal.SIGTERM, caller_sigterm)
    mark("ray initialized")


# Ray's longest socket of a local start: <ray temp dir>/session_<date>_<time>_<microseconds>_<pid>/sockets/
# plasma_store, under Linux's AF_UNIX limit of 107 bytes (ray._private.utils.validate_socket_filepath).
# Ray's temp dir is $RAY_TMPDIR/ray, else $TMPDIR/ray on Linux, else /tmp/ray (get_default_ray_temp_dir).
_SESSION_SOCKET = "session_2026-12-07_06-22-17_832341_4194304/sockets/plasma_store"  # the widest pid
AF_UNIX_MAX_BYTES = 107


def local_ray_socket_problem(environ: dict[str, str] | None = None) -> str | None:
    """Why a local `ray.init` would fail to bind its sockets under this environment's temp dir, or None.
    Ray itself says it only after it began starting, in a traceback."""
    env = os.environ if environ is None else environ
    name, base = next(((k, env[k]) for k in ("RAY_TMPDIR", "TMPDIR") if env.get(k)), ("", "/tmp"))
    longest = os.path.join(base, "ray", _SESSION_SOCKET)
    if len(longest.encode()) <= AF_UNIX_MAX_BYTES:
        return None
    return (
        f"{name}={base!r} is too long for Ray: its sockets would lie at {longest} "
        f"({len(longest.encode())} bytes, and a Unix socket path may have {AF_UNIX_MAX_BYTES}). "
        f"Set RAY_TMPDIR to a directory of at most {AF_UNIX_MAX_BYTES - len(longest) + len(base)} characters "
        "(RAY_TMPDIR=/tmp), or cluster.use_ray=false."
    )


def _connect(config: TandemConfig) -> None:
    import ray

    address = config.cluster.ray_address or ("auto" if config.cluster.num_nodes > 1 else None)
    runtime_env = pinned_package_env()
    if address:  # join the cluster started by `ray start` on every node
        ray.init(address=address, include_dashboard=False, log_to_driver=True, runtime_env=runtime_env)
    else:  # local Ray: this machine only, bound to loopback, its token private
        from tandemrl.cluster.ray_security import harden_local_ray, local_ray_kwargs

        harden_local_ray()  # a token left by an earlier run
        ray.init(
            num_cpus=max(2, os.cpu_count() or 2),
            include_dashboard=False,
            log_to_driver=True,
            runtime_env=runtime_env,
            **local_ray_kwargs(),
        )
        harden_local_ray()  # the token this start may have written
        note_ray_session(_session_dir())  # the reaper ends this session's agents after a kill -9


# Ray puts the driver's working directory first on every worker's sys.path (its `py_driver_sys_path`),
# so a `tandemrl` folder there (another checkout) would be what the workers import. Each worker runs
# this before its first task: it imports `tandemrl` from the driver's package directory, after which
# `tandemrl.*` resolves through that package whatever sys.path says. It is compiled outside any
# importable module so that Ray ships it by value (a function of tandemrl would be imported by name,
# from the very directory it is meant to avoid).
_PIN_SOURCE = """
def pin_tandemrl(root=ROOT):
    import importlib.machinery, importlib.util, os, sys

    loaded = sys.modules.get("tandemrl")
    if loaded is not None and os.path.dirname(os.path.dirname(loaded.__file__ or "")) == root:
        return
    spec = importlib.machinery.PathFinder.find_spec("tandemrl", [root])
    if spec is None:  # no such directory on this node: Ray's own search order stands
        return
    for name in [m for m in sys.modules if m == "tandemrl" or m.startswith("tandemrl.")]:
        del sys.modules[name]
    module = importlib.util.module_from_spec(spec)
    sys.modules["tandemrl"] = module
    spec.loader.exec_module(module)
"""


def pinned_package_env() -> dict:
    """The job's runtime_env: every worker imports the `tandemrl` the driver imported (see above)."""
    import tandemrl

    root = os.path.dirname(os.path.dirname(os.path.abspath(tandemrl.__file__)))
    namespace: dict = {"__name__": "tandem_ray_worker_setup", "ROOT": root}
    exec(compile(_PIN_SOURCE, "<tandem ray worker setup>", "exec"), namespace)
    return {"worker_process_setup_hook": namespace["pin_tandemrl"]}


def _session_dir() -> str | None:
    """The session directory of the Ray this process started (Ray has no public call for it)."""
    import ray

    try:
        return ray._private.worker._global_node.get_session_dir_path()
    except AttributeError:
        return None


def shutdown_ray() -> None:
    """Disconnect (and stop a local Ray) only if `init_ray` connected: a caller's own Ray stays up."""
    if _started_here:
        import ray

        _started_here.clear()
        ray.shutdown()


@dataclass
class NodeInfo:
    rank: int
    node_id: str
    address: str  # the IP other nodes reach it at
    num_gpus: float


class NodeMap:
    def __init__(self, config: TandemConfig, plan: PlacementPlan):
        import ray

        self.gpu_resource = config.cluster.gpu_resource
        self.num_nodes = config.cluster.num_nodes
        alive = [n for n in ray.nodes() if n.get("Alive")]
        if len(alive) < config.cluster.num_nodes:
            raise ConfigError(
                f"cluster.num_nodes={config.cluster.num_nodes} but Ray reports {len(alive)} live node(s). Start "
                "Ray on every node first (`ray start --head` here, `TANDEM_NODE_RANK=<rank> ray start "
                "--address=<head>:6379` on the others), or lower cluster.num_nodes."
            )
        driver_node = ray.get_runtime_context().get_node_id()
        ranks = (
            _probe_ranks([n["NodeID"] for n in alive], driver_node) if len(alive) > 1 else {driver_node: 0}
        )
        self.nodes = [
            NodeInfo(rank, n["NodeID"], n["NodeManagerAddress"], n["Resources"].get(self.gpu_resource, 0.0))
            for n in alive
            for rank in [ranks.get(n["NodeID"])]
            if rank is not None and rank < config.cluster.num_nodes
        ]
        self.nodes.sort(key=lambda info: info.rank)
        self._check(config, plan)

    def _check(self, config: TandemConfig, plan: PlacementPlan) -> None:
        if [info.rank for info in self.nodes] != list(range(config.cluster.num_nodes)):
            raise ConfigError(
                f"Ray's nodes got ranks {[info.rank for info in self.nodes]}, not 0-{config.cluster.num_nodes - 1}: "
                f"give each node a distinct {NODE_RANK_ENV} when running `ray start` on it."
            )
        needed: dict[int, int] = {}
        for process in plan.actor + plan.engines:
            needed[process.node] = max(needed.get(process.node, 0), max(process.gpus, default=-1) + 1)
        for node, num_gpus in needed.items():
            have = self.nodes[node].num_gpus
            if num_gpus and have < num_gpus:
                raise ConfigError(
                    f"the placement puts GPUs 0-{num_gpus - 1} on node {node} ({self.nodes[node].address}), but "
                    f"Ray reports {have:g} {self.gpu_resource} there. Check cluster.component_placement and "
                    "cluster.num_gpus_per_node against the machines (`ray status`)."
                )

    def __getitem__(self, rank: int) -> NodeInfo:
        return self.nodes[rank]

    def pinned_bundles(self, nodes: list[int], gpus: list[float]) -> tuple[list[dict], list[dict]]:
        """Bundles (one per process: a CPU and its GPUs) and their label selectors pinning each to its node."""
        bundles = [{"CPU": 1, **({self.gpu_resource: g} if g else {})} for g in gpus]
        selectors = [{NODE_ID_LABEL: self.nodes[node].node_id} for node in nodes]
        return bundles, selectors

    def remote_options(self, num_gpus: float) -> dict:
        """`ray.remote` options asking for `num_gpus` of the GPU resource (Ray sets CUDA_VISIBLE_DEVICES
        only for its own GPU resource; a custom one stands in for GPUs in CPU tests)."""
        if self.gpu_resource == "GPU":
            return {"num_cpus": 1, "num_gpus": num_gpus}
        return {"num_cpus": 1, "num_gpus": 0, "resources": {self.gpu_resource: num_gpus} if num_gpus else {}}


def _node_rank_from_env() -> str | None:
    """This node's rank: TANDEM_NODE_RANK, or RLinf's RLINF_NODE_RANK (the seed's users start Ray with it);
    both set and different: "<a> vs <b>", which the driver refuses."""
    tandem, rlinf = os.environ.get(NODE_RANK_ENV), os.environ.get(RLINF_NODE_RANK_ENV)
    if tandem is not None and rlinf is not None and tandem.strip() != rlinf.strip():
        return f"{tandem} vs {rlinf}"
    return tandem if tandem is not None else rlinf


def _probe_ranks(node_ids: list[str], driver_node: str) -> dict[str, int]:
    """Ask each node for the TANDEM_NODE_RANK (or RLINF_NODE_RANK) its raylet was started with."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    probe = ray.remote(num_cpus=0)(_node_rank_from_env)
    answers = ray.get(
        [
            probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
            for node_id in node_ids
        ]
    )
    ranks: dict[str, int] = {}
    for node_id, answer in zip(node_ids, answers, strict=True):
        if answer is not None and " vs " in answer:
            raise ConfigError(
                f"a Ray node was started with {NODE_RANK_ENV} and {RLINF_NODE_RANK_ENV} that differ "
                f"({answer.replace(' vs ', ' and ')}): they name the same rank. Restart Ray there with one of them."
            )
        if answer is not None:
            try:
                ranks[node_id] = int(answer)
            except ValueError as error:
                raise ConfigError(f"{NODE_RANK_ENV}={answer!r} on a Ray node is not an integer.") from error
    if driver_node not in ranks and 0 not in ranks.values():
        ranks[driver_node] = 0
    free = (rank for rank in range(len(node_ids)) if rank not in ranks.values())
    for node_id in node_ids:
        if node_id not in ranks:
            ranks[node_id] = next(free)
    log.info("node ranks: %s", ", ".join(f"{rank}={node_id[:8]}" for node_id, rank in sorted(ranks.items())))
    return ranks
