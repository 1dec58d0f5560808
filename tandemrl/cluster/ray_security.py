"""Local Ray, kept local: loopback addresses for a single-machine run and a private auth token.

Ray 2.x turns a "127.0.0.1" node address into the machine's routable one (so that other nodes could
reach it), and its runtime-env agent then listens on that address; an address elsewhere in 127/8
is loopback on Linux yet is used as given. Without an address Ray also joins whatever local
cluster it finds (another user's included); we always start our own. Ray writes `~/.ray/auth_token` with the default umask
(world-readable on most systems); any local user holding it can run code in the cluster. Invariant:
after `harden_local_ray()` the token file, when present, is readable by its owner only. What Ray does
not let us choose (its gRPC servers listen on every interface, token-protected) is listed in
docs/RELIABILITY.md.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

LOOPBACK_NODE_IP = "127.0.0.2"  # loopback on Linux, and not rewritten by Ray as 127.0.0.1 is


def local_ray_kwargs() -> dict:
    """Extra `ray.init` arguments for a Ray started by this process for this machine only. address
    "local": a new cluster of our own, never one another process or user left running on this machine
    (with no address, Ray joins the latest local cluster it finds, $RAY_ADDRESS first)."""
    kwargs = {"address": "local"}
    if sys.platform == "linux":
        kwargs["_node_ip_address"] = LOOPBACK_NODE_IP
    return kwargs


def ray_token_path() -> Path:
    return Path.home() / ".ray" / "auth_token"


def harden_local_ray() -> None:
    """Make Ray's auth token (and its folder) private to this user; a no-op when there is none."""
    token = ray_token_path()
    if not token.exists():
        return
    os.chmod(token.parent, stat.S_IRWXU)
    os.chmod(token, stat.S_IRUSR | stat.S_IWUSR)
