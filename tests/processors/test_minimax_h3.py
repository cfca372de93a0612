"""MiniMax-H3 (MiniMaxH3Transformer3DModel): the blocks' attn over the packed [text | keyframes | audio | video]
sequence served, the generated video (the trailing rows) as the grid and every row before it as global tiles; the
token refiner's attn stock; a sequence not ending in one video grid, and masked calls, stock with one warning.

The inputs are laid out by the pipeline's own `MiniMaxH3PrepareLayoutStep.build_packed_sequence` and timed by
`MiniMaxH3SetTimestepsStep.build_row_timesteps`, as the fl2va workflow calls the transformer.
"""

import logging

import pytest
import torch
from diffusers import MiniMaxH3Scheduler, MiniMaxH3Transformer3DModel
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor
from diffusers.modular_pipelines.minimax_h3.before_denoise import (
    MiniMaxH3PrepareLayoutStep,
    MiniMaxH3SetTimestepsStep,
    patchify_video_latents,
)
from tester import (
    ProcessorTesterMixin,
    assert_batch_items_sparse_as_alone,
    assert_runs_stock_with_one_warning,
    check_blocks_attn1_served,
    check_extra_tokens_served_as_global_tiles,
)

import videosparse
from videosparse.processors import attention_processors, observe, sessions
from videosparse.processors.minimax import MiniMaxH3SparseAttnProcessor, minimax_grid

LATENT = (4, 14, 20)           # latent frames x height x width -> patches 4 x 7 x 10 = 280 tokens, a partial last tile
GRID = (4, 7, 10)
TEXT, AUDIO_LATENTS, AUDIO_CHANNELS = 8, 5, 2
# before the video: 8 text rows, one "first" keyframe (7 x 10 = 70 rows), 5 audio latents x 2 channels
EXTRA = TEXT + 70 + AUDIO_LATENTS * AUDIO_CHANNELS
SERVED = ["transformer_blocks.0.attn.processor", "transformer_blocks.1.attn.processor"]
REFINER = ["token_refiner.refiner_blocks.0.attn.processor"]
BATCHED = ("hidden_states", "audio_hidden_states", "encoder_hidden_states")
TEXT_DIM, VIDEO_CHANNELS, AUDIO_DIM = 16, 24, 32     # 24 / 32: the pipeline's latent channels when it has no VAEs


def tiny_minimax(**kwargs):
    """A tiny MiniMaxH3Transformer3DModel (patch (1, 2, 2), 2 heads of 64, 2 blocks, 1 token-refiner block, RoPE on
    2 x 3 x 8 of the 64 channels of each head), with the pipeline's 24 video / 32 audio latent channels."""
    config = dict(num_attention_heads=2, attention_head_dim=64, hidden_size=32, num_layers=2, num_refiner_layers=1,
                  ffn_dim=64, in_channels=VIDEO_CHANNELS, audio_in_channels=AUDIO_DIM, text_dim=TEXT_DIM,
                  freq_dim=32, time_embed_hidden_dim=32, time_embed_dim=16, rope_freq_dim=8)
    config.update(kwargs)
    torch.manual_seed(0)
    return MiniMaxH3Transformer3DModel(**config).eval()


def layout(latent=LATENT, anchors=("first",), audio_latents=AUDIO_LATENTS):
    """The fl2va packed layout [text | keyframes | target audio | target video] of the pipeline (two text rows tagged
    as video, like a keyframe's vision block): position_ids, token_tags, the three index tensors, conditioning rows."""
    tags = torch.ones(TEXT, dtype=torch.long)
    tags[2:4] = 0
    return MiniMaxH3PrepareLayoutStep.build_packed_sequence(tags, *latent, audio_latents, (1, 2, 2), AUDIO_CHANNELS,
                                                            2, 0, anchors)


def minimax_inputs(batch=1, seed=1, anchors=("first",)):
    """As MiniMaxH3LoopDenoiser calls the transformer (video at t = 0.3, audio at 0.5, the keyframe held at 0.999);
    the layout tensors describe one packed sequence that every batch item shares."""
    positions, tags, video, audio, text, conditions, _ = layout(anchors=anchors)
    timestep, timestep_indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        video, audio, conditions, 0, TEXT, 0.3, 0.5, 0.999, 1.0)
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(batch, video.numel(), VIDEO_CHANNELS * 4, generator=g),
                audio_hidden_states=torch.randn(batch, audio.numel(), AUDIO_DIM, generator=g),
                encoder_hidden_states=torch.randn(batch, TEXT, TEXT_DIM, generator=g),
                timestep=timestep, timestep_indices=timestep_indices, token_tags=tags, position_ids=positions,
                video_indices=video, audio_indices=audio, text_indices=text)


