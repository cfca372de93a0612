"""Cosmos 3 end to end: a tiny `Cosmos3OmniPipeline` built offline (random weights), run as a diffusers user runs it,
with classifier-free guidance (a cond and an uncond forward per step, whose prompts have different lengths).

The transformer is `tiny_cosmos3` (tests/processors/test_cosmos3.py); the VAE a tiny Wan 2.2-style
`AutoencoderKLWan` (2 x 2 pixel patches and 3 downsamplings: 16x spatial, 4x temporal compression, z_dim 4); the
tokenizer a word-level `PreTrainedTokenizerFast` with a Qwen-style chat template; the scheduler UniPC on flow
sigmas. 9 frames of 240 x 384 pixels -> latents 3 x 15 x 24 -> a (3, 8, 12) grid of 2 x 2 patches (the height
padded), 288 video rows, served in 64-token (1, 4, 16) tiles.
"""

import numpy as np
import pytest
import torch
from diffusers.models.transformers.transformer_cosmos3 import Cosmos3AttnProcessor
from test_cosmos3 import tiny_cosmos3

import videosparse
from videosparse.processors.context import CONTEXT_HOOK
from videosparse.processors.cosmos3 import Cosmos3SparseAttnProcessor

PROMPT, NEGATIVE = "a red circle moving left", "blue"
FRAMES, HEIGHT, WIDTH, FPS = 9, 240, 384, 24.0
GRID = (3, 8, 12)                   # latent frames x patch rows x patch columns
VIDEO_ROWS = 3 * 8 * 12
# 5 steps: the default dense_steps=0.2 then runs int(0.2 * 5) = 1 step dense (with 3 steps it would run none)
STEPS = 5
LAYERS, HEADS, HEAD_DIM = 2, 2, 64
TILING, BLOCK = (1, 4, 16), 64
SERVED = ["layers.0.self_attn.processor", "layers.1.self_attn.processor"]

SPECIAL = ["<|endoftext|>", "<unk>", "<|im_start|>", "<|im_end|>", "<|vision_start|>"]
WORDS = ("system user assistant you are a helpful who will generate videos images from give prompt the video is not "
         "seconds long and of fps this image resolution red green blue circle square moving left . 0 1 2 3 4 5 6 7 "
         "8 9")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_cosmos3_tokenizer():
    """A word-level `PreTrainedTokenizerFast` over `SPECIAL` and `WORDS` (unknown words -> <unk>, ids < 64), with the
    special tokens the pipeline reads (`<|vision_start|>`, the eos token) and a chat template."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS.split())}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIAL)          # matched whole, before the pre-tokenizer splits on punctuation
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   unk_token="<unk>", chat_template=CHAT_TEMPLATE)


def tiny_cosmos3_pipeline(**transformer_kwargs):
    """A `Cosmos3OmniPipeline` of tiny random components, built offline (no safety checker, no sound tokenizer)."""
    from diffusers import AutoencoderKLWan, Cosmos3OmniPipeline, UniPCMultistepScheduler

    transformer = tiny_cosmos3(**transformer_kwargs)
    torch.manual_seed(1)
    vae = AutoencoderKLWan(
        base_dim=4, z_dim=transformer.config.latent_channel, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12, patch_size=2,
        scale_factor_spatial=16, scale_factor_temporal=4,
        latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.8, 1.0, 2.0]).eval()
    tokenizer = tiny_cosmos3_tokenizer()
    assert len(tokenizer) <= transformer.config.vocab_size
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                        num_train_timesteps=1000)
    pipe = Cosmos3OmniPipeline(transformer=transformer, text_tokenizer=tokenizer, vae=vae, scheduler=scheduler,
                               enable_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run(pipe, **kwargs):
    """(video [T, H, W, 3] in [0, 1], the latents after every step) of one guided run with a fixed generator."""
    latents = []

    def keep(pipe, step, t, tensors):
        latents.append(tensors["latents"].clone())
        return {}

    video = pipe(prompt=PROMPT, negative_prompt=NEGATIVE, num_frames=FRAMES, height=HEIGHT, width=WIDTH, fps=FPS,
                 num_inference_steps=STEPS, guidance_scale=4.0, output_type="np",
                 generator=torch.Generator().manual_seed(0), callback_on_step_end=keep, **kwargs).video
    assert len(latents) == STEPS
    return video, latents


def prompt_lengths(pipe) -> dict[str, int]:
    """The token count of the cond and the uncond prompt, as the pipeline tokenizes them."""
    cond, uncond = pipe.tokenize_prompt(PROMPT, NEGATIVE, num_frames=FRAMES, height=HEIGHT, width=WIDTH, fps=FPS)
    return {"cond": len(cond), "uncond": len(uncond)}


def close(a, b, rel=1e-4) -> bool:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max()) <= rel * float(np.abs(b).max())


@pytest.fixture(scope="module")
def stock():
    """The stock pipeline's video and per-step latents (t2v)."""
    return run(tiny_cosmos3_pipeline())


