import logging

import pytest
import torch
from diffusers import HunyuanVideoTransformer3DModel
from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0

import videosparse
from videosparse.processors import sessions

from tester import RANDOM_GRID_TILINGS, ProcessorTesterMixin, apply_and_list_served, check_any_grid

TEXT = 8


class TestHunyuanProcessors(ProcessorTesterMixin):
    num_layers = 2          # one dual-stream + one single-stream block

    def make_transformer(self):
        torch.manual_seed(0)
        return HunyuanVideoTransformer3DModel(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=self.head_dim, num_layers=1,
            num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
            text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(8, 28, 28),
        ).eval()

    def make_inputs(self, transformer, valid=(TEXT,)):
        g = torch.Generator().manual_seed(1)
        B = len(valid)
        mask = torch.arange(TEXT)[None, :] < torch.tensor(valid)[:, None]
        # grid after patching: 3 x 7 x 18 = 378 video tokens (odd, partial last tile) + 8 text tokens after
        return dict(
            hidden_states=torch.randn(B, 4, 3, 14, 36, generator=g),
            timestep=torch.tensor([500] * B),
            encoder_hidden_states=torch.randn(B, TEXT, 16, generator=g),
            encoder_attention_mask=mask,
            pooled_projections=torch.randn(B, 8, generator=g),
            guidance=torch.tensor([6000.0] * B),
        )


def _tiny():
    t = TestHunyuanProcessors()
    return t, t.make_transformer()


def test_sparse_runs_on_video_blocks_only_refiner_untouched():
    t, tr = _tiny()
    inputs = t.make_inputs(tr)
    dense = t.run(tr, inputs)
    before, served = apply_and_list_served(tr, videosparse.VedaConfig(density=0.5, tiling=t.tiling, block=t.block))
    procs = tr.attn_processors
    refiner = [n for n in procs if n.startswith("context_embedder.")]
    assert refiner and all(procs[n] is before[n] for n in refiner)          # the text-only refiner stays stock
    assert all(type(before[n]) is HunyuanVideoAttnProcessor2_0 for n in served)
    assert served == ["single_transformer_blocks.0.attn.processor", "transformer_blocks.0.attn.processor"]
    out = t.run(tr, inputs)
    s = sessions(tr)["transformer"].stats()
    assert s["sparse_calls"] == 2 and s["dense_calls"] == 0 and 0.3 < s["density"] < 0.9
    assert torch.isfinite(out).all() and not torch.equal(out, dense)
    assert (out - dense).norm() / dense.norm() < 0.5


def test_padded_text_mask_matches_stock():
    """Masked (padded) text tokens: sparse over the valid prefix, padded rows dense over valid keys."""
    t, tr = _tiny()
    inputs = t.make_inputs(tr, valid=(5, 5))
    ref = t.run(tr, inputs)
    for config in (videosparse.DenseConfig(), videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block)):
        videosparse.apply(tr, config)
        out = t.run(tr, inputs)
        assert (out - ref).abs().max() <= 1e-5, config
        s = sessions(tr)["transformer"].stats()
        if config.method != "dense":
            assert s["sparse_calls"] == 2 and s["dense_calls"] == 0 and s["density"] == 1.0
        videosparse.remove(tr)
    # sparse at density < 1 on the padded batch: the padded text rows still equal a masked dense call
    videosparse.apply(tr, videosparse.VedaConfig(density=0.5, tiling=t.tiling, block=t.block))
    out = t.run(tr, inputs)
    assert torch.isfinite(out).all() and sessions(tr)["transformer"].stats()["sparse_calls"] == 2


def test_padded_rows_get_stock_attention():
    t, tr = _tiny()
    videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=t.tiling, block=t.block))
    session = sessions(tr)["transformer"]
    t.run(tr, t.make_inputs(tr, valid=(5,)))            # records grid (3, 7, 18): 8 text tokens, 5 of them valid
    assert session.context.text_len == 8 and session.context.text_valid.tolist() == [5]
    proc = next(p for p in tr.attn_processors.values() if hasattr(p, "attend_text_prefix"))
    S, valid = 378 + TEXT, 378 + 5
    q, k, v = (torch.randn(1, S, 2, 64) for _ in range(3))
    mask = (torch.arange(S) < valid)[None, None, None, :]
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           attn_mask=mask).transpose(1, 2)
    out = proc.attend_text_prefix(q, k, v, TEXT, mask)
    assert (out[:, valid:] - ref[:, valid:]).abs().max() <= 1e-5
    assert not torch.allclose(out[:, :valid], ref[:, :valid], atol=1e-3)   # the prefix really ran sparse


