"""Encoders, the Qdrant store, the index builder and the Search-R1 /retrieve HTTP server."""