def test_tiny_pipeline_is_well_formed(stock):
    """The tiny pipeline itself: token ids in the transformer's vocabulary, cond and uncond prompts of different
    lengths, a finite, non-constant video of the requested shape, and runs that repeat bit for bit."""
    pipe = tiny_cosmos3_pipeline()
    assert pipe.vae_scale_factor_spatial == 16 and pipe.vae_scale_factor_temporal == 4
    cond, uncond = pipe.tokenize_prompt(PROMPT, NEGATIVE, num_frames=FRAMES, height=HEIGHT, width=WIDTH, fps=FPS)
    assert max(cond + uncond) < pipe.transformer.config.vocab_size
    assert cond[-1] == pipe.text_tokenizer.convert_tokens_to_ids("<|vision_start|>")
    assert len(cond) != len(uncond)
    video, latents = stock
    assert video.shape == (FRAMES, HEIGHT, WIDTH, 3) and np.isfinite(video).all() and video.std() > 0
    assert latents[-1].shape == (1, 4, 3, HEIGHT // 16, WIDTH // 16)
    again, _ = run(pipe)                   # a second build: the same weights, the same video
    assert np.array_equal(again, video)


def test_density_one_equals_stock_every_call_sparse(stock):
    """Veda at density 1 (no dense steps): the video (and the last latents) equal stock's to 1e-4 relative; every
    self-attention call of the run (2 layers x 5 steps x cond / uncond) ran sparse over the (3, 8, 12) grid, none
    dense, no fallback; the cond and uncond forwards, whose prompts differ in length, each with its text rows."""
    pipe = tiny_cosmos3_pipeline()
    handle = videosparse.apply(pipe, videosparse.VedaConfig(density=1.0, tiling=TILING, block=BLOCK, dense_steps=0))
    assert videosparse.sessions(pipe) == handle
    assert all(type(p) is Cosmos3SparseAttnProcessor for p in pipe.transformer.attn_processors.values())
    records = []
    with videosparse.observe(pipe, lambda r: records.append((r.layer, r.step, r.branch, r.grid, r.text_len,
                                                                tuple(r.q.shape), tuple(r.k.shape)))):
        video, latents = run(pipe)
    ref_video, ref_latents = stock
    assert close(video, ref_video) and close(latents[-1], ref_latents[-1])

    s = videosparse.sessions(pipe.transformer)["transformer"].stats()
    assert s["transformer_calls"] == 2 * STEPS
    assert s["sparse_calls"] == LAYERS * STEPS * 2 and s["dense_calls"] == 0
    assert s["density"] == 1.0 and s["kernel_backend"] == "reference"
    assert all(layer["sparse_calls"] == STEPS * 2 and layer["dense_calls"] == 0 and layer["fallbacks"] == []
               for layer in s["layers"].values())

    lengths = prompt_lengths(pipe)
    assert len(records) == LAYERS * STEPS * 2
    assert {(layer, step, branch) for layer, step, branch, *_ in records} == {
        (layer, step, branch) for layer in range(LAYERS) for step in range(STEPS) for branch in ("cond", "uncond")}
    for _, _, branch, grid, text_len, q_shape, k_shape in records:
        # the video grid, then the text keys as global tiles; the KV head repeated to the query heads
        assert grid == GRID and text_len == lengths[branch]
        assert q_shape == k_shape == (1, VIDEO_ROWS + lengths[branch], HEADS, HEAD_DIM)


def test_sparse_run_with_default_dense_steps(stock):
    """Veda at density 0.3 with the default dense_steps=0.2 (5 steps: the first dense): the first step's calls are
    counted dense and are stock's bit for bit (the latents after step 0 equal stock's), the other steps' sparse at a
    realised density below 0.7; the video is finite and differs from stock's."""
    pipe = tiny_cosmos3_pipeline()
    config = videosparse.VedaConfig(density=0.3, tiling=TILING, block=BLOCK)
    assert config.dense_steps == 0.2 and config.dense_step_count(STEPS) == 1
    videosparse.apply(pipe, config)
    video, latents = run(pipe)
    ref_video, ref_latents = stock
    s = videosparse.sessions(pipe)["transformer"].stats()
    assert s["transformer_calls"] == 2 * STEPS
    assert s["dense_calls"] == LAYERS * 1 * 2 and s["sparse_calls"] == LAYERS * (STEPS - 1) * 2
    assert all(layer["dense_calls"] == 2 and layer["sparse_calls"] == (STEPS - 1) * 2 and layer["fallbacks"] == []
               for layer in s["layers"].values())
    # 288 video rows + 51 text rows in 64-row tiles: 4 video tiles and 2 global ones (the last 32 video rows and the
    # text), which every tile keeps: 2 / 3 is the lowest density this tiny grid can reach
    assert 0.0 < s["density"] < 0.7
    assert all(layer["kept_pairs"] < layer["total_pairs"] for layer in s["layers"].values())
    assert torch.equal(latents[0], ref_latents[0])            # the dense first step: stock's attention
    assert not torch.equal(latents[1], ref_latents[1])
    assert np.isfinite(video).all() and not np.array_equal(video, ref_video)


def test_remove_restores_the_pipeline_exactly(stock):
    """remove() after a sparse run: the original processor objects back, the context hook gone, no session; the next
    run equals the stock run bit for bit (the same pipeline's before apply, and a fresh pipeline's)."""
    pipe = tiny_cosmos3_pipeline()
    ref, _ = run(pipe)
    before = dict(pipe.transformer.attn_processors)
    assert all(type(p) is Cosmos3AttnProcessor for p in before.values()) and list(before) == SERVED
    videosparse.apply(pipe, videosparse.VedaConfig(density=0.3, tiling=TILING, block=BLOCK, dense_steps=0))
    sparse, _ = run(pipe)
    assert not np.array_equal(sparse, ref)
    removed = videosparse.remove(pipe)
    assert removed["transformer"].stats()["sparse_calls"] == LAYERS * STEPS * 2     # stats stay readable
    after = pipe.transformer.attn_processors
    assert list(after) == list(before) and all(after[n] is before[n] for n in before)
    assert videosparse.sessions(pipe) == {}
    registry = getattr(pipe.transformer, "_diffusers_hook", None)
    assert registry is None or CONTEXT_HOOK not in registry.hooks
    restored, _ = run(pipe)
    assert np.array_equal(restored, ref) and np.array_equal(restored, stock[0])


def test_image_to_video_density_one_equals_stock(stock):
    """Image to video (a 60 x 90 PIL image, resized and center-cropped to 240 x 384; latent frame 0 held clean, not
    denoised): at density 1 every call runs sparse over the same (3, 8, 12) grid and the video equals stock's."""
    from PIL import Image

    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (60, 90, 3), dtype=np.uint8))
    pipe = tiny_cosmos3_pipeline()
    ref, ref_latents = run(pipe, image=image)
    assert not np.array_equal(ref, stock[0])                   # the image conditions the video
    videosparse.apply(pipe, videosparse.VedaConfig(density=1.0, tiling=TILING, block=BLOCK, dense_steps=0))
    grids = set()
    with videosparse.observe(pipe, lambda r: grids.add((r.grid, r.branch))):
        video, latents = run(pipe, image=image)
    assert grids == {(GRID, "cond"), (GRID, "uncond")}
    assert close(video, ref) and close(latents[-1], ref_latents[-1])
    s = videosparse.sessions(pipe)["transformer"].stats()
    assert s["sparse_calls"] == LAYERS * STEPS * 2 and s["dense_calls"] == 0
    assert all(layer["fallbacks"] == [] for layer in s["layers"].values())


