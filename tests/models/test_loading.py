"""Size checks of `videosparse.models.loading` before a pipeline call."""

import pytest

from videosparse.models.loading import check_size
from videosparse.models.tiny_wan import build_tiny_wan_pipeline


def test_a_video_past_the_rope_tables_is_named_before_the_call():
    """Review find: `videosparse generate --frames 1100 --height 4 --width 4` on the reference model (1,100 latent
    frames, its RoPE tables hold 1,024) failed deep in diffusers' RoPE with "shape '[1100, 1, 1, -1]' is invalid"; the
    size check names the flag and the largest value the transformer's `rope_max_seq_len` takes."""
    pipe = build_tiny_wan_pipeline()
    limit = pipe.transformer.config.rope_max_seq_len
    temporal = pipe.vae_scale_factor_temporal
    spatial = pipe.vae_scale_factor_spatial * pipe.transformer.config.patch_size[1]
    largest_frames = (limit - 1) * temporal + 1
    check_size(pipe, {"num_frames": largest_frames, "height": limit * spatial, "width": 16})
    check_size(pipe, {"num_frames": largest_frames + temporal - 2})       # rounded down to largest_frames
    # (a frame count the pipeline rounds up past the tables too: 4 x limit becomes 4 x limit + 1, review find)
    for call, flag, largest in (({"num_frames": largest_frames + temporal}, "frames", largest_frames),
                                ({"num_frames": largest_frames + temporal - 1}, "frames", largest_frames),
                                ({"height": (limit + 1) * spatial}, "height", limit * spatial),
                                ({"width": (limit + 1) * spatial}, "width", limit * spatial)):
        with pytest.raises(ValueError, match=rf"--{flag}=\d+ gives {limit + 1} patches along it, past the {limit} "
                                             rf"that WanTransformer3DModel's RoPE tables hold .* at most {largest}\."):
            check_size(pipe, call)


def _write_index(folder, **parts):
    import json

    index = {"_class_name": "WanPipeline", "_diffusers_version": "0.33.0", **parts}
    (folder / "model_index.json").write_text(json.dumps(index))


def test_check_component_refuses_a_component_the_index_lists_as_null(tmp_path):
    """Mutation find: Wan 2.1's model_index.json lists `"transformer_2": [null, null]`; counted as present, the check
    let `--component transformer_2` through to a failure after the weights load. It is named as absent, with the
    model's transformers, while a component that is there passes."""
    from videosparse.models.loading import check_component

    _write_index(tmp_path, transformer=["diffusers", "WanTransformer3DModel"], transformer_2=[None, None],
                 vae=["diffusers", "AutoencoderKLWan"])
    check_component(str(tmp_path), "transformer")
    with pytest.raises(ValueError, match=r"component='transformer_2': .* has no such component \(its model_index.json "
                                         r"lists transformer, vae\); its transformers: transformer\."):
        check_component(str(tmp_path), "transformer_2")


def test_size_stub_builds_no_pipeline_that_has_a_safety_checker(tmp_path, monkeypatch):
    """Mutation find: `size_stub` must not construct a pipeline with a `safety_checker` (Cosmos's constructor loads
    its guardrail models when given none); offline that constructor failed anyway, so no test noticed. A recording
    pipeline class stands in: the same folder without a safety checker is built into a stub, with one it is not."""
    import diffusers

    from videosparse.models.loading import size_stub

    built = []

    class RecordingPipeline:
        vae_scale_factor_spatial, vae_scale_factor_temporal, video_processor = 8, 4, None

        def __init__(self, **kwargs):
            built.append(sorted(kwargs))

    monkeypatch.setattr(diffusers, "RecordingPipeline", RecordingPipeline, raising=False)
    pipe = build_tiny_wan_pipeline(num_layers=1)
    pipe.transformer.save_config(str(tmp_path / "transformer"))
    pipe.vae.save_config(str(tmp_path / "vae"))
    parts = dict(_class_name="RecordingPipeline", transformer=["diffusers", "WanTransformer3DModel"],
                 vae=["diffusers", "AutoencoderKLWan"])
    _write_index(tmp_path, **parts)
    stub = size_stub(str(tmp_path))
    assert stub is not None and built == [["transformer", "vae"]]
    assert stub.transformer.config.patch_size == list(pipe.transformer.config.patch_size)
    _write_index(tmp_path, **parts, safety_checker=["cosmos_guardrail", "CosmosSafetyChecker"])
    assert size_stub(str(tmp_path)) is None
    assert built == [["transformer", "vae"]]            # not constructed a second time
