"""Integer helpers shared by the pure-Python bookkeeping and the tensor code (no imports)."""


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative ints: the blocks ``a`` tokens need at block size ``b``."""
    return -(-a // b)