def repack(inputs: dict, order: torch.Tensor) -> dict:
    """`inputs` with the packed sequence reordered (new row j = old row order[j]); the rows of each modality keep their
    order in hidden_states / audio / text, so the model computes the same thing (its RoPE reads position_ids)."""
    new_place = torch.empty_like(order)
    new_place[order] = torch.arange(order.numel())
    out = dict(inputs)
    for name in ("position_ids", "token_tags", "timestep_indices"):
        out[name] = inputs[name][order]
    for name in ("video_indices", "audio_indices", "text_indices"):
        out[name] = new_place[inputs[name]]
    return out


class TestMiniMaxH3Processors(ProcessorTesterMixin):
    """MiniMax-H3 fl2va: 280 video rows after 8 text, 70 keyframe and 10 audio rows."""

    def make_transformer(self):
        return tiny_minimax()

    def make_inputs(self, transformer):
        return minimax_inputs()


def _tiny():
    t = TestMiniMaxH3Processors()
    return t, t.make_transformer()


def test_serves_only_the_blocks_attn():
    """transformer_blocks.<i>.attn is replaced, the token refiner's attn keeps its processor object; one forward runs
    sparse on every served layer with the rows before the video as extra tokens before it."""
    tr, before, records, _, _ = check_blocks_attn1_served(TestMiniMaxH3Processors(), MiniMaxH3AttnProcessor, SERVED)
    after = attention_processors(tr)
    assert all(type(after[n]) is MiniMaxH3SparseAttnProcessor for n in SERVED)
    assert sorted(n for n in before if n not in SERVED) == REFINER
    assert [(r.layer, r.grid, r.text_len, r.text_position) for r in records] == [
        (i, GRID, EXTRA, "before") for i in range(2)]


def test_token_order_facts():
    """diffusers' facts the grid relies on: `patchify_video_latents` flattens (T, H, W) patches time-major, the layout
    ends with the generated video, whose position_ids are the time-major meshgrid, and `minimax_grid` reports that
    grid with every other row before it (t2va: text and audio; fl2va: also the keyframes)."""
    T, H, W = LATENT
    rows = patchify_video_latents(torch.arange(T * H * W, dtype=torch.float32).reshape(1, 1, T, H, W), (1, 2, 2))
    t, h, w = torch.meshgrid(*(torch.arange(n) for n in GRID), indexing="ij")
    assert torch.equal(rows[:, 0], (t * H * W + 2 * h * W + 2 * w).flatten().float())
    video = GRID[0] * GRID[1] * GRID[2]
    for anchors, extra in (((), TEXT + 10), (("first",), EXTRA), (("first", "last"), EXTRA + 70)):
        positions, tags, video_indices = layout(anchors=anchors)[:3]
        assert torch.equal(video_indices[-video:], torch.arange(positions.shape[0] - video, positions.shape[0]))
        assert (tags[-video:] == 0).all() and positions.shape[0] == video + extra
        tail = positions[-video:].reshape(*GRID, 3)
        assert (tail[..., 0] == tail[:, :1, :1, 0]).all() and (tail[..., 1] == tail[:1, :, :1, 1]).all()
        assert (tail[..., 2] == tail[:1, :1, :, 2]).all() and (tail[1:, 0, 0, 0] > tail[:-1, 0, 0, 0]).all()
        assert minimax_grid(None, (), dict(position_ids=positions, video_indices=video_indices)) == (GRID, extra, None)


def test_rows_before_the_video_served_as_global_tiles(caplog):
    t, tr = _tiny()
    check_extra_tokens_served_as_global_tiles(t, tr, t.make_inputs(tr), GRID, EXTRA, "before", caplog)


def test_batch_of_two(caplog):
    """A batch of two (the layout shared): density 1 equals stock, each item at density 0.5 as if it ran alone."""
    t, tr = _tiny()
    inputs = minimax_inputs(batch=2)
    ref = t.run(tr, inputs)
    videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    assert (t.run(tr, inputs) - ref).abs().max() <= 1e-5
    videosparse.remove(tr)
    assert_batch_items_sparse_as_alone(t, tr, inputs, 2, caplog,
                                       item=lambda name, v, b: v[b:b + 1] if name in BATCHED else v)


def test_fused_projections_and_sol():
    """With fused q/k/v projections (`fuse_qkv_projections`) density 1 equals the fused stock forward; Sol runs
    sparse."""
    t, tr = _tiny()
    inputs = t.make_inputs(tr)
    tr.fuse_qkv_projections()
    assert all(b.attn.fused_projections for b in tr.transformer_blocks)
    ref = t.run(tr, inputs)
    videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    assert (t.run(tr, inputs) - ref).abs().max() <= 1e-5
    assert sessions(tr)["transformer"].stats()["sparse_calls"] == 2
    videosparse.remove(tr)
    videosparse.apply(tr, videosparse.SolConfig(density=0.5, block=t.block))
    assert torch.isfinite(t.run(tr, inputs)).all()
    assert sessions(tr)["transformer"].stats()["sparse_calls"] == 2


