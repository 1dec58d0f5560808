"""tandemrl: RL for LLM search agents with rollout and training overlapped."""

__version__ = "0.1.0"
