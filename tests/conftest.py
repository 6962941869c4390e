import os

import pytest
import torch

# Tests import the package from the checkout; keep CPU runs reproducible and small.
os.environ.setdefault("GEMCTL_THREADS", "2")
# Without a GPU, Triton kernels run under the interpreter (set before any kernel is defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Correctness tests run the first kernel config of each list instead of timing every candidate.
os.environ.setdefault("GEMCTL_AUTOTUNE", "0")
# Tests that time candidates (with fakes) keep their picks out of the user's on-disk autotune cache.
os.environ.setdefault("GEMCTL_AUTOTUNE_CACHE", "0")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    import logging

    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
