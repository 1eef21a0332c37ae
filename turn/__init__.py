"""turnkeeper: turn layer (see DESIGN.md)."""
