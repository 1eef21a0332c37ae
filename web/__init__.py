"""turnkeeper: web layer (see DESIGN.md)."""
