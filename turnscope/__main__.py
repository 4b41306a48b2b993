"""``python -m turnscope``: the ``turnscope`` command (``turnscope.commands``)."""

from turnscope.commands import app

app()
