"""Mutation finds of session 66 on the reference model's checks (`models/reference_eval.py`): the clip analysis on
hand-made frames, the adherence counts and noise seeds with a stand-in pipeline, the text-encoder and x0-error
probes with stand-in encoders and losses, the oracle tile mass against a brute-force sum, and the recording
processor against the q, k the stock Wan attention uses."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers import tiny_reference_pipeline

from videosparse.layout import TileLayout
from videosparse.models import reference as ref
from videosparse.models import reference_eval, reference_train
from videosparse.models.reference_data import COLORS, parse_prompt, render_clips, reversed_twin
from videosparse.models.reference_eval import (
    ADHERENCE_PROMPTS,
    adherence_rate,
    analyse_clip,
    attention_tile_mass,
    clip_adheres,
    direction_prompt_gap,
    direction_word_separation,
    tile_mass_fraction,
)

RED, BLUE = COLORS["red"], COLORS["blue"]


def _clip(xs, *, y: int = 10, height: int = 32, width: int = 32, size: int = 4) -> np.ndarray:
    """A gray clip with a red size x size square at column xs[t] of frame t (None: no object in that frame)."""
    frames = np.full((len(xs), height, width, 3), 0.5, dtype=np.float32)
    for t, x in enumerate(xs):
        if x is not None:
            frames[t, y:y + size, x:x + size] = RED
    return frames


# ----------------------------------------------------------------------------------------- clip analysis
def test_analyse_clip_refuses_frames_without_three_channels():
    # Mutation find: the shape check dropped its channel test (RGBA frames were analysed, or failed in numpy)
    for frames in (np.zeros((4, 8, 8, 4), dtype=np.float32), np.zeros((8, 8, 3), dtype=np.float32)):
        with pytest.raises(ValueError, match=r"frames must be \[T, H, W, 3\]"):
            analyse_clip(frames)


def test_an_object_of_min_pixels_in_half_the_frames_is_found():
    # Mutation finds: a frame needed more than min_pixels object pixels (counts > min_pixels); an object missing
    # from any frame gave no analysis at all (valid.all()); found_fraction counted frames instead of a fraction
    frames = np.full((8, 16, 16, 3), 0.5, dtype=np.float32)
    frames[:4, 5, 2:5] = RED                                   # exactly 3 pixels, in frames 0..3 only
    a = analyse_clip(frames, min_pixels=3)
    assert a.color == "red" and a.found_fraction == 0.5


def test_displacement_is_between_the_first_and_last_quarter_in_units_of_the_shorter_side():
    # Mutation finds: dx divided by the longer side; the quarters taken as halves; the first quarter took frame
    # T // 4 too (<= q), the last one dropped frame T - T // 4 (> T - q)
    a = analyse_clip(_clip([4, 8, 20, 20, 20, 20, 40, 48], height=32, width=64))
    # first quarter (frames 0, 1): mean column 6; last quarter (frames 6, 7): 44; shorter side 32
    assert a.dx == pytest.approx((44 - 6) / 32) and a.dy == 0.0
    assert a.direction == "right" and a.found_fraction == 1.0


def test_the_colour_is_that_of_the_median_object_pixel():
    # Mutation find: the colour was named from the mean object pixel (16 red and 14 blue pixels read purple)
    frames = np.full((4, 16, 32, 3), 0.5, dtype=np.float32)
    frames[:, 5, :16] = RED
    frames[:, 6, :14] = BLUE
    assert analyse_clip(frames).color == "red"


def test_adherence_is_measured_for_directional_prompts_only():
    # Mutation find: clip_adheres took prompts of any motion (a rotating object was scored against motion None)
    with pytest.raises(ValueError, match="directional motions"):
        clip_adheres("a red circle rotating on a dark background", _clip([4] * 8))


# ----------------------------------------------------------------------------------------- adherence rate
class _StandInPipe:
    """Renders the prompt's clip for prompts at even indices of `prompts`, its reversed twin for odd ones (right
    colour, wrong direction), and records the latents it was given."""

    def __init__(self, prompts):
        self.index = {p: i for i, p in enumerate(prompts)}
        self.transformer = SimpleNamespace(device=torch.device("cpu"))
        self.latents = []

    def __call__(self, prompts, *, num_frames, height, width, latents, **kwargs):
        self.latents.append(latents)
        specs = [parse_prompt(p) if self.index[p] % 2 == 0 else reversed_twin(parse_prompt(p)) for p in prompts]
        video = render_clips(specs, num_frames, height, width, generator=torch.Generator().manual_seed(0))
        return SimpleNamespace(frames=((video + 1) / 2).permute(0, 2, 3, 4, 1).numpy())


def test_adherence_rates_and_per_prompt_noise_seeds():
    # Mutation finds: the colour rate counted prompts passing both checks; the rate counted the colour only; the
    # noise of a later batch's prompt was seeded by its index in the batch (every batch got the same noise)
    prompts = ADHERENCE_PROMPTS[:4]
    pipe = _StandInPipe(prompts)
    size = dict(num_frames=16, height=32, width=32)
    res = adherence_rate(pipe, prompts, batch_size=3, seed=5, **size)
    assert (res["rate"], res["color_rate"], res["direction_rate"], res["num_prompts"]) == (0.5, 1.0, 0.5, 4)
    noise = torch.cat(pipe.latents)
    assert [len(x) for x in pipe.latents] == [3, 1]
    for i in range(4):
        assert torch.equal(noise[i], torch.randn(3, 16, 32, 32, generator=torch.Generator().manual_seed(5 + i)))


# ----------------------------------------------------------------------------------------- text / x0 probes
def test_direction_word_separation_takes_the_largest_token_distance(monkeypatch):
    # Mutation find: the per-token distances were averaged, not maximised (a difference in one token of many was
    # diluted by the sequence length)
    offsets = {"left": {}, "right": {0: (1, 0)}, "up": {0: (0, 1), 1: (0, 1)}, "down": {0: (0, 1), 1: (0, 1),
                                                                                          2: (1, 0)}}

    def encode(tokenizer, text_encoder, prompts, device):
        out = torch.zeros(len(prompts), 4, 2)
        for i, p in enumerate(prompts):
            for token, value in offsets[parse_prompt(p).motion].items():
                out[i, token] = torch.tensor(value, dtype=torch.float32)
        return out

    monkeypatch.setattr(ref, "encode_text", encode)
    pipe = SimpleNamespace(tokenizer=None, text_encoder=SimpleNamespace(device=torch.device("cpu")))
    res = direction_word_separation(pipe)
    assert res == {"opposite_over_axis": 1.0, "left_right": 1.0, "up_down": 1.0, "left_up": 1.0}


def test_direction_prompt_gap_is_the_velocity_loss_times_sigma_squared(monkeypatch):
    # Mutation find: the x0 error took the loss times sigma once (not sigma squared)
    seen = []

    def loss(transformer, text_encoder, tokenizer, video, prompts, level, noise):
        seen.append(list(prompts))
        return torch.tensor(2.0)

    monkeypatch.setattr(reference_train, "flow_matching_loss", loss)
    pipe = SimpleNamespace(transformer=SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32),
                           text_encoder=None, tokenizer=None)
    res = direction_prompt_gap(pipe, sigmas=(0.9, 0.5), num_clips=2, num_frames=4, height=16, width=16)
    assert res["correct"] == res["opposite"] == res["empty"] == [1.62, 0.5]
    correct, opposite = seen[0], seen[2]
    assert [parse_prompt(p) for p in opposite] == [reversed_twin(parse_prompt(p)) for p in correct]
    assert seen[4] == ["", ""]


# ----------------------------------------------------------------------------------------- tile mass
def _brute_force_tile_mass(q, k, layout, keep):
    """Per head and query tile, the top-`keep` key tiles' share of the query tile's softmax(q k^T / sqrt(D)) rows."""
    S = q.shape[1]
    tile = torch.empty(S, dtype=torch.long)
    tile[layout.perm] = torch.arange(S) // layout.block
    onehot = torch.nn.functional.one_hot(tile, layout.num_tiles).double()
    p = torch.softmax(q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
    mass = onehot.T @ p @ onehot / onehot.sum(0)[:, None]
    return mass.topk(keep, dim=-1).values.sum(-1)


def test_tile_mass_matches_a_brute_force_sum_over_permuted_partial_tiles():
    # Mutation finds: kept tiles rounded down (floor(0.3 * 4) = 1, not 2); the logits scaled by 1/D instead of
    # 1/sqrt(D); each row divided by the key tile's length instead of the query tile's; the tokens taken in
    # diffusers order instead of tile order
    layout = TileLayout((3, 8, 18), (2, 4, 16), block=128)   # tiles of 128, 128, 128, 48 tokens, a real permutation
    assert layout.num_tiles == 4 and not torch.equal(layout.perm, torch.arange(432))
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 432, 16, generator=g) * 2, torch.randn(2, 432, 16, generator=g)
    got = tile_mass_fraction(q, k, layout, top_fraction=0.3, chunk=100)
    want = _brute_force_tile_mass(q, k, layout, keep=2)
    assert got.shape == (2, 4) and torch.allclose(got.double(), want, atol=1e-5), (got, want)


class _RecordingPipe:
    """Calls `pipe` and records the latents of each call."""

    def __init__(self, pipe):
        self.pipe, self.transformer, self.latents = pipe, pipe.transformer, []

    def __call__(self, *args, latents, **kwargs):
        self.latents.append(latents)
        return self.pipe(*args, latents=latents, **kwargs)


def test_attention_tile_mass_measures_the_q_k_of_the_stock_attention(monkeypatch):
    # Mutation finds: the recording processor dropped the RoPE, or the key's qk-norm, before measuring (so it
    # measured other attention than the model's); it averaged over tiles, not heads (per_layer_head held one
    # value per query tile); every prompt got the noise of the first one
    import diffusers.models.transformers.transformer_wan as wan

    measured, stock = [], []
    real_mass, real_dispatch = reference_eval.tile_mass_fraction, wan.dispatch_attention_fn

    def mass(q, k, *args):
        measured.append((q, k))
        return real_mass(q, k, *args)

    def dispatch(query, key, value, **kwargs):
        if key.shape[1] == query.shape[1]:              # self-attention (cross-attention keys are text)
            stock.append((query, key))
        return real_dispatch(query, key, value, **kwargs)

    monkeypatch.setattr(reference_eval, "tile_mass_fraction", mass)
    monkeypatch.setattr(wan, "dispatch_attention_fn", dispatch)
    pipe = tiny_reference_pipeline()
    pipe.set_progress_bar_config(disable=True)
    recorder = _RecordingPipe(pipe)
    prompts = ["a red circle moving left on a dark background"] * 2
    res = attention_tile_mass(recorder, prompts, num_frames=8, height=32, width=32, num_inference_steps=1,
                              tile=(2, 8, 8), seed=3)
    assert measured and stock
    (q, k), (query, key) = measured[0], stock[0]
    assert torch.allclose(q, query[0].transpose(0, 1), atol=1e-5) and torch.allclose(k, key[0].transpose(0, 1),
                                                                                     atol=1e-5)
    heads = pipe.transformer.config.num_attention_heads
    assert list(res["per_layer"]) == [0] and len(res["per_layer_head"][0]) == heads
    for j, latents in enumerate(recorder.latents):
        assert torch.equal(latents, torch.randn(1, 3, 8, 32, 32, generator=torch.Generator().manual_seed(3 + j)))
