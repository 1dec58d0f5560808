"""The `tandem` subcommands that drive several packages (docs/DESIGN.md, "Where things live"): what they
check before anything starts, and what they show. A command that needs one package stays with it."""
