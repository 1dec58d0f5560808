"""Datasets, the resumable prompt loader, the knowledge-base generator and converters."""
