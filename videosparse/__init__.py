"""videosparse: tile-sparse attention for video diffusion transformers in diffusers.

    import videosparse
    videosparse.apply(pipe, videosparse.VedaConfig(density=0.1))
    ...
    videosparse.remove(pipe)
"""

from .config import DenseConfig, SolConfig, VedaConfig

__version__ = "0.1.0"

__all__ = ["DenseConfig", "SolConfig", "VedaConfig", "__version__"]
