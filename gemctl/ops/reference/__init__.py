"""Plain PyTorch references of the gemctl.ops kernels: padded, float32/float64-capable, autograd."""