def test_generate_command_on_a_saved_tiny_cosmos3(stock, tmp_path):
    """`videosparse generate --model DIR --compare-dense` on the tiny pipeline saved to disk (its output holds one
    unbatched `.video`, not the usual `.frames`): the video and its JSON are written, the dense video equals the stock
    pipeline's, and `eval.generate` returns the frames [T, H, W, 3]."""
    import json

    from videosparse.cli import main
    from videosparse.eval.generate import generate

    pipe = tiny_cosmos3_pipeline()
    kwargs = dict(prompt=PROMPT, negative_prompt=NEGATIVE, num_frames=FRAMES, height=HEIGHT, width=WIDTH, fps=FPS,
                  num_inference_steps=STEPS, guidance_scale=4.0)
    dense = generate(pipe, None, kwargs, seed=0)
    assert dense.frames.shape == (FRAMES, HEIGHT, WIDTH, 3) and close(dense.frames, stock[0], rel=1e-6)
    pipe.save_pretrained(tmp_path / "tiny")
    out = tmp_path / "video.mp4"
    assert main(["generate", "--model", str(tmp_path / "tiny"), "--frames", str(FRAMES), "--height", str(HEIGHT),
                 "--width", str(WIDTH), "--steps", "3", "--block", "64", "--tiling", "1x4x16", "--density", "0.5",
                 "--compare-dense", "--out", str(out), "--json", str(tmp_path / "run.json")]) == 0
    assert out.is_file()
    report = json.loads((tmp_path / "run.json").read_text())
    assert (report["frames"], report["height"], report["width"]) == (FRAMES, HEIGHT, WIDTH)
    assert report["stats"]["transformer"]["sparse_calls"] > 0 and report["dense"]["psnr_db"] > 20
