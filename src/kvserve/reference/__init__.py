"""The lesson as code: the no-cache and dense-cache decoders (decoders.py), the single-sequence
loop (generation.py), its CLI jobs (sessions.py) and `kvserve verify` (verify.py)."""
