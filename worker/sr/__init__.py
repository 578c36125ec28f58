"""Tiled Kandinsky 6 video super-resolution on diffusers' components. Importable without Celery, Flask or a GPU."""
