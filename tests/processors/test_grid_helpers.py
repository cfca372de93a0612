"""The grid helpers the model families share (`videosparse.processors.grids`), checked against what a patch
embedding really makes and against coordinates built in inference mode."""

from types import SimpleNamespace

import torch

from videosparse.processors.grids import HistoryPart, coords_grid, history_tokens, patched_grid, video_grid


def positions(grid):
    """LTX-Video's (1, 3, S) positions of a (T, H, W) grid in time-major order."""
    axes = [torch.arange(n, dtype=torch.float32) for n in grid]
    return torch.stack(torch.meshgrid(*axes, indexing="ij")).flatten(1)[None]


def test_the_grid_is_what_a_conv3d_patch_embedding_makes_of_uneven_latents():
    """Sizes that are not a multiple of the patch are floor-divided, as a Conv3d with stride = kernel drops the
    remainder (frames too, where the patch covers time)."""
    patch = (2, 2, 2)
    module = SimpleNamespace(config=SimpleNamespace(patch_size=patch))
    embed = torch.nn.Conv3d(1, 1, kernel_size=patch, stride=patch)
    latents = torch.zeros(1, 1, 5, 9, 11)
    made = tuple(embed(latents).shape[2:])
    assert made == (2, 4, 5)
    assert patched_grid(module, 5, 9, 11) == made
    assert video_grid(module, (latents,), {}) == made and video_grid(module, (), {"hidden_states": latents}) == made
    # an int patch_size with patch_size_t, as CogVideoX 1.5's config writes it
    module = SimpleNamespace(config=SimpleNamespace(patch_size=2, patch_size_t=2))
    assert patched_grid(module, 5, 9, 11) == made


def test_a_history_part_counts_only_when_its_frame_indices_are_given_too():
    model = torch.nn.Module()
    model.embedder = torch.nn.Module()
    model.embedder.proj = torch.nn.Conv3d(4, 8, kernel_size=(1, 2, 2), stride=(1, 2, 2))
    part = HistoryPart("latents_clean", 3, "indices_latents_clean", 4, "embedder.proj")
    latents = torch.zeros(1, 4, 2, 8, 6)
    tokens = model.embedder.proj(latents).flatten(2).shape[2]
    assert tokens == 2 * 4 * 3
    given = {"latents_clean": latents, "indices_latents_clean": torch.arange(2)}
    assert history_tokens(model, (), given, (part,)) == tokens
    assert history_tokens(model, (), {"latents_clean": latents}, (part,)) == 0
    assert history_tokens(model, (), {**given, "indices_latents_clean": None}, (part,)) == 0
    # by position, as a forward called positionally gives them
    assert history_tokens(model, (None, None, None, latents, torch.arange(2)), {}, (part,)) == tokens
    assert history_tokens(model, (None, None, None, latents), {}, (part,)) == 0


def test_coordinates_made_in_inference_mode_are_checked_each_time():
    """Inference tensors have no version counter (so no cache of their check): the check still answers, and sees
    an edit made in place."""
    grid = (2, 3, 4)
    S = 2 * 3 * 4
    with torch.inference_mode():
        coords = positions(grid)
        assert coords.is_inference()
        assert coords_grid(coords, S) == (grid, None)
        assert coords_grid(coords, S) == (grid, None)
        coords.copy_(coords[:, :, torch.arange(S).flip(0)].clone())
        found, problem = coords_grid(coords, S)
    assert found is None and "do not form one time-major" in problem
