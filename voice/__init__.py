"""turnkeeper: voice layer (see DESIGN.md)."""
