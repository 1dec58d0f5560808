"""Our own Llama / Qwen2 / Qwen3 decoder for the engine, parameter names identical to Hugging Face's.

The forward pass works on a flat batch of tokens (all sequences of a step concatenated) and delegates
attention to `attention.paged_attention`, which reads and writes the paged KV cache. Invariant: every
parameter is named exactly as in the HF checkpoint (`model.layers.3.self_attn.q_proj.weight`, ...), so
weights load from safetensors and weight updates from the trainer's `state_dict()` without renaming.
Biases and the Qwen3 q/k norms are created when the checkpoint has them, which covers Llama (optional
attention/MLP bias), Qwen2 (qkv bias) and Qwen3 (q/k RMSNorm, explicit head_dim).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from tandemrl.engine.attention import AttentionMetadata, paged_attention
from tandemrl.engine.rope import RotaryEmbedding

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


class RMSNorm(nn.Module):
    """HF's RMSNorm numerics: normalise in fp32, cast back, then scale."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: dict, layer_idx: int, keys: set[str]):
        super().__init__()
        prefix = f"model.layers.{layer_idx}.self_attn."
        hidden, self.num_heads, self.num_kv_heads = cfg["hidden_size"], cfg["num_heads"], cfg["num_kv_heads"]
        self.head_dim, self.layer_idx = cfg["head_dim"], layer_idx
        has_bias = {p: f"{prefix}{p}.bias" in keys for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=has_bias["q_proj"])
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=has_bias["k_proj"])
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=has_bias["v_proj"])
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=has_bias["o_proj"])
        self.has_qk_norm = f"{prefix}q_norm.weight" in keys
        if self.has_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg["rms_norm_eps"])
            self.k_norm = RMSNorm(self.head_dim, cfg["rms_norm_eps"])

    def forward(
        self,
        x_TD: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        rope: RotaryEmbedding,
    ) -> torch.Tensor:
        num_tokens = x_TD.shape[0]
        q = self.q_proj(x_TD).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x_TD).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x_TD).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.has_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope.apply(q, k, *cos_sin)
        out = paged_attention(q, k, v, kv_cache, meta, scale=self.head_dim**-0.5)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: dict, layer_idx: int, keys: set[str]):
        super().__init__()
        bias = f"model.layers.{layer_idx}.mlp.gate_proj.bias" in keys
        hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: dict, layer_idx: int, keys: set[str]):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx, keys)
        self.mlp = MLP(cfg, layer_idx, keys)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])

    def forward(self, x, cos_sin, kv_cache, meta, rope):
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta, rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: dict, keys: set[str]):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, keys) for i in range(cfg["num_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])


class CausalLM(nn.Module):
    """Decoder-only LM; `forward` returns the logits of the last token of each sequence (fp32)."""

    def __init__(self, cfg: dict, keys: set[str], hf_config):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg, keys)
        self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        if cfg["tie_word_embeddings"]:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = RotaryEmbedding(hf_config, cfg["head_dim"])

    def forward(
        self,
        input_ids_T: torch.Tensor,
        positions_T: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids_T)
        cos_sin = self.rope.cos_sin(positions_T, x.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos_sin, kv_cache, meta, self.rope)
        last = self.model.norm(x[meta.last_token_index])
        return self.lm_head(last).float()

    @torch.no_grad()
    def load_weights(self, named_tensors) -> list[str]:
        """Copy HF-named tensors into the parameters; returns the names loaded. All or nothing: every
        name, shape, dtype and value is checked before the first copy, so a refused update (unknown
        name, a name given twice, wrong shape, NaN) leaves every weight as it was."""
        staged = self.check_weights(named_tensors)
        for param, tensor in staged.values():
            param.copy_(tensor.to(device=param.device, dtype=param.dtype))
        return list(staged)

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name -> shape of every parameter: what an announced update is checked against."""
        return {name: tuple(p.shape) for name, p in self.named_parameters(remove_duplicate=False)}

    def check_weights(self, named_tensors) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """name -> (parameter, new tensor) for every tensor of an update; raises ValueError naming the
        first bad one (unknown name, wrong shape, not floating point, non-finite values)."""
        params = dict(self.named_parameters(remove_duplicate=False))
        staged = {}
        for name, tensor in named_tensors:
            if name in staged:
                raise ValueError(
                    f"weight {name!r} appears twice in one update (which copy should win?); send each weight "
                    "once. No weight was changed"
                )
            if name not in params:
                raise ValueError(
                    f"weight {name!r} is not a parameter of this {self.cfg['model_type']} model; "
                    "weight updates must use the HF parameter names of the served model; no weight was changed"
                )
            param = params[name]
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, the model expects "
                    f"{tuple(param.shape)}; no weight was changed"
                )
            if not tensor.is_floating_point():
                raise ValueError(
                    f"weight {name!r} has dtype {tensor.dtype}, not floating point; no weight was changed"
                )
            staged[name] = (param, tensor)
        finite = [torch.isfinite(t).all() for _, t in staged.values()]
        if finite and not bool(
            torch.stack([f.to(finite[0].device) for f in finite]).all()
        ):  # one device sync for the whole update
            bad = next(n for n, ok in zip(staged, finite, strict=True) if not bool(ok))
            raise ValueError(f"weight {bad!r} holds NaN or infinite values; no weight was changed")
        return staged


def model_dims(hf_config) -> dict:
    """The few config values the engine needs, with HF's defaults for optional ones."""
    model_type = hf_config.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported by the embedded engine; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}. Use rollout.backend=sglang or vllm for others."
        )
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    return dict(
        model_type=model_type,
        hidden_size=hf_config.hidden_size,
        num_heads=num_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        vocab_size=hf_config.vocab_size,
        rms_norm_eps=hf_config.rms_norm_eps,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
    )


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return sorted({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors in {model_dir}; the engine loads HF safetensors checkpoints"
        )
    return files


def load_model(model_dir: str | Path, device: torch.device, dtype: torch.dtype) -> tuple[CausalLM, object]:
    """Build the model from `config.json` and load its safetensors; returns (model, hf_config)."""
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    hf_config = AutoConfig.from_pretrained(model_dir)
    files = _safetensors_files(model_dir)
    keys: set[str] = set()
    for path in files:
        with safe_open(path, framework="pt") as f:
            keys.update(f.keys())
    with torch.device("meta"):
        model = CausalLM(model_dims(hf_config), keys, hf_config)
    model = model.to_empty(device=device).to(dtype)
    if model.cfg["tie_word_embeddings"]:
        model.lm_head.weight = model.model.embed_tokens.weight  # to_empty() unties shared meta params
    model.rope.to_device(device)
    loaded: set[str] = set()
    for path in files:
        with safe_open(path, framework="pt") as f:
            loaded.update(
                model.load_weights(
                    (name, f.get_tensor(name))
                    for name in f.keys()
                    if not (name == "lm_head.weight" and model.cfg["tie_word_embeddings"])
                )
            )
    missing = {name for name, _ in model.named_parameters()} - loaded
    if missing:
        raise ValueError(
            f"checkpoint {model_dir} lacks weights {sorted(missing)[:5]} (of {len(missing)} missing)"
        )
    return model.eval(), hf_config
