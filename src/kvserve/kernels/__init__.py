"""kvserve's C++ CPU kernels (`build.py` compiles `csrc/*.cpp` into `torch.ops.kvserve`) and
the pure-PyTorch references they are tested against (`quant_ref.py`)."""