def _audio_last(n: int) -> torch.Tensor:
    """Order [text; keyframe; video; audio]: the audio rows moved behind the video."""
    audio = torch.arange(TEXT + 70, TEXT + 70 + 10)
    video = torch.arange(TEXT + 70 + 10, n)
    return torch.cat([torch.arange(TEXT + 70), video, audio])


def _video_width_major(n: int) -> torch.Tensor:
    """The layout's order with the generated video's rows (t, w, h)-major instead of (t, h, w)-major."""
    video = torch.arange(n - 280, n).reshape(GRID).transpose(1, 2).flatten()
    return torch.cat([torch.arange(n - 280), video])


@pytest.mark.parametrize("order, reason", [(_audio_last, "does not end with video rows"),
                                           (_video_width_major, "not one time-major (t, h, w) grid")])
def test_sequence_not_ending_in_the_video_grid_runs_stock(order, reason, caplog):
    """A packing the pipeline never makes (the transformer takes any): the stock model computes the same output
    (its RoPE follows position_ids), and the forward keeps the stock processor with one warning per layer."""
    t, tr = _tiny()
    inputs = t.make_inputs(tr)
    moved = repack(inputs, order(inputs["position_ids"].shape[0]))
    assert (t.run(tr, moved) - t.run(tr, inputs)).abs().max() <= 1e-5
    assert minimax_grid(tr, (), moved)[2] is not None
    assert_runs_stock_with_one_warning(t, tr, moved, reason, caplog)


def masked_minimax():
    """(tester, tiny transformer, inputs) whose blocks' attn are given a causal mask (MiniMax-H3 passes none)."""
    t, tr = _tiny()
    inputs = t.make_inputs(tr)
    n = inputs["position_ids"].shape[0]
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    for block in tr.transformer_blocks:
        block.attn.register_forward_pre_hook(lambda module, args: args[:2] + (mask,))
    return t, tr, inputs


def test_masked_calls_run_stock_with_one_warning(caplog):
    """MiniMax-H3 passes no mask; a (causal) mask given to the blocks' attn all the same runs the stock processor, with
    one warning per layer."""
    t, tr, inputs = masked_minimax()
    assert_runs_stock_with_one_warning(t, tr, inputs, "attention mask", caplog)


def test_published_config():
    """MiniMax-H3 at its defaults (50 blocks, 56 heads of 128, patch (1, 2, 2)) and the pipeline's t2va defaults (768 x
    1344, 124 frames: 37 latent frames of 48 x 84, 207 audio latents per channel): 37 x 24 x 42 = 37,296 video rows
    after the text and 414 audio rows."""
    from videosparse.processors import self_attention_processors
    from videosparse.processors.registry import model_info, model_spec

    with torch.device("meta"):
        tr = MiniMaxH3Transformer3DModel()
    positions, _, video_indices = layout((37, 48, 84), anchors=(), audio_latents=207)[:3]
    assert minimax_grid(tr, (), dict(position_ids=positions, video_indices=video_indices)) == (
        (37, 24, 42), TEXT + 414, None)
    spec = model_spec(tr)
    info = model_info(tr, spec, len(self_attention_processors(tr)))
    assert (info.num_layers, info.num_heads, info.head_dim, info.patch_size) == (50, 56, 128, (1, 2, 2))
    assert info.text_position == "before"


