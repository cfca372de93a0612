"""Errors of the per-model registry name what was passed and what to pass instead."""

import pytest
import torch

import videosparse
from videosparse.models.tiny_wan import build_tiny_wan_pipeline


def test_a_pipeline_given_for_a_transformer_says_what_to_pass():
    pipe = build_tiny_wan_pipeline()
    with pytest.raises(ValueError, match=r"WanPipeline is a pipeline.*pipe\.transformer.*videosparse\.apply\(pipe"):
        videosparse.processors(pipe, videosparse.VedaConfig())
    assert videosparse.processors(pipe.transformer, videosparse.DenseConfig())
    videosparse.remove(pipe.transformer)


def test_an_unknown_module_lists_the_supported_transformers():
    with pytest.raises(ValueError, match=r"class Linear is not supported; supported: .*WanTransformer3DModel"):
        videosparse.processors(torch.nn.Linear(2, 2), videosparse.VedaConfig())
