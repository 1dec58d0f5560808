"""Loading Hugging Face models the same way on every transformers release we meet.

transformers >= 5.2x loads with `use_kernels=True` by default when the `kernels` package is installed (it
is a dependency of transformers itself now): `.train()` and `.eval()` then swap layers' forwards for
kernels fetched from the Hub. That would download code at run time (our machines reach no hub), change
the arithmetic between two installs of the same pin, and undo the actor's own layer patches
(trainer/policy.py `fuse_rms_norms`). Every `from_pretrained` of a model in tandemrl and benchmarks/
passes `hf_load_kwargs()`.
"""

from __future__ import annotations


def hf_load_kwargs() -> dict:
    """`from_pretrained` keywords that keep HF's own layers: `use_kernels=False` where the installed
    transformers knows the flag (older releases have no Hub kernels and would store it on the config)."""
    from transformers import PreTrainedModel

    return {"use_kernels": False} if hasattr(PreTrainedModel, "set_use_kernels") else {}
