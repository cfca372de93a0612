"""The examples in the public docstrings run and show what the code returns."""

import doctest
import importlib

import pytest


@pytest.mark.parametrize("module", ["videosparse.config", "videosparse.eval.spec", "videosparse.veda.estimator"])
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
