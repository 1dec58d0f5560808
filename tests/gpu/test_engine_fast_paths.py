"""The engine's CUDA fast paths (issue 9): the Triton paged attention equals the reference gather + SDPA
path on random data (decode, ragged prefill, prefill behind a cached prefix, padding rows), and greedy
outputs are identical with and without CUDA graphs, with prefix reuse and without."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _tables(context_lens: list[int], block_size: int, rng: random.Random) -> tuple[list[list[int]], int]:
    num_blocks = sum(-(-c // block_size) for c in context_lens) + 5
    order = list(range(num_blocks))
    rng.shuffle(order)  # scattered blocks, as after many allocations
    tables, used = [], 0
    for ctx in context_lens:
        count = -(-ctx // block_size)
        tables.append(order[used : used + count])
        used += count
    return tables, num_blocks


def _attention_case(
    num_heads, num_kv_heads, head_dim, query_lens, context_lens, seed: int, head_major: bool = False
):
    """Random bf16 cache, queries and new K/V, and the reference output (fp32 gather + SDPA) with the
    reference's cache after it stored the new K/V; returns (tables, cache, q, k, v, ref_cache, ref)."""
    from tandemrl.engine.attention import build_metadata, paged_attention

    rng, block_size, device = random.Random(seed), 16, torch.device("cuda")
    torch.manual_seed(seed)
    tables, num_blocks = _tables(context_lens, block_size, rng)
    num_tokens = sum(query_lens)
    cache = torch.randn(
        2, num_blocks * block_size, num_kv_heads, head_dim, device=device, dtype=torch.bfloat16
    )
    if head_major:  # the kernels take any strides: each head's slots contiguous here
        cache = cache.transpose(1, 2).contiguous().transpose(1, 2)
    q = torch.randn(num_tokens, num_heads, head_dim, device=device, dtype=torch.bfloat16)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    ref_cache = cache.float()
    ref = paged_attention(
        q.float(),
        k.float(),
        v.float(),
        ref_cache,
        build_metadata(query_lens, context_lens, tables, block_size, device),
        head_dim**-0.5,
    )
    return tables, cache, q, k, v, ref_cache, ref


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(12, 2, 128), (4, 4, 64), (16, 2, 64)])
@pytest.mark.parametrize(
    "query_lens,context_lens",
    [
        ([1] * 9, [1, 5, 16, 17, 33, 100, 257, 300, 1000]),  # decode
        ([7, 100, 1, 64], [7, 100, 1, 64]),  # ragged prefill from scratch
        ([3, 50, 1, 17], [40, 200, 65, 17]),  # prefill behind cached prefixes
    ],
)
@pytest.mark.parametrize("decode_index", range(12))
@pytest.mark.parametrize("head_major", [False, True])
def test_triton_attention_matches_reference(
    num_heads, num_kv_heads, head_dim, query_lens, context_lens, decode_index, head_major
):
    from tandemrl.engine.attention_tiles import DECODE_CANDIDATES
    from tandemrl.engine.triton_attention import build_fast_metadata

    assert len(DECODE_CANDIDATES) == 12, "parametrize decode_index over every candidate"
    tables, cache, q, k, v, ref_cache, ref = _attention_case(
        num_heads, num_kv_heads, head_dim, query_lens, context_lens, 0, head_major
    )
    fast_meta = build_fast_metadata(
        query_lens, context_lens, tables, 16, torch.device("cuda"), DECODE_CANDIDATES[decode_index]
    )
    fresh = cache.clone()
    out = fast_meta.attend(q, k, v, cache, head_dim**-0.5)
    torch.testing.assert_close(cache.float(), ref_cache.to(torch.bfloat16).float(), atol=0, rtol=0)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    if max(query_lens) == 1:  # a decode step from the QKV output: RoPE (the identity here), store, attend
        qkv = torch.cat([q, k, v], dim=1).reshape(len(query_lens), -1)
        ones = torch.ones(len(query_lens), head_dim, device="cuda", dtype=torch.bfloat16)
        fused = fast_meta.rope_attend(qkv, ones, torch.zeros_like(ones), fresh, num_heads, head_dim**-0.5)
        torch.testing.assert_close(fresh.float(), cache.float(), atol=0, rtol=0)
        torch.testing.assert_close(fused.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(12, 2, 128), (4, 4, 64)])
