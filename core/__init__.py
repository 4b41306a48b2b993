"""The ground layer: the names and contracts every part of turnscope stands on. It imports nothing
of turnscope's above it (docs/design.md)."""
