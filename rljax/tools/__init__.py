"""Command tools: what the ``rljax`` commands run on top of the library (``rljax plan``)."""