def test_tiny_pipeline_end_to_end(caplog):
    """The fl2va core denoising workflow of `MiniMaxH3ModularPipeline` (`MiniMaxH3FL2VACoreDenoiseStep`: layout, noise
    around first and last keyframe latents, both schedules, the loop, unpacking; 4 schedule points = 3 forwards) on
    the tiny transformer: the first step dense, the others sparse on every layer with the text, keyframe and audio
    rows as global tiles and no fallback; remove() restores it. The text encoder (Qwen3-VL, read at its 50th hidden
    state, with its processor from the hub) and the two VAEs are left out: the prompt embeddings and the keyframe
    latents are given."""
    from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3FL2VACoreDenoiseStep

    pipe = MiniMaxH3FL2VACoreDenoiseStep().init_pipeline()
    pipe.update_components(transformer=tiny_minimax(), scheduler=MiniMaxH3Scheduler(shift=12.0),
                           audio_scheduler=MiniMaxH3Scheduler(shift=3.0))
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(0)
    # 96 x 160 pixels -> 6 x 10 latents -> 3 x 5 patches; 124 frames -> 37 latent frames, 207 audio latents
    kw = dict(prompt_embeds=torch.randn(1, TEXT, TEXT_DIM, generator=g), text_token_tags=torch.ones(TEXT).long(),
              height=96, width=160, num_frames=124, keyframe_anchors=("first", "last"), num_inference_steps=4,
              condition_latents=[torch.randn(1, VIDEO_CHANNELS, 1, 6, 10, generator=g) for _ in range(2)])

    def run():
        return pipe(**kw, generator=torch.Generator().manual_seed(0), output="latents")

    ref = run()
    handle = videosparse.apply(pipe, videosparse.VedaConfig(density=0.3, tiling=(1, 4, 16), block=64, dense_steps=1))
    seen = set()
    with caplog.at_level(logging.WARNING, logger="videosparse"), \
            observe(pipe, lambda r: seen.add((r.step, r.grid, r.text_len, r.text_position))):
        sparse = run()
    assert seen == {(s, (37, 3, 5), TEXT + 2 * 15 + 414, "before") for s in range(3)}
    layers = handle["transformer"].stats()["layers"]
    assert all(s["dense_calls"] == 1 and s["sparse_calls"] == 2 and s["fallbacks"] == [] for s in layers.values())
    assert not [r for r in caplog.records if "runs dense" in r.getMessage()]
    assert sparse.shape == (1, VIDEO_CHANNELS, 37, 6, 10)
    assert torch.isfinite(sparse).all() and not torch.equal(sparse, ref)
    videosparse.remove(pipe)
    assert torch.equal(run(), ref)


def test_steps_counted_by_the_generated_videos_timestep():
    """Without a scheduler's step (a cache context, no scheduler) the step comes from counting timesteps. MiniMax-H3's
    `timestep` holds the distinct values of all rows, the keyframe pinned at max(t, 0.999): its largest entry never
    moved, every forward was step 0 and `dense_steps=1` kept the whole run dense (review find). The generated video's
    own entry counts now."""

    tr = tiny_minimax()
    base = minimax_inputs()
    video, audio = MiniMaxH3Scheduler(shift=12.0), MiniMaxH3Scheduler(shift=3.0)
    video.set_timesteps(4)
    audio.set_timesteps(4)
    videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=(1, 4, 16), block=64, dense_steps=1))
    session = sessions(tr)["transformer"]
    steps, largest = [], set()
    for tv, ta in zip(video.timesteps[:3], audio.timesteps[:3]):
        ts, ti = MiniMaxH3SetTimestepsStep.build_row_timesteps(base["video_indices"], base["audio_indices"], 70, 0,
                                                                TEXT, float(tv), float(ta), max(float(tv), 0.999), 1.0)
        largest.add(float(ts.max()))
        with torch.no_grad(), tr.cache_context("cond"):
            tr(**dict(base, timestep=ts, timestep_indices=ti), return_dict=False)
        steps.append(session.context.step)
    assert len(largest) == 1                        # the largest entry is the same at every step
    assert steps == [0, 1, 2]
    stats = session.stats()
    assert stats["dense_calls"] == 2 and stats["sparse_calls"] == 4, stats
    videosparse.remove(tr)


def test_the_kernel_is_probed_for_the_dtype_the_blocks_attend_in(monkeypatch):
    """Review find: the modular pipeline passes fp32 rows (its latents are drawn in fp32) into a bf16 checkpoint, whose
    fp32 input projection casts them to the blocks' bf16; the context hook probed the kernels for the rows' fp32,
    which no GPU kernel takes, so every layer would have run dense on the GPU. It probes for the projections' bf16."""
    from videosparse.eval.synthetic_models import cast_like_from_pretrained
    from videosparse.processors import base

    t = TestMiniMaxH3Processors()
    tr = cast_like_from_pretrained(t.make_transformer(), torch.bfloat16)
    inputs = t.make_inputs(tr)
    assert inputs["hidden_states"].dtype == torch.float32 and tr.proj_in.weight.dtype == torch.float32
    attended = []
    attend = base.SparseAttentionMixin.attend

    def spy(self, q, *args, **kwargs):
        attended.append(q.dtype)
        return attend(self, q, *args, **kwargs)

    monkeypatch.setattr(base.SparseAttentionMixin, "attend", spy)
    session = videosparse.apply(tr, videosparse.VedaConfig(density=0.5, tiling=t.tiling, block=t.block,
                                                           dense_steps=0))["transformer"]
    t.run(tr, inputs)
    assert set(attended) == {torch.bfloat16} and session._probe_args[2] == torch.bfloat16
    assert session.stats()["sparse_calls"] > 0
