"""videosparse.models: model builders (the trained reference model, the tiny random Wan pipeline).

`load_reference_pipeline` and `ReferenceVideoPipeline` are imported lazily (they need diffusers).
"""

_LAZY = {
    "load_reference_pipeline": "reference",
    "build_reference_pipeline": "reference",
    "ReferenceVideoPipeline": "reference",
    "REFERENCE_CALL_DEFAULTS": "reference",
}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