def test_different_valid_lengths_run_in_one_call(caplog):
    """A batch whose prompts have different valid lengths (e.g. prompt and negative prompt batched for guidance):
    one sparse call for the batch, each item's padded keys masked in the kernel (`Plan.valid_keys`), exactly as if
    it ran alone; at density 1 the output equals stock. Observed forwards serve each item's valid prefix with the
    layout of its own length (observers see what attention used), as dense configs do."""
    t, tr = _tiny()
    inputs = t.make_inputs(tr, valid=(8, 5))
    ref = t.run(tr, inputs)
    videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    assert (t.run(tr, inputs) - ref).abs().max() <= 1e-5
    videosparse.remove(tr)
    videosparse.apply(tr, videosparse.VedaConfig(density=0.5, tiling=t.tiling, block=t.block))
    session = sessions(tr)["transformer"]
    with caplog.at_level(logging.WARNING, logger="videosparse"):
        out = t.run(tr, inputs)
    assert not [r for r in caplog.records if "runs dense" in r.message]
    assert session.stats()["sparse_calls"] == 2 and session.stats()["dense_calls"] == 0     # 2 layers, one call
    for b in range(2):
        alone = t.run(tr, {k: (v[b:b + 1] if torch.is_tensor(v) else v) for k, v in inputs.items()})
        assert (out[b:b + 1] - alone).abs().max() <= 1e-5
    text_lens = []
    with videosparse.processors.observe(tr, lambda r: text_lens.append(r.text_len)):
        observed = t.run(tr, inputs)
    assert sorted(set(text_lens)) == [5, 8] and torch.isfinite(observed).all()
    assert session.stats()["sparse_calls"] == 2 + 2 * 2 + 2    # batch, items alone, observed (items: one call)


def test_sol_and_token_replace_variant():
    """Sol runs on the joint layout; the I2V token-replace blocks use the same processor (density 1.0 = stock)."""
    t, tr = _tiny()
    inputs = t.make_inputs(tr, valid=(5,))
    videosparse.apply(tr, videosparse.SolConfig(density=0.5, block=t.block))
    out = t.run(tr, inputs)
    assert torch.isfinite(out).all() and sessions(tr)["transformer"].stats()["sparse_calls"] == 2
    torch.manual_seed(0)
    tr = HunyuanVideoTransformer3DModel(**dict(tr.config, image_condition_type="token_replace")).eval()
    ref = t.run(tr, inputs)
    videosparse.apply(tr, videosparse.VedaConfig(density=1.0, tiling=t.tiling, block=t.block))
    assert (t.run(tr, inputs) - ref).abs().max() <= 1e-5
    assert sessions(tr)["transformer"].stats()["sparse_calls"] == 2


def test_new_prompt_lengths_do_not_recompile():
    """Sparse forwards cover every text token and mask the padded keys in the kernel, so under torch.compile a
    prompt of another valid length runs the same graph (it used to compile one per length, up to Dynamo's limit of
    8, after which the forward ran eagerly); each output equals eager."""
    from torch._dynamo.utils import counters

    t, tr = _tiny()
    videosparse.apply(tr, videosparse.VedaConfig(density=0.3, tiling=t.tiling, block=t.block))
    eager = {n: t.run(tr, t.make_inputs(tr, valid=(n,)), step=2) for n in (8, 5, 3, 1)}
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(tr, backend="eager")
    try:
        for n, want in eager.items():
            with torch.no_grad(), tr.cache_context("cond", step_index=2, num_inference_steps=4):
                out = compiled(**t.make_inputs(tr, valid=(n,)), return_dict=False)[0]
            assert (out - want).abs().max() <= 1e-5, n
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    finally:
        torch._dynamo.reset()


