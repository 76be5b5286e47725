"""Attention backends: the protocol the model calls (backend.py), the engine's paged backend
(paged.py), the dense-cache one (dense.py) and the no-cache one (no_cache.py)."""
