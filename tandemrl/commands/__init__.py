"""One module per `tandem` subcommand that drives several packages (train, evaluate, sft, prepare, preflight).

Single-package commands stay with their package (docs/DESIGN.md, "Where things live").
"""
