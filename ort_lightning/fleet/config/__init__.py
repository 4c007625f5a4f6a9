"""The fleet's config: its sections, and the checks of their keys and types."""
