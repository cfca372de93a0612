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
