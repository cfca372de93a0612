"""The examples in the public docstrings run and show what the code returns (every module of the package that has
some; examples that need a hub model or a GPU are marked `# doctest: +SKIP`)."""

import doctest
import importlib
import pkgutil

import pytest

import videosparse

MODULES = sorted(m.name for m in pkgutil.walk_packages(videosparse.__path__, "videosparse."))


def test_the_modules_with_examples_are_found():
    assert {"videosparse.config", "videosparse.eval.spec", "videosparse.veda.estimator", "videosparse.sol.method",
            "videosparse.kernels", "videosparse.veda.teacher"} <= set(MODULES)


@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
