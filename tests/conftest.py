import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


_BACKGROUND_CHILDREN: list = []


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


@pytest.fixture(scope="module")
def interpreter_results(request) -> dict:
    """{case name: result dict} of the module's `INTERPRETER_CASES` (helpers.InterpreterCases), run under the
    Triton interpreter in a child process."""
    return request.module.INTERPRETER_CASES.results()


def pytest_collection_finish(session):
    """Start the interpreter children of the selected tests in the background (not in an xdist worker, which
    cannot know which of its tests it will run): the parent only waits on them, so they run beside the tests."""
    from helpers import InterpreterCases, run_interpreter_children_in_background

    if os.environ.get("PYTEST_XDIST_WORKER") or session.config.option.collectonly:
        return
    for item in session.items:
        children = getattr(getattr(item, "module", None), "INTERPRETER_CASES", None)
        if (isinstance(children, InterpreterCases) and "interpreter_results" in getattr(item, "fixturenames", ())
                and children not in _BACKGROUND_CHILDREN):
            _BACKGROUND_CHILDREN.append(children)
    if _BACKGROUND_CHILDREN:
        run_interpreter_children_in_background(_BACKGROUND_CHILDREN)


def pytest_sessionfinish(session):
    for children in _BACKGROUND_CHILDREN:
        children.stop()
