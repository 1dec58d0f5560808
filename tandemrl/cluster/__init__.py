"""Ray placement and worker groups."""
