"""The ground layer: the names, contracts and store every part of turnscope stands on. It imports
nothing of turnscope's above it (docs/design.md)."""
