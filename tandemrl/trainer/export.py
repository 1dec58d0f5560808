"""`tandem export CHECKPOINT --out DIR`: a checkpoint's policy as a Hugging Face model directory.

Weights are written in float32 (the actor's master precision): a bf16 export would round away updates
smaller than bf16's resolution, which at RL learning rates are most of them.
Invariant: the exported directory loads with `AutoModelForCausalLM.from_pretrained` and its weights
equal the actor's full (unsharded) weights at the checkpoint. The weights are written as they arrive, one
safetensors shard (`SHARD_BYTES`) at a time, so no process holds the whole model: the actor's ranks gather
one tensor at a time and only rank 0 keeps it, until its shard is written. It is written beside its place and moved
in whole: an export that fails or is interrupted leaves the model that was there before. Since the move replaces
the directory whole, it replaces only one that holds nothing but what an export writes (`EXPORT_FILES`, the
shards and their index); any other file there is refused before anything is loaded, and so is an `--out`
inside the checkpoint being exported (a file the save did not write makes the checkpoint refused for resume).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch

from tandemrl.host.files import creatable_problem, foreign_entries

log = logging.getLogger(__name__)

SHARD_BYTES = 2 * 2**30  # fp32 bytes of one safetensors file of an export, held on the host while it fills
# what `_write_hf_dir` writes (and `save_pretrained`'s names for the same): an export replaces only these
EXPORT_FILES = frozenset(
    {"config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json"}
)
SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def save_hf_dir(
    weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    hf_config,
    tokenizer_dir: str | Path | None,
    out_dir: str | Path,
) -> Path:
    """Write the HF model of `hf_config` with `weights` (HF names; a mapping, or (name, tensor) pairs that
    are streamed: at most `SHARD_BYTES` of them are held at once) and the tokenizer files. The pairs are
    always consumed to the end, even when writing fails, so ranks that feed them in lockstep (all-gathers)
    never wait on one that stopped."""
    named = iter(weights.items() if isinstance(weights, Mapping) else weights)
    try:
        out = check_replaceable(Path(out_dir))
        staging = out.with_name(f".{out.name}.writing-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        try:
            _write_hf_dir(named, hf_config, tokenizer_dir, staging)
            _swap_in(staging, out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    finally:
        for _ in named:  # drained: see the docstring
            pass
    return out


def check_replaceable(out: Path) -> Path:
    """`out` when an export may replace it: new, empty, or a directory of only what an export writes (a file,
    or a folder holding anything else, is never replaced: it would be lost)."""
    try:
        is_dir = out.is_dir()
        exists = is_dir or out.exists()
    except (OSError, ValueError) as error:  # a name too long, a NUL byte
        raise FileExistsError(f"{out}: cannot be used as the export's directory ({error}).") from None
    if exists and not is_dir:
        raise FileExistsError(f"{out}: exists and is not a directory; cannot write a model there.")
    _check_place(out)
    if not is_dir:
        return out
    foreign = foreign_entries(out, _is_export_file)
    if foreign:
        raise FileExistsError(
            f"{out}: holds files an export does not write ({foreign}); the "
            "export replaces its directory whole, so they would be lost. Give a new or empty directory, or "
            "move them out."
        )
    return out


def _is_export_file(name: str) -> bool:
    from tandemrl.trainer.checkpoint import TOKENIZER_FILES

    return name in EXPORT_FILES or name in TOKENIZER_FILES or SHARD_NAME.fullmatch(name) is not None


def _check_place(out: Path) -> None:
    """`out` can be written beside and renamed: a folder of its own, not the current directory or one
    holding it, under a folder rather than a file."""
    try:
        resolved, cwd = out.resolve(), Path.cwd().resolve()
    except (OSError, RuntimeError) as error:  # a symlink loop, a removed current directory
        raise FileExistsError(f"{out}: cannot be resolved ({error}); give another directory.") from None
    if out.name in ("", ".", "..") or resolved == cwd or resolved in cwd.parents:
        raise FileExistsError(
            f"{str(out)!r}: is the current directory or holds it, which an export cannot replace (it writes "
            "beside the directory and moves it in). Give a new or empty directory, e.g. exported/model."
        )
    problem = creatable_problem(out.parent)  # the export writes beside `out`, then moves it in
    if problem:
        raise FileExistsError(f"{out}: {problem}. Give a directory under one you can write to.")


def check_outside_checkpoint(out: Path, ckpt: Path) -> None:
    """Refuse an `out` inside the checkpoint (or holding it): the export would change the checkpoint."""
    try:
        out_path, ckpt_path = out.resolve(), ckpt.resolve()
    except (OSError, RuntimeError):  # a symlink loop: named by the checks that follow
        return
    if out_path == ckpt_path or ckpt_path in out_path.parents or out_path in ckpt_path.parents:
        where = "is" if out_path == ckpt_path else "holds" if out_path in ckpt_path.parents else "is inside"
        raise FileExistsError(
            f"--out {out} {where} the checkpoint {ckpt} being exported; writing there would change the "
            "checkpoint (a resume refuses files its save did not write). Give a directory outside it."
        )


def _swap_in(staging: Path, out: Path) -> None:
    """Put the finished `staging` directory at `out`, the old `out` kept until the new one is in place."""
    previous = out.with_name(f".{out.name}.previous-{os.getpid()}")
    check_replaceable(out)  # again: something may have been put there while the weights were written
    if out.exists():
        os.replace(out, previous)
    try:
        os.replace(staging, out)
    except BaseException:
        if previous.exists() and not out.exists():
            os.replace(previous, out)
        raise
    shutil.rmtree(previous, ignore_errors=True)


def _write_hf_dir(
    named: Iterator[tuple[str, torch.Tensor]], hf_config, tokenizer_dir: str | Path | None, out: Path
) -> None:
    """Safetensors shards of about SHARD_BYTES as the pairs arrive (fp32, on the host), their index, the
    config and generation config as `save_pretrained` writes them, and the tokenizer files."""
    from transformers import AutoModelForCausalLM

    from tandemrl.trainer.checkpoint import TOKENIZER_FILES

    out.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):  # the names and shapes the config makes, and its ties: no memory
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    seen: set[str] = set()
    shard: dict[str, torch.Tensor] = {}  # filling; emptied as each shard is written
    written: list[list[str]] = []  # the names in each shard written, in order
    size, total = 0, 0

    def write_shard() -> None:
        written.append(list(shard))
        _save_shard(shard, out / f"shard-{len(written)}.safetensors")

    for name, tensor in named:
        if name not in shapes or tuple(tensor.shape) != shapes[name]:
            raise ValueError(
                f"export: {name} of shape {list(tensor.shape)} is not in the model config "
                f"(it has {list(shapes[name]) if name in shapes else 'no such tensor'}); the checkpoint and its "
                "actor/hf/config.json disagree."
            )
        seen.add(name)
        shard[name] = tensor.detach().to("cpu", torch.float32).contiguous()
        size += tensor.numel() * 4
        if size >= SHARD_BYTES:
            write_shard()
            total, size = total + size, 0
    tied = {"lm_head.weight"} if getattr(hf_config, "tie_word_embeddings", False) else set()
    missing = set(shapes) - seen - tied
    if missing:
        raise ValueError(
            f"export: the weights lack {sorted(missing)[:5]} of the model config; the checkpoint and its "
            "actor/hf/config.json disagree."
        )
    if shard:
        write_shard()
        total += size
    _name_shards(out, written, total)
    model.config.dtype = torch.float32
    model.config.save_pretrained(out)
    if model.can_generate():
        model.generation_config.save_pretrained(out)
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copy2(Path(tokenizer_dir) / name, out / name)


def _save_shard(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, path, metadata={"format": "pt"})
    tensors.clear()  # written: the host lets them go


def _name_shards(out: Path, written: list[list[str]], total_bytes: int) -> None:
    """HF's names for the shards `shard-i` (`written[i - 1]` their tensors): one `model.safetensors`, or
    `model-0000i-of-0000n.safetensors` and their index."""
    if len(written) == 1:
        os.replace(out / "shard-1.safetensors", out / "model.safetensors")
        return
    weight_map = {}
    for index, names in enumerate(written, start=1):
        final = f"model-{index:05d}-of-{len(written):05d}.safetensors"
        weight_map.update(dict.fromkeys(names, final))
        os.replace(out / f"shard-{index}.safetensors", out / final)
    index_body = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index_body, indent=2) + "\n")


def load_checkpoint_weights(ckpt_dir: str | Path) -> tuple[dict[str, torch.Tensor], object]:
    """Full HF-named weights and the HF config of an actor checkpoint, in this process (no ranks needed)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tandemrl.trainer.checkpoint import dcp_load
    from tandemrl.trainer.checkpoint_check import CheckpointError, verify_checkpoint
    from tandemrl.trainer.policy import PolicyModel

    actor_dir = Path(ckpt_dir) / "actor"
    check_is_checkpoint(ckpt_dir)
    verify_checkpoint(ckpt_dir, need_data=False)  # whole and safe, before anything is unpickled
    config_path = actor_dir / "hf" / "config.json"
    try:
        hf_config = AutoConfig.from_pretrained(actor_dir / "hf")
        with torch.device("meta"):  # shapes only: a config of absurd sizes allocates nothing
            skeleton = PolicyModel(AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32))
    except Exception as error:  # transformers fails on a bad config in many ways, all of them the file's
        raise CheckpointError(
            f"{config_path} does not describe a model transformers can build ({type(error).__name__}: "
            f"{str(error).splitlines()[0][:200] if str(error) else ''}). Refused; export with the config.json "
            "written at save."
        ) from None
    _check_config_matches_weights(
        {f"model.{k}": tuple(v.shape) for k, v in skeleton.state_dict().items()}, actor_dir
    )
    policy = PolicyModel(AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32))
    state = {"model": policy.state_dict()}
    dcp_load(state, actor_dir)
    policy.load_state_dict(state["model"])
    weights = {name: p.detach() for name, p in policy.hf.named_parameters()}
    return weights, hf_config


