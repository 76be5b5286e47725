"""Data files shipped with the package (eval-cache's default text)."""
