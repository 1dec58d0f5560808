"""Typed configuration: schema, YAML + dotted overrides, derived values."""
