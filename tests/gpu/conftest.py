import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU (CUDA not available)")
        for item in items:
            if "tests/gpu/" in str(item.fspath):
                item.add_marker(skip)
