"""A local Ray started by tandem listens on loopback only where Ray lets us choose (its runtime-env
agent), and its auth token is private to the user (docs/RELIABILITY.md lists what Ray does not let us
choose). Linux only, as the whole suite: 127.0.0.2 is loopback there without setup. Starting Ray
leaves the caller's SIGTERM handler in place (ray.init sets its own)."""

from __future__ import annotations

import ipaddress
import signal
import stat

import psutil

from tandemrl.config.loader import load_config


def test_local_ray_agent_on_loopback_and_token_private():
    import ray

    from tandemrl.cluster.ray_nodes import init_ray, shutdown_ray
    from tandemrl.cluster.ray_security import ray_token_path

    was_running = ray.is_initialized()
    if was_running:  # started by an earlier test of this process without our settings? restart it
        ray.shutdown()

    def ours(signum, frame):
        raise AssertionError("never called")

    previous = signal.signal(signal.SIGTERM, ours)
    try:
        init_ray(load_config(None))
        assert signal.getsignal(signal.SIGTERM) is ours, "ray.init's SIGTERM handler replaced the caller's"
    finally:
        signal.signal(signal.SIGTERM, previous)
    try:
        agents = [
            p
            for p in psutil.Process().children(recursive=True)
            if p.cmdline()[:1] and p.cmdline()[0].startswith("ray::RuntimeEnvAgent")
        ]
        assert agents, "no runtime-env agent found among Ray's processes"
        listening = [
            c.laddr.ip
            for p in agents
            for c in p.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        ]
        assert listening and all(ipaddress.ip_address(ip).is_loopback for ip in listening), listening
        token = ray_token_path()
        if token.exists():
            assert stat.S_IMODE(token.stat().st_mode) == 0o600
    finally:
        shutdown_ray()
