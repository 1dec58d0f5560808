"""Scripts that run a job on the lent GPU machine (README.md); no Python lives here."""
