"""The CUDA fast path of the model runner: Triton attention, CUDA-graph decode, sampling on the GPU.

`FastModelRunner` keeps `ModelRunner`'s contract (after `run`, every sequence of the batch has all its
tokens but the new one in the cache) and replaces how a step executes: decode steps replay a CUDA graph
captured for the smallest captured batch size >= the batch (padding rows write no KV and attend to
nothing), prefill steps run eagerly with the same Triton kernel. All of a step's host inputs go to the
GPU in one copy from a pinned buffer, sampling is one fused kernel, and the sampled tokens and logprobs come back in one copy: that
copy is the step's only host sync. Weight updates copy into the parameters in place, so captured graphs
stay valid across them.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from tandemrl.engine.model import CausalLM
from tandemrl.engine.model_runner import ModelRunner, flatten_uncached
from tandemrl.engine.sequence import Sequence

# Triton is imported only on the CUDA path (`triton_attention`, `fast_layers`): CPU installs need not have it.

logger = logging.getLogger(__name__)

_TUNE_CONTEXT = 512  # decode attention kernels are timed at this context length (or the max, if smaller)


def fast_path_supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Triton kernels run on CUDA in half precision with power-of-two head sizes; else the reference path."""
    return (
        device.type == "cuda"
        and dtype in (torch.bfloat16, torch.float16)
        and head_dim >= 16
        and head_dim & (head_dim - 1) == 0
    )


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = {1, 2, 4, 8, max_batch} | set(range(16, max_batch + 1, 16))
    return sorted(s for s in sizes if s <= max_batch)


class DecodeGraphs:
    """One captured decode forward per batch size, sharing static inputs and one memory pool."""

    def __init__(
        self,
        forward,
        kv_caches: list[torch.Tensor],
        max_batch: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
        decode_config,
    ):
        self.forward, self.kv_caches, self.block_size = forward, kv_caches, block_size
        self.decode_config = decode_config
        self.max_batch, self.width = max_batch, max_blocks_per_seq
        self.sizes = graph_batch_sizes(max_batch)
        # ids | positions | slots | context lens | block tables, all int64, copied to the GPU in one go
        self.host = torch.zeros(4 * max_batch + max_batch * max_blocks_per_seq, dtype=torch.long).pin_memory()
        self.host_np = self.host.numpy()
        self.dev = torch.zeros_like(self.host, device=device)
        m = max_batch
        self.ids, self.positions = self.dev[:m], self.dev[m : 2 * m]
        self.slots, self.context_lens = self.dev[2 * m : 3 * m], self.dev[3 * m : 4 * m]
        self.tables = self.dev[4 * m :].view(m, max_blocks_per_seq)
        self.rows = torch.arange(m, dtype=torch.long, device=device)
        self.ones = torch.ones(m, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.num_replays = 0
        self.row_owner: list[Sequence | None] = [None] * max_batch  # which sequence's table each row holds
        self.row_key: list[tuple[int, int] | None] = [None] * max_batch
        self._capture()

    def _meta(self, size: int):
        from tandemrl.engine.triton_attention import FastMetadata

        return FastMetadata(
            slot_mapping_T=self.slots[:size],
            query_start_B=self.rows[:size],
            query_lens_B=self.ones[:size],
            context_lens_B=self.context_lens[:size],
            block_tables_BW=self.tables[:size],
            last_token_index=self.rows[:size],
            max_query_len=1,
            block_size=self.block_size,
            max_context_len=self.width * self.block_size,
            decode=self.decode_config,
        )

    @torch.inference_mode()
    def _capture(self) -> None:
        self.slots.fill_(-1)  # warm-up and capture write no KV
        pool = None
        for size in reversed(self.sizes):  # largest first: the smaller graphs fit in its pool
            meta = self._meta(size)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.forward(self.ids[:size], self.positions[:size], self.kv_caches, meta)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self.forward(self.ids[:size], self.positions[:size], self.kv_caches, meta)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def can_run(self, seqs: list[Sequence]) -> bool:
        return len(seqs) <= self.max_batch and all(
            s.num_tokens - s.num_cached_tokens == 1 and len(s.block_table) <= self.width for s in seqs
        )

    def run(self, seqs: list[Sequence]) -> torch.Tensor:
        """Replay the graph for this decode batch; returns its logits `[B, V]` (a view of a static buffer)."""
        num_seqs = len(seqs)
        size = next(s for s in self.sizes if s >= num_seqs)
        m, bs = self.max_batch, self.block_size
        h = self.host_np
        positions = [s.num_tokens - 1 for s in seqs]
        h[:num_seqs] = [s.output_ids[-1] if s.output_ids else s.prompt_ids[-1] for s in seqs]
        h[m : m + num_seqs] = positions
        h[2 * m : 2 * m + num_seqs] = [
            s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, positions, strict=True)
        ]
        h[3 * m : 3 * m + num_seqs] = [s.num_tokens for s in seqs]
        h[2 * m + num_seqs : 2 * m + size] = -1  # padding rows: no KV write
        h[3 * m + num_seqs : 3 * m + size] = 0  # and no keys
        tables = h[4 * m :].reshape(m, self.width)
        for i, seq in enumerate(seqs):  # rewrite a row only when its table changed (tables only grow)
            key = (len(seq.block_table), seq.num_retractions)
            if self.row_owner[i] is not seq or self.row_key[i] != key:
                tables[i, : key[0]] = seq.block_table
                self.row_owner[i], self.row_key[i] = seq, key
        self.dev.copy_(self.host, non_blocking=True)
        self.graphs[size].replay()
        self.num_replays += 1
        return self.logits[size][:num_seqs]