def _check_config_matches_weights(expected: dict[str, tuple], actor_dir: Path) -> None:
    """The model `actor/hf/config.json` builds has exactly the tensors, of the same shapes, that the
    checkpoint's weights hold (CheckpointError naming the first difference otherwise)."""
    from tandemrl.trainer.checkpoint_check import CheckpointError, load_dcp_metadata

    with open(actor_dir / ".metadata", "rb") as handle:
        metadata = load_dcp_metadata(handle, str(actor_dir / ".metadata"))
    saved = {
        fqn: tuple(meta.size)
        for fqn, meta in metadata.state_dict_metadata.items()
        if fqn.startswith("model.") and hasattr(meta, "size")
    }
    problems = [f"{k.removeprefix('model.')} is missing from the weights" for k in expected if k not in saved]
    problems += [
        f"{k.removeprefix('model.')} is in the weights but not in the model"
        for k in saved
        if k not in expected
    ]
    problems += [
        f"{k.removeprefix('model.')} is {list(saved[k])} in the weights but {list(shape)} by the config"
        for k, shape in expected.items()
        if k in saved and saved[k] != shape
    ]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(
            f"{actor_dir / 'hf' / 'config.json'} disagrees with the checkpoint's weights: {problems[0]}{more}. "
            "Refused; export with the config.json written at save."
        )


