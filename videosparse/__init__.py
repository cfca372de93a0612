"""videosparse: tile-sparse attention for video diffusion transformers in diffusers.

    import videosparse
    videosparse.apply(pipe, videosparse.VedaConfig(density=0.1))
    video = pipe(prompt).frames[0]
    videosparse.remove(pipe)

The diffusers-native form: `pipe.transformer.set_attn_processor(videosparse.processors(pipe.transformer, cfg))`.
`apply`, `remove`, `sessions`, `observe`, `processors`, `VedaEstimator` (the trained estimator of
`videosparse.veda`) and the subpackages (`videosparse.models`, ...) are imported on first use, so
`import videosparse` does not import diffusers.
"""

import importlib as _importlib

from .config import DenseConfig, SolConfig, VedaConfig

__version__ = "0.1.0"

__all__ = ["apply", "remove", "sessions", "observe", "processors", "DenseConfig", "SolConfig", "VedaConfig",
           "VedaEstimator", "__version__"]


_SUBPACKAGES = ("distill", "eval", "kernels", "layout", "models", "plan", "rope", "sol", "veda")


def __getattr__(name):
    if name in ("apply", "remove", "sessions", "observe", "processors"):
        module = _importlib.import_module(".processors", __name__)
        return module if name == "processors" else getattr(module, name)
    if name == "VedaEstimator":
        return _importlib.import_module(".veda", __name__).VedaEstimator
    if name in _SUBPACKAGES:             # `videosparse.models.load_reference_pipeline()` after `import videosparse`
        return _importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'videosparse' has no attribute {name!r}")


def __dir__():
    """The lazily imported API too (tab completion, `dir(videosparse)`)."""
    return sorted({name for name in globals() if not name.startswith("_")} | set(__all__) | set(_SUBPACKAGES))
