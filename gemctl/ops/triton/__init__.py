"""Bundled Triton kernels. Each module registers its op in ``gemctl.ops.triton_kernels``."""