def test_sol_density_with_padded_text_is_that_of_the_tiles_computed():
    """Review find: `SolConfig(density=0.3)` with a short prompt padded to 128 text tokens computed 0.266 of the tile
    pairs (stats) while its calibration reported 0.2996: it had counted the padded text tiles, which the plan drops,
    as kept. Both now count the tiles computed, and meet the target."""
    t, tr = _tiny()
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(1, 4, 5, 32, 32, generator=g), timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 128, 16, generator=g),
                  encoder_attention_mask=torch.arange(128)[None] < 4, pooled_projections=torch.randn(1, 8, generator=g),
                  guidance=torch.tensor([6000.0]))
    videosparse.apply(tr, videosparse.SolConfig(density=0.3, block=64, tiling=(1, 4, 16)))
    with torch.no_grad():
        tr(**inputs)
    session = sessions(tr)["transformer"]
    calibrated = [c["density"] for c in session.method.calibrations().values()]
    realised = session.stats()["density"]
    assert len(calibrated) == 2 and all(abs(c - realised) < 1e-9 for c in calibrated)
    assert abs(realised - 0.3) < 0.01, realised
    videosparse.remove(tr)


@pytest.mark.parametrize("seed", range(3))
def test_random_grids_and_text_lengths(seed):
    """Any frame count and resolution with a batch of two prompts of unequal, drawn text lengths (padded keys
    masked in the kernel, padded rows as stock): at density 1 the sparse forward equals the stock one; sparse, it
    runs finite with the realised density inside (0, 1]."""
    import random

    rng = random.Random(seed)
    frames, height, width = rng.randint(1, 5), 2 * rng.randint(1, 12), 2 * rng.randint(1, 12)
    tiling = rng.choice(RANDOM_GRID_TILINGS)
    t, tr = _tiny()
    inputs = t.make_inputs(tr, valid=(rng.randint(1, TEXT), rng.randint(1, TEXT)))
    inputs["hidden_states"] = torch.randn(2, 4, frames, height, width, generator=torch.Generator().manual_seed(seed))
    check_any_grid(t, tr, inputs, tiling, label=(frames, height, width, tiling))


@pytest.mark.parametrize("config", ["dense", "veda"])
def test_the_attention_timer_times_the_padded_text_rows(config):
    """Review 54: under DenseConfig the padded text rows attend in a call of their own outside `attend`, which was
    all `AttentionTimer` timed, so the dense arm's attention time (and the share, the Amdahl bound) left them out
    while a sparse arm's one call held them. The family's timed entry holds every attention call of a layer."""
    from videosparse.eval.timing import AttentionTimer

    t, tr = _tiny()
    inputs = t.make_inputs(tr, valid=(5,))                 # 5 of 8 text tokens valid
    videosparse.apply(tr, videosparse.DenseConfig() if config == "dense" else
                      videosparse.VedaConfig(density=0.5, tiling=t.tiling, block=t.block))
    procs = [p for p in tr.attn_processors.values() if hasattr(p, "attend_text_prefix")]
    depth, untimed, attention_calls = [0], [], []
    timer = AttentionTimer([tr])
    with timer(), torch.no_grad():
        for p in procs:                                    # inside the timer's wrapper: depth > 0 while it times
            timed, dense = getattr(p, p.timed_entry), p._dense

            def entry(*args, _timed=timed, **kwargs):
                depth[0] += 1
                try:
                    return _timed(*args, **kwargs)
                finally:
                    depth[0] -= 1

            def counted(q, *args, _dense=dense, **kwargs):
                (attention_calls if depth[0] else untimed).append(q.shape[1])
                return _dense(q, *args, **kwargs)

            setattr(p, p.timed_entry, entry)
            p._dense = counted
        t.run(tr, inputs)
        for p in procs:
            del p._dense
    videosparse.remove(tr)
    assert len(timer.attention_s) == len(procs) and not untimed, untimed
    assert config == "veda" or attention_calls       # dense: the valid prefix's call and the padded rows' call
