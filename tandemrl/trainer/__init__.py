"""The actor: advantages, loss, micro-batching, FSDP2, checkpoints, SFT."""
