"""Engine clients (SGLang and vLLM protocols), the engine pool, pause protocol and weight sync."""
