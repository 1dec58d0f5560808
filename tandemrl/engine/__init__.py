"""The embedded rollout engine: scheduler, KV cache, model runner, sampler, SGLang-protocol HTTP server."""
