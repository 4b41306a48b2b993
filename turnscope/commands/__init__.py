"""The ``turnscope`` command: one module per family of commands, on one Typer application.

Settings (store, model, ports, connector, timeouts) come from options, ``TURNSCOPE_*`` environment
variables and a config file (``--config`` or ``TURNSCOPE_CONFIG``), in that order
(``turnscope.conductor.settings``, docs/configuration.md); the effective configuration is saved
with every run. Importing a family's module registers its commands on :data:`app`.
"""

from turnscope.commands import forecast, measure, run  # noqa: F401  (each registers its commands)
from turnscope.commands.app import app

__all__ = ["app"]
