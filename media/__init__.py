"""turnkeeper: media layer (see DESIGN.md)."""
