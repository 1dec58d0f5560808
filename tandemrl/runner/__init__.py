"""The sync and async runners: the top-level loops."""
