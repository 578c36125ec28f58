"""The client side of vsrq: the HTTP client, `vsrq bulk` and the `vsrq` command. Needs requests-level packages
only (no torch, PyAV, Flask, Celery or pydantic): tests/test_layers.py keeps it so."""
