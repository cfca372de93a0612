import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _restore_attention_backend():
    """`ModelMixin.set_attention_backend` also sets diffusers' process-wide active backend: restore it after each
    test, so that a test on flex (Kandinsky's NABLA) does not change the backend of the stock calls of later tests."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    backend, _ = _AttentionBackendRegistry.get_active_backend()
    yield
    _AttentionBackendRegistry.set_active_backend(backend)


os.environ.setdefault("HF_HUB_OFFLINE", "1")