@pytest.mark.parametrize(
    "query_lens,context_lens",
    [
        ([7, 100, 1, 64, 256], [7, 100, 1, 64, 256]),  # ragged prefill from scratch
        ([3, 50, 1, 17, 130], [40, 200, 65, 17, 300]),  # prefill behind cached prefixes
    ],
)
@pytest.mark.parametrize("prefill_index", range(8))
def test_prefill_tiles_match_reference(
    num_heads, num_kv_heads, head_dim, query_lens, context_lens, prefill_index
):
    """Every prefill tiling equals the reference; `attend_last` gives each sequence's last row of it."""
    from tandemrl.engine.attention_tiles import DEFAULT_DECODE, PREFILL_CANDIDATES
    from tandemrl.engine.triton_attention import build_fast_metadata

    assert len(PREFILL_CANDIDATES) == 8, "parametrize prefill_index over every candidate"
    tables, cache, q, k, v, _, ref = _attention_case(
        num_heads, num_kv_heads, head_dim, query_lens, context_lens, 1
    )
    meta = build_fast_metadata(
        query_lens,
        context_lens,
        tables,
        16,
        torch.device("cuda"),
        DEFAULT_DECODE,
        PREFILL_CANDIDATES[prefill_index],
    )
    out = meta.attend(q, k, v, cache, head_dim**-0.5)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    last = meta.attend_last(q[meta.last_token_index], cache, head_dim**-0.5)
    torch.testing.assert_close(last.float(), ref[meta.last_token_index], atol=2e-2, rtol=2e-2)
    # The same attention over a tile table (a prefill graph's grid), with two padding sequences and
    # padding slots: equal to the grid of `attend`, bit for bit (the same programs run).
    import numpy as np

    from tandemrl.engine.attention_tiles import max_tiles, tile_table
    from tandemrl.engine.triton_attention import attend_tiles, prefill_block_m

    prefill = PREFILL_CANDIDATES[prefill_index]
    queries_per_tile = prefill_block_m(num_heads, num_kv_heads, prefill) // (num_heads // num_kv_heads)
    num_slots = max_tiles(sum(query_lens), len(query_lens) + 2, queries_per_tile) + 3
    tiles = torch.from_numpy(tile_table(np.array(query_lens), queries_per_tile, num_slots)).cuda()

    def padded(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.cat([t, torch.full((2, *t.shape[1:]), value, dtype=t.dtype, device=t.device)])

    tiled = attend_tiles(
        q,
        cache,
        padded(meta.block_tables_BW, 0),
        padded(meta.query_start_B, sum(query_lens)),
        padded(meta.query_lens_B, 0),
        padded(meta.context_lens_B, 0),
        tiles,
        16,
        head_dim**-0.5,
        prefill,
    )
    assert torch.equal(tiled, out)


def test_padding_rows_write_nothing():
    from tandemrl.engine.triton_attention import store_kv

    cache = torch.zeros(2, 32, 2, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.ones(3, 2, 64, device="cuda", dtype=torch.bfloat16)
    store_kv(k, 2 * k, cache, torch.tensor([5, -1, 7], device="cuda"))
    assert cache[0, 5].eq(1).all() and cache[1, 7].eq(2).all()
    assert cache.count_nonzero().item() == 2 * 2 * 2 * 64


def test_programmatic_dependent_launch_on_hopper_only():
    from tandemrl.engine.pdl import use_pdl

    assert not use_pdl(torch.zeros(1))  # CPU tensors: the reference path, no PDL
    assert use_pdl(torch.zeros(1, device="cuda")) == (torch.cuda.get_device_capability()[0] >= 9)


def _model_dir(root: Path, init_std: float = 0.2, seed: int = 0) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        use_sliding_window=False,
        initializer_range=init_std,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(root, safe_serialization=True)
    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(254)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(root)
    return root


def _pin_kernels(monkeypatch, down_split: int = 1) -> None:
    """The default attention kernels and `down_split` parts for the down projection at every batch size,
    instead of the start-up tuners' timed choices (which may differ between two engines of one test)."""
    from tandemrl.engine import kernel_tuning, triton_attention, tuning_cache

    monkeypatch.setenv(tuning_cache.CACHE_ENV, "0")  # neither read other choices nor write these to the cache
    monkeypatch.setattr(kernel_tuning, "tune_decode", lambda *args: (triton_attention.DEFAULT_DECODE, {}))
    monkeypatch.setattr(kernel_tuning, "tune_prefill", lambda *args: (triton_attention.DEFAULT_PREFILL, {}))
    monkeypatch.setattr(
        kernel_tuning, "tune_down_split", lambda weights, norm, sizes: ({b: down_split for b in sizes}, {})
    )


def _greedy(
    model_dir: Path,
    prompts: list[list[int]],
    graphs: bool,
    prefix: bool,
    overlap: bool | None = True,
    prefill_budget: int = 8192,
    prefill_graphs: bool = False,
    speculative: str = "none",
    turns: int = 2,
    max_new_tokens: int = 40,
) -> tuple[list, object]:
    from tandemrl.engine.engine import Engine, EngineConfig
    from tandemrl.engine.sequence import SamplingParams

    engine = Engine(
        EngineConfig(
            str(model_dir),
            device="cuda",
            dtype="bfloat16",
            max_running_requests=16,
            max_context_len=512,
            enable_cuda_graphs=graphs,
            enable_prefix_caching=prefix,
            overlap_steps=overlap,
            max_prefill_tokens=prefill_budget,
            prefill_cuda_graphs=prefill_graphs,
            speculative=speculative,
        )
    )
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    outputs = {}
    for turn in range(turns):  # the second turn resends each context: prefix reuse when enabled
        for i, ids in enumerate(prompts):
            engine.add_request(f"{turn}-{i}", ids, params)
        while engine.has_work():
            for seq in engine.step():
                outputs[seq.rid] = (seq.output_ids, seq.output_logprobs)
        prompts = [ids + outputs[f"{turn}-{i}"][0] + list(range(10, 30)) for i, ids in enumerate(prompts)]
    return [outputs[k] for k in sorted(outputs, key=lambda rid: [int(n) for n in rid.split("-")])], engine


def test_cuda_graph_greedy_equals_eager(tmp_path, monkeypatch):
    # Every engine here must run the same kernels: only CUDA graphs (or prefix reuse) may differ.
    _pin_kernels(monkeypatch)
    model_dir = _model_dir(tmp_path / "model")
    rng = random.Random(1)
    prompts = [[rng.randrange(2, 2048) for _ in range(rng.randrange(5, 90))] for _ in range(12)]
    eager, eager_engine = _greedy(model_dir, prompts, graphs=False, prefix=False)
    graphed, graphed_engine = _greedy(model_dir, prompts, graphs=True, prefix=False)
    serial, _ = _greedy(model_dir, prompts, graphs=True, prefix=False, overlap=False)
    assert serial == graphed  # overlapping the host with the GPU changes no token and no logprob
    reused, reused_engine = _greedy(model_dir, prompts, graphs=True, prefix=True)
    assert graphed_engine.runner.graphs.num_replays > 0 and eager_engine.runner.graphs is None
    assert [o for o, _ in graphed] == [o for o, _ in eager]
    assert [lp for _, lp in graphed] == [lp for _, lp in eager]
    assert reused_engine.num_prefill_tokens < graphed_engine.num_prefill_tokens
    # Turn 1 has nothing to reuse: identical. Turn 2 attends to KV computed in other GEMM shapes (bf16
    # rounding differs), so greedy paths may part after a near-tie; their first tokens must still agree.
    # Exact equality with and without reuse is tested in fp32 on CPU (tests/unit/test_engine_prefix_cache.py).
    num_prompts = len(prompts)  # outputs are sorted by request id: turn 1's come first
    assert reused[:num_prompts] == graphed[:num_prompts]
    turn2 = zip(reused[num_prompts:], graphed[num_prompts:], strict=True)
    assert sum(r[0][0] == g[0][0] for r, g in turn2) >= num_prompts - 2


@pytest.mark.parametrize("prefill_budget", [8192, 48])
def test_prefill_graphs_match_eager_prefill(tmp_path, monkeypatch, prefill_budget):
    """Prefill steps replayed from CUDA graphs (engine/prefill_graphs.py: padded tokens and sequences, the
    attention over a tile table) give the eager prefill's greedy tokens and logprobs, with prefix reuse
    (turn 2 prefills behind cached prefixes) and with chunks (a 48-token budget)."""
    _pin_kernels(monkeypatch)
    model_dir = _model_dir(tmp_path / "model")
    rng = random.Random(7)
    prompts = [[rng.randrange(2, 2048) for _ in range(rng.randrange(5, 90))] for _ in range(12)]
    eager, eager_engine = _greedy(model_dir, prompts, graphs=True, prefix=True, prefill_budget=prefill_budget)
    graphed, graphed_engine = _greedy(
        model_dir, prompts, graphs=True, prefix=True, prefill_budget=prefill_budget, prefill_graphs=True
    )
    assert eager_engine.runner.prefill_graphs is None
    replays = graphed_engine.stats()["num_prefill_graph_steps"]
    assert replays == graphed_engine.num_prefill_steps > 0  # every prefill step fit a bucket
    # The padded GEMMs may round a row differently from the unpadded ones: near-ties can part, so the
    # requests' first tokens must agree (all but two), and the logprobs of the tokens both paths chose stay
    # close up to where they part.
    assert sum(g[0][0] == e[0][0] for g, e in zip(graphed, eager, strict=True)) >= len(eager) - 2
    for (g_ids, g_lps), (e_ids, e_lps) in zip(graphed, eager, strict=True):
        agree = next((i for i, (a, b) in enumerate(zip(g_ids, e_ids, strict=True)) if a != b), len(g_ids))
        for a, b in zip(g_lps[:agree], e_lps[:agree], strict=True):
            assert abs(a - b) < 0.05


def test_speculative_verify_on_the_fast_path(tmp_path, monkeypatch):
    """n-gram speculation on the CUDA runner (engine/fast_model_runner.py `launch_verify`): a batch with
    drafts is one eager Triton forward whose every row is verified, a batch without replays the decode
    graph. Greedy tokens are those of the same engine without speculation (the forward rounds a verify
    row in other GEMM shapes than a decode step, so near-ties may part: first tokens agree for all but two
    requests, logprobs stay close until the paths part), drafts are accepted, and no KV block leaks.

    The prompts are P + G + P, G the model's own greedy continuation of P, as in the CPU tests
    (tests/unit/test_engine_speculative.py): after the second P the drafts propose G again, which the
    model partly repeats. At init std 0.05 it does (193 of 275 drafted tokens accepted in fp32 on CPU);
    at 0.2 its continuations change with the context and none is (0 of 43), and a span merely repeated
    in a random prompt is never what such a model generates (0 of 46)."""
    from tandemrl.engine.fast_model_runner import FastModelRunner
    from tandemrl.engine.sequence import SamplingParams

    _pin_kernels(monkeypatch)
    model_dir = _model_dir(tmp_path / "model", init_std=0.05)
    rng = random.Random(11)
    starts = [[rng.randrange(2, 2048) for _ in range(rng.randrange(8, 30))] for _ in range(12)]
    continued, _ = _greedy(model_dir, starts, graphs=True, prefix=False, turns=1, max_new_tokens=24)
    prompts = [start + ids + start for start, (ids, _) in zip(starts, continued, strict=True)]
    plain, _ = _greedy(model_dir, prompts, graphs=True, prefix=True, overlap=False)
    spec, engine = _greedy(model_dir, prompts, graphs=True, prefix=True, overlap=None, speculative="ngram")
    assert isinstance(engine.runner, FastModelRunner) and not engine.overlaps
    assert 0 < engine.num_spec_accepted_tokens <= engine.num_spec_draft_tokens
    assert engine.num_decode_emitted_tokens > engine.num_decode_rows  # fewer steps than tokens
    # Alone, a request of four distinct tokens decodes its second token without a draft unless its first
    # repeats one of them: the plain decode graph.
    for i in range(4):
        engine.add_request(
            f"alone-{i}",
            [rng.randrange(2, 2048) for _ in range(4)],
            SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True),
        )
        while engine.has_work():
            engine.step()
    assert engine.runner.graphs.num_replays > 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks  # free or cached, none held
    assert sum(s[0][0] == p[0][0] for s, p in zip(spec, plain, strict=True)) >= len(plain) - 2
    for (s_ids, s_lps), (p_ids, p_lps) in zip(spec, plain, strict=True):
        assert len(s_ids) == len(p_ids) == 40  # max_new_tokens holds with several tokens a step
        agree = next((i for i, (a, b) in enumerate(zip(s_ids, p_ids, strict=True)) if a != b), len(s_ids))
        for a, b in zip(s_lps[:agree], p_lps[:agree], strict=True):
            assert abs(a - b) < 0.05


def test_split_k_down_projection_greedy_equal_with_and_without_graphs(tmp_path, monkeypatch):
    """Down projections as 4 split-K partials summed by the next norm: decode graphs and eager decode steps
    (which split the same way) give identical greedy tokens and logprobs, and the tokens match plain
    cuBLAS GEMMs for all but rounding near-ties."""
    model_dir = _model_dir(tmp_path / "model")
    rng = random.Random(5)
    prompts = [[rng.randrange(2, 2048) for _ in range(rng.randrange(5, 90))] for _ in range(12)]
    _pin_kernels(monkeypatch, down_split=4)
    split, split_engine = _greedy(model_dir, prompts, graphs=True, prefix=False)
    eager, eager_engine = _greedy(model_dir, prompts, graphs=False, prefix=False)
    assert set(split_engine.runner.graphs.down_splits.values()) == {4}
    assert split_engine.runner.graphs.num_replays > 0 and eager_engine.runner.down_splits[16] == 4
    assert split == eager
    _pin_kernels(monkeypatch, down_split=1)
    plain, _ = _greedy(model_dir, prompts, graphs=True, prefix=False)
    assert sum(s[0] == p[0] for s, p in zip(split, plain, strict=True)) >= len(plain) - 2


@pytest.mark.parametrize("parts", [2, 4, 5, 7])
@pytest.mark.parametrize("rows", [1, 13, 256])
def test_split_k_linear_summed_by_add_rmsnorm_matches_linear(parts, rows):
    import torch.nn.functional as F

    from tandemrl.engine.fast_layers import add_rmsnorm, split_k_linear

    torch.manual_seed(rows + parts)
    x = torch.randn(rows, 8960, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(1536, 8960, device="cuda", dtype=torch.bfloat16) * 0.02
    residual = torch.randn(rows, 1536, device="cuda", dtype=torch.bfloat16)
    norm = torch.rand(1536, device="cuda", dtype=torch.bfloat16) + 0.5
    partials = split_k_linear(x, weight, parts)
    assert partials.shape == (parts, rows, 1536) and partials.dtype == torch.float32
    torch.testing.assert_close(partials.sum(0), (x.float() @ weight.float().T), atol=2e-3, rtol=1e-3)
    out, new_residual = add_rmsnorm(partials, residual, norm, 1e-6)
    ref_out, ref_residual = add_rmsnorm(F.linear(x, weight), residual, norm, 1e-6)
    # fp32 sums in another order, rounded once to bf16: equal but for rare last-bit flips
    for got, want in ((out, ref_out), (new_residual, ref_residual)):
        assert got.dtype == torch.bfloat16
        assert (got != want).float().mean().item() < 1e-2
        # a flipped last bit of a GEMM output (|x| up to ~8, bf16 steps of 1/16 there) reaches both outputs
        torch.testing.assert_close(got, want, atol=0.07, rtol=1e-2)


def test_embed_pending_and_rope_rows_match_the_unfused_ops():
    """A decode graph's first two kernels: the input ids (pending ones read on the device) with their
    embeddings, and the cos/sin rows gathered from the kept table, bit-equal to the ops they replace."""
    from transformers import Qwen2Config

    from tandemrl.engine.fast_layers import embed_pending
    from tandemrl.engine.rope import RotaryEmbedding

    torch.manual_seed(0)
    weight = torch.randn(1000, 1536, device="cuda", dtype=torch.bfloat16)
    pending = torch.randint(0, 1000, (256,), device="cuda")
    ids = torch.randint(0, 1000, (40,), device="cuda")
    src = torch.randint(-1, 256, (40,), device="cuda")  # -1: the id is known to the host
    expected = torch.nn.functional.embedding(torch.where(src >= 0, pending[src.clamp(min=0)], ids), weight)
    assert torch.equal(embed_pending(src, pending, ids, weight), expected)
    rope = RotaryEmbedding(Qwen2Config(hidden_size=1536, num_attention_heads=12), 128)
    rope.to_device(torch.device("cuda"))
    positions = torch.randint(0, 4096, (300,), device="cuda")
    cos, sin = rope.cos_sin(positions, torch.bfloat16)
    rope.keep_table(4096, torch.bfloat16)
    rows = rope.cos_sin_rows(positions, torch.bfloat16)
    assert torch.equal(rows[0], cos[:, 0]) and torch.equal(rows[1], sin[:, 0])
    assert rows[0].stride() == rows[1].stride() and rows[0].stride(1) == 1  # as the RoPE kernels read them


def test_down_split_tuner_times_every_candidate():
    from tandemrl.engine.kernel_tuning import split_candidates, tune_down_split

    assert split_candidates(8960) == (2, 4, 5, 7, 8) and split_candidates(100) == ()
    weights = [torch.randn(1536, 8960, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(3)]
    norm = torch.ones(1536, device="cuda", dtype=torch.bfloat16)
    choices, timings = tune_down_split(weights, norm, [1, 256])
    assert set(choices) == {1, 256} and all(parts in (1, 2, 4, 5, 7, 8) for parts in choices.values())
    assert set(timings) == {f"{b}x{p}" for b in (1, 256) for p in (1, 2, 4, 5, 7, 8)}
    assert all(ms > 0 for ms in timings.values())


def test_chunked_prefill_matches_whole_prefill(tmp_path, monkeypatch):
    """Prompts of up to 300 tokens prefilled 64 tokens a step, on the CUDA runner (graphs, overlap)."""
    _pin_kernels(monkeypatch)
    model_dir = _model_dir(tmp_path / "model")
    rng = random.Random(4)
    prompts = [[rng.randrange(2, 2048) for _ in range(rng.randrange(5, 300))] for _ in range(16)]
    whole, whole_engine = _greedy(model_dir, prompts, graphs=True, prefix=False)
    chunked, chunked_engine = _greedy(model_dir, prompts, graphs=True, prefix=False, prefill_budget=64)
    serial, _ = _greedy(model_dir, prompts, graphs=True, prefix=False, overlap=False, prefill_budget=64)
    assert serial == chunked  # same kernels on the same shapes: overlapping changes nothing
    assert chunked_engine.num_prefill_tokens == whole_engine.num_prefill_tokens
    assert chunked_engine.num_steps >= whole_engine.num_steps + 20  # dozens of 64-token chunks ran
    # bf16: a chunk's GEMMs run at other shapes than the whole prompt's, so a near-tie may part; most agree.
    assert sum(c[0] == w[0] for c, w in zip(chunked, whole, strict=True)) >= 28
    assert sum(c[0][0] == w[0][0] for c, w in zip(chunked, whole, strict=True)) >= 30


def _serve(engine, prompts: list[list[int]], tag: str) -> list[tuple[list[int], list[float]]]:
    from tandemrl.engine.sequence import SamplingParams

    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i:02d}", ids, params)
    outputs = {}
    while engine.has_work():
        for seq in engine.step():
            outputs[seq.rid] = (seq.output_ids, seq.output_logprobs)
    return [outputs[k] for k in sorted(outputs)]


def test_cuda_graphs_follow_weight_updates(tmp_path, monkeypatch):
    """Captured graphs read the parameters in place: after `load_weights` they decode with the new weights."""
    from safetensors.torch import load_file

    _pin_kernels(monkeypatch)
    model_dir = _model_dir(tmp_path / "model")
    new_weights = load_file(str(_model_dir(tmp_path / "other", seed=1) / "model.safetensors"))
    rng = random.Random(3)
    prompts = [[rng.randrange(2, 2048) for _ in range(rng.randrange(5, 60))] for _ in range(12)]
    _, graphed = _greedy(model_dir, prompts, graphs=True, prefix=True)
    _, eager = _greedy(model_dir, prompts, graphs=False, prefix=True)
    before = _serve(graphed, prompts, "old")
    for engine in (graphed, eager):
        engine.load_weights(new_weights.items())
    after_graphed, after_eager = _serve(graphed, prompts, "new"), _serve(eager, prompts, "new")
    assert [o for o, _ in after_graphed] == [o for o, _ in after_eager]
    assert [o for o, _ in after_graphed] != [o for o, _ in before]


def test_fused_forward_matches_reference_forward(tmp_path):
    from tandemrl.engine.attention import build_metadata
    from tandemrl.engine.fast_layers import fast_forward, fuse_projections
    from tandemrl.engine.kv_cache import allocate_kv_caches
    from tandemrl.engine.model import load_model
    from tandemrl.engine.triton_attention import build_fast_metadata

    device = torch.device("cuda")
    model, _ = load_model(_model_dir(tmp_path / "model", init_std=0.02), device, torch.bfloat16)
    rng = random.Random(2)
    query_lens = [9, 1, 40]
    context_lens = [9, 1, 40]
    tables = [[0], [1], [2, 3, 4]]
    ids = torch.tensor([rng.randrange(2, 2048) for _ in range(sum(query_lens))], device=device)
    pos = torch.cat([torch.arange(n) for n in query_lens]).to(device)
    caches = allocate_kv_caches(model.cfg, 8, 16, torch.bfloat16, device)
    with torch.inference_mode():
        ref = model(ids, pos, caches, build_metadata(query_lens, context_lens, tables, 16, device))
        fused = fuse_projections(model)
        again = model(ids, pos, caches, build_metadata(query_lens, context_lens, tables, 16, device))
        fast_caches = [torch.zeros_like(c) for c in caches]
        fast = fast_forward(
            model,
            fused,
            ids,
            pos,
            fast_caches,
            build_fast_metadata(query_lens, context_lens, tables, 16, device),
        ).float()
    torch.testing.assert_close(again, ref, atol=0, rtol=0)  # fusing re-points parameters, values unchanged
    # The last layer runs its attention output and MLP for the last tokens only, but stores every K/V.
    for fast_cache, ref_cache in zip(fast_caches, caches, strict=True):
        used = ref_cache[:, : 5 * 16].float()
        assert ((fast_cache[:, : 5 * 16].float() - used).norm() / used.norm()).item() < 0.02
    # bf16: RoPE is rounded once here (fp32 inside) but after each product in the reference
    error = (fast - ref).norm() / ref.norm()
    assert error.item() < 0.02
    assert torch.nn.functional.cosine_similarity(fast, ref, dim=-1).min().item() > 0.999
    # One decode step on top (RoPE, K/V store and attention in one kernel), and a padding row.
    with torch.inference_mode():
        ids = torch.tensor([rng.randrange(2, 2048) for _ in range(3)], device=device)
        pos = torch.tensor([9, 1, 40], device=device)
        ref = model(ids, pos, caches, build_metadata([1, 1, 1], [10, 2, 41], tables, 16, device))
        meta = build_fast_metadata([1, 1, 1, 1], [10, 2, 41, 1], [*tables, [7]], 16, device)
        meta.slot_mapping_T[3], meta.context_lens_B[3] = -1, 0  # as CUDA graphs pad a batch
        fast = fast_forward(
            model, fused, torch.cat([ids, ids[:1]]), torch.cat([pos, pos[:1]]), fast_caches, meta
        )
    for fast_cache, ref_cache in zip(fast_caches, caches, strict=True):
        for slot in (9, 16 + 1, 4 * 16 + 8):  # position 40 of table [2, 3, 4] is block 4, offset 8
            assert (
                (fast_cache[:, slot].float() - ref_cache[:, slot]).norm() / ref_cache[:, slot].norm()
            ) < 0.02
        assert fast_cache[:, 7 * 16 :].count_nonzero().item() == 0  # the padding row wrote nothing
    fast = fast[:3].float()
    assert ((fast - ref).norm() / ref.norm()).item() < 0.02
    assert torch.nn.functional.cosine_similarity(fast, ref, dim=-1).min().item() > 0.999
    # The same decode step with the down projections as split-K partials summed by the next norm
    with torch.inference_mode():
        split = fast_forward(
            model,
            fused,
            torch.cat([ids, ids[:1]]),
            torch.cat([pos, pos[:1]]),
            [c.clone() for c in fast_caches],
            meta,
            down_split=4,
        )
        again = fast_forward(
            model, fused, torch.cat([ids, ids[:1]]), torch.cat([pos, pos[:1]]), fast_caches, meta
        )
    split = split[:3].float()
    assert ((split - again[:3].float()).norm() / again[:3].float().norm()).item() < 0.02


def test_fused_sampler_greedy_and_distribution():
    from scipy.stats import chisquare

    from tandemrl.engine.gpu_sampler import fused_sample
    from tandemrl.engine.sampler import sample

    device = torch.device("cuda")
    logits = torch.randn(64, 151936, device=device) * 3
    ids, logprobs = fused_sample(logits, torch.zeros(64, device=device), torch.tensor([5], device=device))
    ref_ids, ref_logprobs = sample(
        logits,
        torch.zeros(64, device=device),
        torch.ones(64, device=device),
        torch.full((64,), -1, device=device),
    )
    assert ids.tolist() == ref_ids.tolist()
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-4, rtol=1e-4)
    # bf16 logits (the fast path's): read as they are, same answer as the reference on their fp32 copy
    half = logits.bfloat16()
    ids, logprobs = fused_sample(half, torch.zeros(64, device=device), torch.tensor([5], device=device))
    ref_ids, ref_logprobs = sample(
        half.float(),
        torch.zeros(64, device=device),
        torch.ones(64, device=device),
        torch.full((64,), -1, device=device),
    )
    assert ids.tolist() == ref_ids.tolist()
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-4, rtol=1e-4)
    # the draw depends on (seed, row, column) only: the same seed samples the same tokens at any batch size
    temps = torch.ones(64, device=device)
    full, _ = fused_sample(half, temps, torch.tensor([7], device=device))
    part, _ = fused_sample(half[:5], temps[:5], torch.tensor([7], device=device))
    assert part.tolist() == full[:5].tolist()
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], device=device)
    for temperature in (1.0, 0.7):
        temps = torch.full((20000,), temperature, device=device)
        ids, logprobs = fused_sample(
            base.expand(20000, -1).contiguous(), temps, torch.tensor([11], device=device)
        )
        probs = torch.softmax(base.double() / temperature, -1)
        counts = torch.bincount(ids, minlength=6).double()
        assert chisquare(counts.cpu().numpy(), (probs * 20000).cpu().numpy()).pvalue > 1e-3
        torch.testing.assert_close(logprobs, probs.log()[ids].float(), atol=1e-5, rtol=1e-5)