def check_is_checkpoint(ckpt_dir: str | Path) -> None:
    """FileNotFoundError unless `ckpt_dir` looks like an actor checkpoint (its `actor/hf/config.json`);
    `verify_checkpoint` checks the rest before anything is read."""
    if not (Path(ckpt_dir) / "actor" / "hf" / "config.json").is_file():
        raise FileNotFoundError(
            f"{str(ckpt_dir)!r} is not an actor checkpoint (no actor/hf/config.json). Pass "
            "a global_step_N directory, e.g. runs/<name>/checkpoints/global_step_10."
        )


def run_export(args) -> int:
    from tandemrl.trainer.checkpoint_check import CheckpointError

    ckpt = Path(args.checkpoint)
    check_is_checkpoint(ckpt)  # first: a wrong source is named as such, whatever --out is
    check_outside_checkpoint(Path(args.out), ckpt)  # before the weights are loaded
    check_replaceable(Path(args.out))
    try:
        weights, hf_config = load_checkpoint_weights(ckpt)
    except CheckpointError as error:
        print(f"tandem export: {error}", file=sys.stderr)
        return 2
    out = save_hf_dir(weights, hf_config, ckpt / "actor" / "hf", args.out)
    log.info("exported %s -> %s (%d tensors, float32)", ckpt, out, len(weights))
    print(f"exported {ckpt} -> {out}")
    return 0
