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
    from videosparse.eval.synthetic import run_synthetic_model
    from videosparse.eval.synthetic_models import synthetic_setup

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


def test_a_from_pipe_pipeline_counts_its_own_steps_after_the_applied_one_ran():
    """Review find: CogVideoX's schedulers have no step counter, so a `from_pipe` pipeline with its own scheduler,
    run after the applied pipeline, looked its timesteps up in that pipeline's finished schedule (10 steps: its 4
    steps read as 0, 2, 5, 7, one of its 2 dense steps sparse). A schedule a call left unchanged now means another
    pipeline drives the call, which counts its own steps."""
    from diffusers import CogVideoXDDIMScheduler, CogVideoXPipeline
    from transformers import T5Config, T5EncoderModel

    from videosparse.models.tiny_wan import TINY_VOCAB, build_tiny_tokenizer

    torch.manual_seed(0)
    encoder = T5EncoderModel(T5Config(vocab_size=len(TINY_VOCAB), d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                      num_heads=2, relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1,
                                      decoder_start_token_id=0)).eval()
    transformer = CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=4, time_embed_dim=32,
        text_embed_dim=16, num_layers=2, sample_width=12, sample_height=8, sample_frames=9, patch_size=2,
        max_text_seq_length=16, use_rotary_positional_embeddings=True).eval()
    scheduler = CogVideoXDDIMScheduler(timestep_spacing="trailing", rescale_betas_zero_snr=True,
                                       prediction_type="v_prediction")
    pipe = CogVideoXPipeline(tokenizer=build_tiny_tokenizer(), text_encoder=encoder, vae=None, transformer=transformer,
                             scheduler=scheduler)
    pipe.set_progress_bar_config(disable=True)
    session = videosparse.apply(pipe, videosparse.VedaConfig(density=0.5, tiling=(1, 4, 16), block=64,
                                                             dense_steps=2))["transformer"]

    def steps(p, n):
        seen = []
        session.observers.append(lambda r: r.layer == 0 and seen.append((r.step, r.dense_reason is not None)))
        try:
            p(prompt="a red circle moving left", negative_prompt="blue", num_frames=9, height=64, width=96,
              output_type="latent", max_sequence_length=16, num_inference_steps=n,
              generator=torch.Generator().manual_seed(0))
        finally:
            session.observers.clear()
        return seen

    assert steps(pipe, 10) == [(i, i < 2) for i in range(10)]
    other = CogVideoXPipeline.from_pipe(pipe, scheduler=CogVideoXDDIMScheduler.from_config(pipe.scheduler.config))
    assert steps(other, 4) == [(i, i < 2) for i in range(4)]
    assert steps(pipe, 4) == [(i, i < 2) for i in range(4)]
    videosparse.remove(pipe)


def test_fuse_qkv_projections_before_or_after_apply(caplog):
    """Review finds: diffusers' CogVideoX fuse_qkv_projections() saves the processors and swaps in fused ones, and
    unfuse_qkv_projections() puts the saved ones back. Fused before apply, unfused after: the layers went stock
    with the session attached, silently; fused after apply: silently dense; removed, then unfused: the removed
    session's processors came back and ran sparse. Now unfuse keeps the sparse processors, a fuse after apply is
    warned about, and remove leaves the saved processors stock."""
    tester = TestCogVideoXProcessors()
    tr = tester.make_transformer()
    inputs = tester.make_inputs(tr)

    def run():
        with torch.no_grad():
            return tr(**inputs, return_dict=False)[0]

    stock = run()
    config = videosparse.VedaConfig(density=0.5, block=64, tiling=(1, 8, 8))
    session = videosparse.apply(tr, config)["transformer"]
    sparse = run()
    assert not torch.allclose(sparse, stock)
    videosparse.remove(tr)

    tr.fuse_qkv_projections()                                    # fused, then applied, then unfused
    session = videosparse.apply(tr, config)["transformer"]
    torch.testing.assert_close(run(), sparse)
    tr.unfuse_qkv_projections()
    before = session.stats()["sparse_calls"]
    torch.testing.assert_close(run(), sparse)
    assert session.stats()["sparse_calls"] > before
    videosparse.remove(tr)
    assert all(type(p) is CogVideoXAttnProcessor2_0 for n, p in tr.attn_processors.items() if "attn1" in n)
    torch.testing.assert_close(run(), stock)

    session = videosparse.apply(tr, config)["transformer"]       # applied, then fused: a warning
    tr.fuse_qkv_projections()
    with caplog.at_level("WARNING", logger="videosparse"):
        torch.testing.assert_close(run(), stock)
    assert "hold other processors than it set" in caplog.text
    videosparse.remove(tr)
    tr.unfuse_qkv_projections()                                  # the saved processors are stock again
    assert not any(hasattr(p, "session") for p in tr.attn_processors.values())
    torch.testing.assert_close(run(), stock)
