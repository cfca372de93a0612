"""videosparse.models: model builders (the trained reference model, the tiny random Wan pipeline).

`load_reference_pipeline`, `ReferenceVideoPipeline` and `build_tiny_wan_pipeline` are imported lazily (they need
diffusers).
"""

_LAZY = {
    "load_reference_pipeline": "reference",
    "build_reference_pipeline": "reference",
    "ReferenceVideoPipeline": "reference",
    "REFERENCE_CALL_DEFAULTS": "reference",
    "build_tiny_wan_pipeline": "tiny_wan",
}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
