"""The rollout buffer: admission, staleness, drops, per-task state."""