class FastModelRunner(ModelRunner):
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        seed: int,
        max_batch: int,
        max_context_len: int,
        use_cuda_graphs: bool = True,
    ):
        super().__init__(model, num_blocks, block_size, device, dtype, seed)
        from tandemrl.engine.fast_layers import fast_forward, fuse_projections

        fused = fuse_projections(model)
        self.forward = lambda ids, pos, kv_caches, meta: fast_forward(model, fused, ids, pos, kv_caches, meta)
        from tandemrl.engine.triton_attention import tune_decode

        self.decode_config, self.decode_timings = tune_decode(
            self.kv_caches[0],
            model.cfg["num_heads"],
            max_batch,
            min(max_context_len, _TUNE_CONTEXT),
            block_size,
        )
        logger.info("decode attention: %s (timings ms %s)", self.decode_config, self.decode_timings)
        max_blocks_per_seq = -(-max_context_len // block_size)
        self.graphs = (
            DecodeGraphs(
                self.forward,
                self.kv_caches,
                max_batch,
                max_blocks_per_seq,
                block_size,
                device,
                self.decode_config,
            )
            if use_cuda_graphs
            else None
        )

    @torch.inference_mode()
    def forward_logits(self, seqs: list[Sequence]) -> torch.Tensor:
        if self.graphs is not None and self.graphs.can_run(seqs):
            logits = self.graphs.run(seqs)
        else:
            logits = self._forward_eager(seqs)
        for seq in seqs:
            seq.num_cached_tokens = seq.num_tokens
        return logits

    def _forward_eager(self, seqs: list[Sequence]) -> torch.Tensor:
        from tandemrl.engine.triton_attention import build_fast_metadata

        input_ids, positions, query_lens, context_lens = flatten_uncached(seqs)
        meta = build_fast_metadata(
            query_lens,
            context_lens,
            [s.block_table for s in seqs],
            self.block_size,
            self.device,
            self.decode_config,
        )
        host = torch.tensor(np.stack([input_ids, positions]), dtype=torch.long)
        ids, pos = host.to(self.device)
        return self.forward(ids, pos, self.kv_caches, meta)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> tuple[list[int], list[float]]:
        from tandemrl.engine.fast_layers import fused_sample

        params = [s.params for s in seqs]
        if any(p.temperature > 0 and (p.top_p < 1 or p.top_k > 0) for p in params):
            return super().run(seqs)  # truncated sampling: the reference sampler (a few host syncs)
        temps = [p.temperature for p in params]
        if len(set(temps)) == 1:
            temps_B = torch.full((len(seqs),), float(temps[0]), dtype=torch.float32, device=self.device)
        else:
            temps_B = torch.tensor(temps, dtype=torch.float32).to(self.device, non_blocking=True)
        logits = self.forward_logits(seqs)
        seed = torch.randint(0, 2**31 - 1, (1,), device=self.device, generator=self.generator)
        token_ids, logprobs = fused_sample(logits, temps_B, seed)
        both = torch.stack([token_ids.double(), logprobs.double()]).cpu()  # the step's one host sync
        return [int(t) for t in both[0].tolist()], both[1].tolist()


def build_runner(
    model: CausalLM, num_blocks: int, config, device: torch.device, dtype: torch.dtype
) -> ModelRunner:
    """The reference runner on CPU (and fp32 CUDA), the fast one on CUDA in bf16/fp16."""
    if not fast_path_supported(device, dtype, model.cfg["head_dim"]):
        return ModelRunner(model, num_blocks, config.block_size, device, dtype, config.seed)
    return FastModelRunner(
        model,
        num_blocks,
        config.block_size,
        device,
        dtype,
        config.seed,
        max_batch=config.max_running_requests,
        max_context_len=config.max_context_len,
        use_cuda_graphs=config.enable_cuda_graphs,
    )
