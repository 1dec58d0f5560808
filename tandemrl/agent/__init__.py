"""The Search-R1 agent loop: prompt, parser, reward, search tool client, evaluation."""
