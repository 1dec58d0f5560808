"""The varlen attention path (trainer/varlen.py) on CPU: a packed row through a real HF model with
`tandem_varlen` attention equals per-sample forwards (GQA heads included), and a call without sample
boundaries is a clear error. The CUDA kernel itself is probed against the same reference at start-up
(`varlen_kernel_works`) and exercised by benchmarks/actor/trainer_smollm2.py on the GPU."""

from __future__ import annotations

import pytest
import torch

from tandemrl.trainer.batching import TrainSample, build_micro_batch
from tandemrl.trainer.policy import resolve_attn_implementation, uses_packed_rows
from tandemrl.trainer.varlen import VARLEN_ATTN, register_varlen_attention, varlen_kernel_works


def _samples() -> list[TrainSample]:
    return [TrainSample(list(range(7, 7 + n)), [0, 0] + [1] * (n - 2), [0.0] * n) for n in (9, 5, 12)]


@pytest.fixture(scope="module")
def varlen_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    register_varlen_attention()
    return AutoModelForCausalLM.from_pretrained(
        tiny_llama_dir, dtype=torch.float32, attn_implementation=VARLEN_ATTN
    )


def test_packed_varlen_forward_equals_separate_forwards(varlen_model):
    samples = _samples()
    micro = build_micro_batch(samples, [0, 1, 2], padded=False)
    assert micro.cu_seqlens_S.tolist() == [0, 9, 14, 26] and micro.max_seqlen == 12
    assert varlen_model.config.num_key_value_heads < varlen_model.config.num_attention_heads  # GQA
    with torch.no_grad():
        logits = varlen_model(
            input_ids=micro.input_ids_RL,
            position_ids=micro.position_ids_RL,
            use_cache=False,
            cu_seq_lens_q=micro.cu_seqlens_S,
            cu_seq_lens_k=micro.cu_seqlens_S,
            max_length_q=micro.max_seqlen,
            max_length_k=micro.max_seqlen,
        ).logits[0]
        separate = torch.cat(
            [
                varlen_model(input_ids=torch.tensor([s.input_ids]), **_one(s.num_tokens)).logits[0]
                for s in samples
            ]
        )
    assert (logits - separate).abs().max().item() < 1e-5


def _one(n: int) -> dict:
    cu = torch.tensor([0, n], dtype=torch.int32)
    return dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=n, max_length_k=n)


def test_varlen_without_boundaries_is_a_clear_error(varlen_model):
    with pytest.raises(ValueError, match="cu_seq_lens_q"), torch.no_grad():
        varlen_model(input_ids=torch.tensor([[5, 6, 7]]), use_cache=False)


def test_auto_resolves_to_padded_sdpa_on_cpu_and_varlen_packs():
    cpu = torch.device("cpu")
    assert resolve_attn_implementation("auto", cpu, torch.float32) == "sdpa"
    assert not varlen_kernel_works(cpu, torch.bfloat16)  # the CUDA kernel: never on CPU
    assert resolve_attn_implementation("varlen", cpu, torch.float32) == VARLEN_ATTN
    assert uses_packed_rows(VARLEN_ATTN) and not uses_packed_rows("sdpa")


def test_auto_micro_batch_tokens_scale_with_free_memory_and_model_size():
    from transformers import LlamaConfig

    from tandemrl.trainer.policy import auto_micro_batch_tokens, resolve_micro_batch_tokens

    smollm2 = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30)
    big = LlamaConfig(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28)
    assert auto_micro_batch_tokens(smollm2, 141 * 10**9) == 40960  # an idle H200
    assert auto_micro_batch_tokens(smollm2, 85 * 10**9) == 24576  # next to an engine's KV cache
    assert auto_micro_batch_tokens(big, 141 * 10**9) == 8192
    assert auto_micro_batch_tokens(big, 10**9) == 4096  # never below one step
    assert auto_micro_batch_tokens(smollm2, 10**13) == 65536  # nor above the cap
    assert resolve_micro_batch_tokens(None, smollm2, torch.device("cpu")) == 8192
    assert resolve_micro_batch_tokens(300, smollm2, torch.device("cpu")) == 300


def test_the_kernels_options_are_read_before_compiling_so_dynamo_traces_a_constant():
    """The compiled layers call `_kernel_options` on every attention; read once at registration, Dynamo
    traces it without the warning a `functools.cache` wrapper gave in every GPU run's log."""
    import warnings

    from tandemrl.trainer import varlen

    if varlen._torch_varlen() is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    register_varlen_attention()
    assert varlen._KERNEL_OPTIONS is not None
    causal, _ = varlen._KERNEL_OPTIONS
    assert set(causal) <= {"window_size", "is_causal"} and causal

    @torch.compile(fullgraph=True, backend="eager")
    def uses_options(x):
        _, takes_gqa = varlen._kernel_options()
        return x + (1.0 if takes_gqa else 2.0)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = uses_options(torch.zeros(2))
    assert not [w for w in caught if "lru_cache" in str(w.message) or "cache" in str(w.message)]
    assert out.tolist() == [1.0 if varlen._KERNEL_OPTIONS[1] else 2.0] * 2
