"""videosparse: tile-sparse attention for video diffusion transformers in diffusers.

    import videosparse
    videosparse.apply(pipe, videosparse.VedaConfig(density=0.1))
    video = pipe(prompt).frames[0]
    videosparse.remove(pipe)

The diffusers-native form: `pipe.transformer.set_attn_processor(videosparse.processors(pipe.transformer, cfg))`.
`apply`, `remove`, `sessions`, `observe` and `processors` are imported on first use, so `import videosparse`
does not import diffusers.
"""

import importlib

from .config import DenseConfig, SolConfig, VedaConfig

__version__ = "0.1.0"

__all__ = ["apply", "remove", "sessions", "observe", "processors", "DenseConfig", "SolConfig", "VedaConfig",
           "__version__"]


def __getattr__(name):
    if name in ("apply", "remove", "sessions", "observe", "processors"):
        module = importlib.import_module(".processors", __name__)
        return module if name == "processors" else getattr(module, name)
    raise AttributeError(f"module 'videosparse' has no attribute {name!r}")


def __dir__():
    """The lazily imported API too (tab completion, `dir(videosparse)`)."""
    return sorted(set(globals()) | set(__all__))
