"""The engine's kernel choices at start-up (`kernel_tuning.py` times the candidates), cached on disk under
`$TANDEM_HOME/cache/kernel_tuning/` so a second start on the same machine skips the timing (and the
compilation of the candidates it does not pick): the tuning times every decode attention candidate, every
prefill tiling and, per decode batch size, every split of the down projection, each in its own CUDA graph.

A result is filed under a key holding everything that decides it: the GPU, the torch, Triton and CUDA
versions, a hash of the kernels' sources, the tuned shapes and dtype, and the candidate lists.
Invariants: a cache file is written whole or not at all (a temporary file renamed over it); one that
cannot be read or parsed, whose key is not the one asked for, or whose result is not among today's
candidates is ignored with a warning and rewritten. `TANDEM_TUNING_CACHE=0` turns the cache off
(fresh timings every start, as the engine benchmarks want); `TANDEM_TUNING_CACHE_DIR` moves it.

Shipped choices: a fresh machine has no cache, and its first start pays the timing and the compilation
of every candidate. `tandemrl/engine/tuned/` holds choices made on known GPUs (`python -m
tandemrl.engine.tuning_cache ship` writes them from a machine's cache), keyed without the software
versions and the kernels' hash: any candidate computes the same result, so a choice made by an older
stack is still correct, only perhaps not the fastest. A local cache entry wins over a shipped one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandemrl.engine.attention_tiles import DECODE_CANDIDATES, PREFILL_CANDIDATES, DecodeConfig, PrefillConfig
from tandemrl.host.home import tandem_home
from tandemrl.host.startup import mark

if TYPE_CHECKING:
    import torch

    from tandemrl.engine.model import CausalLM

logger = logging.getLogger(__name__)

CACHE_ENV = "TANDEM_TUNING_CACHE"
CACHE_DIR_ENV = "TANDEM_TUNING_CACHE_DIR"
SHIPPED_DIR_ENV = "TANDEM_TUNED_DIR"
FORMAT = 1
KERNEL_SOURCES = ("kernel_tuning.py", "triton_attention.py", "triton_decode.py", "fast_layers.py")
SOFTWARE_KEYS = ("torch", "cuda", "triton", "kernels_sha256")  # what a shipped choice is not keyed by

# per process: lookups the local cache answered, the shipped choices answered, and the timing did
stats = {"hits": 0, "shipped": 0, "misses": 0}


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_DIR_ENV) or tandem_home() / "cache" / "kernel_tuning")


def shipped_dir() -> Path:
    return Path(os.environ.get(SHIPPED_DIR_ENV) or Path(__file__).parent / "tuned")


def portable(key: dict) -> dict:
    return {name: value for name, value in key.items() if name not in SOFTWARE_KEYS}


def is_enabled() -> bool:
    return os.environ.get(CACHE_ENV, "1") != "0"


def cache_path(kind: str, key: dict, folder: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return (folder or cache_dir()) / f"{kind}-{digest}.json"


def _read(path: Path, key: dict, decode: Callable[[Any], Any]) -> tuple[Any, dict] | None:
    """The cached (result, timings), or None when there is none or it cannot be used (warned)."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("key") != key:
            raise ValueError("it was written for another key or format")
        return decode(data["result"]), dict(data["timings"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        logger.warning("kernel tuning cache %s is unusable (%s); tuning again and rewriting it", path, error)
        return None


def _write(path: Path, key: dict, result: Any, timings: dict) -> None:
    body = json.dumps({"format": FORMAT, "key": key, "result": result, "timings": timings}, indent=1)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(body + "\n")
        os.replace(tmp, path)
    except OSError as error:  # a read-only home still serves: the next start tunes again
        logger.warning("kernel tuning cache %s not written: %r", path, error)


def cached(
    kind: str,
    key: dict,
    compute: Callable[[], tuple[Any, dict]],
    encode: Callable[[Any], Any] = lambda result: result,
    decode: Callable[[Any], Any] = lambda stored: stored,
) -> tuple[Any, dict, bool]:
    """`compute()`'s (result, timings) for `key`, from the cache when it holds them; returns (result,
    timings, whether the cache answered). `encode` makes the result JSON, `decode` undoes it and
    raises ValueError for a result it does not accept."""
    path = cache_path(kind, key)
    if is_enabled():
        found = _read(path, key, decode)
        if found is not None:
            stats["hits"] += 1
            return found[0], found[1], True
        general = portable(key)
        found = _read(cache_path(kind, general, shipped_dir()), general, decode)
        if found is not None:
            stats["shipped"] += 1
            logger.info("kernel tuning: %s choice shipped for this GPU and these shapes (%s)", kind, found[0])
            return found[0], found[1], True
    stats["misses"] += 1
    result, timings = compute()
    if is_enabled():
        _write(path, key, encode(result), timings)
    return result, timings, False


def environment_key(device: torch.device) -> dict:
    """What decides every timing besides the shapes: the GPU, the software stack, the kernels' code."""
    import torch
    import triton

    here = Path(__file__).parent
    sources = hashlib.sha256(b"".join((here / name).read_bytes() for name in KERNEL_SOURCES)).hexdigest()
    return {
        "gpu": torch.cuda.get_device_name(device),
        "capability": list(torch.cuda.get_device_capability(device)),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "kernels_sha256": sources[:20],
    }


def _config_codec(candidates: tuple) -> tuple[Callable, Callable]:
    """(encode, decode) of a kernel config dataclass that must be one of `candidates`."""
    by_fields = {json.dumps(asdict(c), sort_keys=True): c for c in candidates}

    def decode(stored: Any) -> Any:
        config = by_fields.get(json.dumps(stored, sort_keys=True))
        if config is None:
            raise ValueError(f"{stored!r} is not one of the candidates")
        return config

    return asdict, decode


def _splits_codec(batch_sizes: list[int], parts: tuple[int, ...]) -> tuple[Callable, Callable]:
    def decode(stored: Any) -> dict[int, int]:
        splits = {int(batch): int(num) for batch, num in stored.items()}
        if sorted(splits) != sorted(batch_sizes) or not set(splits.values()) <= set(parts):
            raise ValueError(f"{stored!r} does not cover batch sizes {batch_sizes} with parts {parts}")
        return splits

    return lambda splits: {str(batch): num for batch, num in splits.items()}, decode


@dataclass
class KernelChoices:
    decode_config: DecodeConfig
    decode_timings: dict[str, float]
    prefill_config: PrefillConfig
    prefill_timings: dict[str, float]
    down_splits: dict[int, int] = field(default_factory=dict)
    down_split_timings: dict[str, float] = field(default_factory=dict)
    from_cache: list[str] = field(default_factory=list)  # which of decode / prefill / down_split


def choose_kernels(
    model: CausalLM,
    kv_caches: list[torch.Tensor],
    max_batch: int,
    context_len: int,
    prefill_tokens: int,
    block_size: int,
    batch_sizes: list[int],
    split_k: bool,
) -> KernelChoices:
    """The fast runner's decode attention, prefill tiling and down-projection splits: each timed on
    these shapes (kernel_tuning.py), or read from the cache."""
    from tandemrl.engine import kernel_tuning as kt

    kv = kv_caches[0]
    base = {
        **environment_key(kv.device),
        "dtype": str(kv.dtype),
        "num_heads": model.cfg["num_heads"],
        "kv_heads_dim": list(kv.shape[2:]),
        "block_size": block_size,
    }
    shapes = {"batch": max_batch, "context_len": context_len, "layers": min(8, len(kv_caches))}
    key = {**base, **shapes, "candidates": [str(c) for c in DECODE_CANDIDATES]}
    num_heads = model.cfg["num_heads"]
    timed = partial(kt.tune_decode, kv_caches, num_heads, max_batch, context_len, block_size)
    decode, decode_timings, decode_hit = cached("decode", key, timed, *_config_codec(DECODE_CANDIDATES))
    mark(f"engine: decode attention {'read from cache' if decode_hit else 'tuned'}")
    key = {**base, "num_tokens": prefill_tokens, "prompt_len": context_len}
    key["candidates"] = [str(c) for c in PREFILL_CANDIDATES]
    timed = partial(kt.tune_prefill, kv, num_heads, prefill_tokens, context_len, block_size)
    prefill, prefill_timings, prefill_hit = cached("prefill", key, timed, *_config_codec(PREFILL_CANDIDATES))
    mark(f"engine: prefill attention {'read from cache' if prefill_hit else 'tuned'}")
    choices = KernelChoices(decode, decode_timings, prefill, prefill_timings)
    choices.from_cache = [n for n, hit in (("decode", decode_hit), ("prefill", prefill_hit)) if hit]
    layers = model.model.layers
    if not split_k or any(layer.mlp.down_proj.bias is not None for layer in layers):
        return choices
    weights = [layer.mlp.down_proj.weight for layer in layers]
    parts = (1, *kt.split_candidates(weights[0].shape[1]))
    key = {**base, "down_proj": list(weights[0].shape), "batch_sizes": batch_sizes, "parts": list(parts)}
    key["layers"] = min(8, len(weights))
    timed = partial(kt.tune_down_split, weights, layers[0].input_layernorm.weight, batch_sizes)
    splits, split_timings, split_hit = cached("down_split", key, timed, *_splits_codec(batch_sizes, parts))
    mark(f"engine: down-projection splits {'read from cache' if split_hit else 'tuned'}")
    choices.down_splits, choices.down_split_timings = splits, split_timings
    choices.from_cache += ["down_split"] if split_hit else []
    return choices


def ship(source: Path, target: Path) -> list[Path]:
    """Copy every usable cache file of `source` into `target` as a shipped choice (keyed without the
    software versions, which are kept beside the result as `tuned_with`); returns the files written."""
    written = []
    for path in sorted(source.glob("*.json")):
        try:
            data = json.loads(path.read_text())
            kind, key = path.name.split("-", 1)[0], data["key"]
            general = portable(key)
            body = {"format": FORMAT, "key": general, "result": data["result"], "timings": data["timings"]}
            body["tuned_with"] = {name: key[name] for name in SOFTWARE_KEYS if name in key}
        except (OSError, ValueError, KeyError, TypeError) as error:
            logger.warning("not shipping %s: %s", path, error)
            continue
        out = cache_path(kind, general, target)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
        written.append(out)
    return written


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="ship this machine's kernel choices with the package")
    parser.add_argument("action", choices=["ship"])
    parser.add_argument(
        "--from", dest="source", default=None, help="a cache folder (default: this machine's)"
    )
    parser.add_argument("--to", dest="target", default=None, help="default: tandemrl/engine/tuned")
    args = parser.parse_args(argv)
    source = Path(args.source) if args.source else cache_dir()
    written = ship(source, Path(args.target) if args.target else shipped_dir())
    print(f"shipped {len(written)} kernel choice(s) from {source}: " + ", ".join(p.name for p in written))
    return 0 if written else 1


if __name__ == "__main__":
    raise SystemExit(main())
