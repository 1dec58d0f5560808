"""A vLLM worker extension (`vllm serve --worker-extension-cls tandemrl.rollout.vllm_worker.WeightLoader`):
the method the vLLM backend calls through POST /collective_rpc to take new weights.

It is vLLM's own `reload_weights` (layer by layer onto fresh parameters, then each layer's weight
processing, e.g. the CPU backend's repacking of linear weights) followed by re-tying a tied output
head: the reload rebuilds `lm_head` as a parameter of its own and skips it (tied checkpoints have no
`lm_head.weight`), so without the re-tie the head keeps the old embedding and greedy output no longer
matches the trainer's (seen with SmolLM2, which ties them); the head's weight processing then runs
again, since on CPU it packs a copy of the weight. Invariant: after the call the model holds
the directory's weights and a tied head is the embedding tensor itself.
"""

from __future__ import annotations

from pathlib import Path


class WeightLoader:
    """Mixed into vLLM's worker class (`self` is the worker)."""

    def tandem_load_safetensors(self, path: str) -> bool:
        if not any(Path(path).glob("*.safetensors")):
            raise FileNotFoundError(f"{path!r} holds no *.safetensors file")
        self.reload_weights(weights_path=path, is_checkpoint_format=True)
        model = self.model_runner.get_model()
        tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
        head, inner = getattr(model, "lm_head", None), getattr(model, "model", None)
        embed = getattr(inner, "embed_tokens", None)
        if tied and head is not None and embed is not None:
            head.weight = embed.weight
            # the head's GEMM was prepared from the old tensor (on CPU: a packed copy); prepare it again
            head.quant_method.process_weights_after_loading(head)
        return bool(tied)
