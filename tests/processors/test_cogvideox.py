import pytest
import torch
from diffusers import CogVideoXTransformer3DModel
from diffusers.models.attention_processor import CogVideoXAttnProcessor2_0
from diffusers.models.embeddings import get_3d_rotary_pos_embed

import videosparse
from videosparse.processors import sessions

from tester import RANDOM_GRID_TILINGS, ProcessorTesterMixin, check_any_grid, check_blocks_attn1_served

TEXT = 8


class TestCogVideoXProcessors(ProcessorTesterMixin):
    """CogVideoX 1.0 (5B-like: RoPE, no temporal patch); text before the video."""

    patch_size_t = None
    frames = 3

    def make_transformer(self):
        torch.manual_seed(0)
        return CogVideoXTransformer3DModel(
            num_attention_heads=2, attention_head_dim=self.head_dim, in_channels=4, out_channels=4,
            time_embed_dim=32, text_embed_dim=16, num_layers=self.num_layers, sample_width=36, sample_height=14,
            sample_frames=9, patch_size=2, patch_size_t=self.patch_size_t, max_text_seq_length=TEXT,
            use_rotary_positional_embeddings=True,
        ).eval()

    def make_inputs(self, transformer, frames=None, height=14, width=36, seed=1):
        """Latents of `frames` (default the class's) x height x width; the default grid after patching is
        3 x 7 x 18 = 378 video tokens after 8 text tokens."""
        g = torch.Generator().manual_seed(seed)
        frames = frames or self.frames
        grid = (frames // (self.patch_size_t or 1), height // 2, width // 2)
        if self.patch_size_t is None:
            rope = get_3d_rotary_pos_embed(self.head_dim, ((0, 0), grid[1:]), grid[1:], grid[0])
        else:   # as CogVideoXPipeline builds it for CogVideoX 1.5
            rope = get_3d_rotary_pos_embed(self.head_dim, None, grid[1:], grid[0], grid_type="slice", max_size=grid[1:])
        return dict(
            hidden_states=torch.randn(1, frames, 4, height, width, generator=g),    # (B, F, C, H, W)
            encoder_hidden_states=torch.randn(1, TEXT, 16, generator=g),
            timestep=torch.tensor([500]),
            image_rotary_emb=rope,
        )


class TestCogVideoX15Processors(TestCogVideoXProcessors):
    """CogVideoX 1.5: temporal patch 2 (6 latent frames -> 3 token frames)."""

    patch_size_t = 2
    frames = 6


def test_sparse_runs_on_attn1_with_text_first():
    _, _, records, out, dense = check_blocks_attn1_served(TestCogVideoXProcessors(), CogVideoXAttnProcessor2_0)
    assert (out - dense).norm() / dense.norm() < 0.5
    r = records[0]
    assert r.grid == (3, 7, 18) and r.text_len == TEXT and r.text_position == "before"


def test_sol_runs_and_no_rope_variant_matches_stock():
    """Sol serves the text-first layout; CogVideoX 2B-style (sincos positions, no RoPE) at density 1.0 is stock."""
    t = TestCogVideoXProcessors()
    tr = t.make_transformer()
    inputs = t.make_inputs(tr)
    videosparse.apply(tr, videosparse.SolConfig(density=0.5, block=t.block))
    assert torch.isfinite(t.run(tr, inputs)).all() and sessions(tr)["transformer"].stats()["sparse_calls"] == 2
    torch.manual_seed(0)
    tr = CogVideoXTransformer3DModel(**dict(tr.config, use_rotary_positional_embeddings=False)).eval()
    inputs = dict(inputs, image_rotary_emb=None)
    ref = t.run(tr, inputs)
    videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    assert (t.run(tr, inputs) - ref).abs().max() <= 1e-5


def test_synthetic_cogvideox_shrunken_runs_sparse():
    """`--synthetic cogvideox` (CogVideoX-5B architecture) feeds the transformer the pipeline's inputs; one layer
    on CPU."""
    from videosparse.eval.spec import parse_method_specs
    from videosparse.eval.synthetic import run_synthetic_model, synthetic_setup

    assert synthetic_setup("cogvideox").grid == (13, 30, 45)
    specs = parse_method_specs(["veda@0.5:block=64:tiling=1x8x8"])
    result = run_synthetic_model("cogvideox", specs, "cpu", torch.float32, frames=9, height=128, width=128, layers=1,
                                 warmup=0, repeats=1, progress=False)
    assert result.setup.grid == (3, 8, 8)
    row = result.methods["veda@0.5:block=64:tiling=1x8x8"]
    assert row["sparse_calls"] == 1 and row["dense_calls"] == 0 and row["fallbacks"] == []
    assert 0.5 < row["realised_density"] < 1.0 and 0 < row["output_rel_l2_vs_dense"] < 0.5


@pytest.mark.parametrize("seed", range(3))
def test_random_grids_text_first(seed):
    """Any frame count and resolution with the text before the video (CogVideoX 1.0 and 1.5 drawn): at density 1
    the sparse forward equals the stock one; Sol runs finite."""
    import random

    rng = random.Random(seed)
    t = rng.choice([TestCogVideoXProcessors(), TestCogVideoX15Processors()])
    frames, height, width = (t.patch_size_t or 1) * rng.randint(1, 4), 2 * rng.randint(1, 12), 2 * rng.randint(1, 12)
    tr = t.make_transformer()
    inputs = t.make_inputs(tr, frames, height, width, seed=seed)
    check_any_grid(t, tr, inputs, rng.choice(RANDOM_GRID_TILINGS), label=(frames, height, width))
