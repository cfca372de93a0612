"""VedaEstimator: untrained = mean-pooled q.k, save/load (safetensors only), mismatch errors; loss and recall."""

from __future__ import annotations

import json
import os
import math

import pytest
import torch

from helpers import rel_err
from videosparse.config import VedaConfig, config_from_dict
from videosparse.layout import head_tiling
from videosparse.method import ModelInfo
from videosparse.veda.estimator import VedaEstimator
from videosparse.veda.losses import tile_kl_loss, tile_recall
from videosparse.veda.method import VedaMethod, mean_pooled_logits
from videosparse.veda.trippool import trippool_qk

INFO = ModelInfo("WanTransformer3DModel", num_layers=2, num_heads=3, head_dim=32, patch_size=(1, 2, 2))


def per_tile_mean_logits(q: torch.Tensor, k: torch.Tensor, block: int, n: int) -> torch.Tensor:
    """fp64 mean(q_tile_i) . mean(k_tile_j) / sqrt(D), one tile at a time (the partial last tile over its tokens)."""
    D = q.shape[-1]
    qm = torch.stack([q[:, :, i * block:(i + 1) * block].double().mean(2) for i in range(n)], 2)
    km = torch.stack([k[:, :, i * block:(i + 1) * block].double().mean(2) for i in range(n)], 2)
    return qm @ km.transpose(-1, -2) / math.sqrt(D)


def make_est(**kw) -> VedaEstimator:
    args = dict(model_class="WanTransformer3DModel", num_layers=2, num_heads=3, head_dim=32, block=128,
                tile_shapes=(4, 4, 8))
    args.update(kw)
    return VedaEstimator(**args)


@pytest.mark.parametrize("grid", [(4, 8, 16), (3, 10, 9)])            # full tiles; partial last tile
def test_untrained_estimator_equals_mean_pooled_qk(grid):
    S = math.prod(grid)
    # video-like: tokens share a per-head direction (tile means are not ~0), plus token noise
    q, k = (torch.randn(1, 1, 3, 32) + 0.5 * torch.randn(2, S, 3, 32) for _ in range(2))
    layout = head_tiling(grid, (4, 4, 8), 3, 128)
    qt, kt = layout.gather(q), layout.gather(k)
    n = layout.num_video_tiles
    ref = per_tile_mean_logits(qt, kt, 128, n)
    # VedaConfig(estimator=None): exactly the mean-pooled scores
    scores = VedaMethod(VedaConfig(density=0.3), INFO).scores(qt, kt, layout, 0)
    assert scores.dtype == torch.float32 and scores.shape == (2, 3, n, n)
    assert rel_err(scores, ref) < 1e-6
    qf, kf = trippool_qk(qt, kt, 128, n)
    # a zero-initialised estimator is the same function
    zero = make_est(init_std=0.0)
    assert rel_err(zero(qf, kf, 1).detach(), ref) < 1e-6
    # the N(0, 1e-4^2) init perturbs it by ~1e-3 relative, not more
    fresh = make_est()
    err = rel_err(fresh(qf, kf, 0).detach(), ref)
    assert 0 < err < 1e-2
    assert float(fresh.proj_q.detach().std()) == pytest.approx(1e-4, rel=0.05)


def test_logits_with_given_weights_equal_the_indexed_forward():
    """The processors' path (a layer's weights from its slot) computes exactly what forward(layer) does."""
    est = make_est(init_std=0.3)
    qf, kf = torch.randn(2, 3, 7, 96), torch.randn(2, 3, 7, 96)
    for layer in range(2):
        torch.testing.assert_close(VedaEstimator.logits_with(qf, kf, est.proj_q[layer], est.proj_k[layer]),
                                   est(qf, kf, layer), rtol=0, atol=0)


def test_estimator_trains_through_projection_only():
    est = make_est()
    qf, kf = torch.randn(1, 3, 5, 96), torch.randn(1, 3, 5, 96)
    heat = torch.rand(1, 3, 5, 5)
    loss = tile_kl_loss(est(qf, kf, 1), heat)
    loss.backward()
    assert est.proj_q.grad[1].abs().sum() > 0 and est.proj_k.grad[1].abs().sum() > 0
    assert est.proj_q.grad[0].abs().sum() == 0                  # layer 0 untouched by a layer-1 loss
    with pytest.raises(ValueError, match="expected \\(B, 3, N, 96\\)"):
        est(torch.randn(1, 2, 5, 96), kf, 0)
    with pytest.raises(ValueError, match="layer=2"):
        est(qf, kf, 2)


def test_save_load_round_trip_and_veda_config_accepts_path(tmp_path):
    est = make_est(density=0.1)
    with torch.no_grad():
        est.proj_q.normal_()
    est.save_pretrained(tmp_path / "est")
    assert (tmp_path / "est" / "model.safetensors").is_file()
    assert not list((tmp_path / "est").glob("*.bin"))
    rng = torch.get_rng_state()
    loaded = VedaEstimator.from_pretrained(tmp_path / "est")
    # review find: the constructor's random init ran before the weights replaced it, which moved the global RNG
    # (`torch.manual_seed(0); apply(pipe, VedaConfig(estimator=dir)); pipe(...)` drew other latents)
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(loaded.proj_q, est.proj_q) and torch.equal(loaded.proj_k, est.proj_k)
    assert isinstance(loaded.proj_q, torch.nn.Parameter) and loaded.proj_q.requires_grad and not loaded.training
    assert loaded.model_class == "WanTransformer3DModel" and loaded.layer_tiles(1) == [(4, 4, 8)] * 3
    for source in (str(tmp_path / "est"), tmp_path / "est", est):
        method = VedaMethod(VedaConfig(density=0.2, estimator=source), INFO)
        assert torch.equal(method.estimator.proj_q, est.proj_q)
    # the method's scores are the estimator's logits
    grid = (4, 8, 16)
    layout = head_tiling(grid, (4, 4, 8), 3, 128)
    q, k = (layout.gather(torch.randn(1, math.prod(grid), 3, 32)) for _ in range(2))
    qf, kf = trippool_qk(q, k, 128, layout.num_video_tiles)
    torch.testing.assert_close(method.scores(q, k, layout, 1), est(qf, kf, 1).detach())
    assert not torch.allclose(method.scores(q, k, layout, 1), mean_pooled_logits(qf, kf))


def test_loading_is_safetensors_only_and_strict(tmp_path):
    est = make_est()
    est.save_pretrained(tmp_path / "est")
    (tmp_path / "est" / "model.safetensors").rename(tmp_path / "est" / "pytorch_model.bin")
    with pytest.raises(ValueError, match="safetensors"):
        VedaEstimator.from_pretrained(tmp_path / "est")
    from safetensors.torch import save_file

    save_file({"proj_q": est.proj_q.detach()}, str(tmp_path / "est" / "model.safetensors"))
    with pytest.raises(ValueError, match="model.safetensors.*cannot be loaded.*proj_k"):
        VedaEstimator.from_pretrained(tmp_path / "est")
    (tmp_path / "est" / "model.safetensors").write_bytes(b"x" * 100)                # a damaged file
    with pytest.raises(ValueError, match="cannot be loaded .*header"):
        VedaEstimator.from_pretrained(tmp_path / "est")
    (tmp_path / "est" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"config.json' lacks \['model_class', 'num_layers'"):
        VedaEstimator.from_pretrained(tmp_path / "est")


@pytest.mark.parametrize("field,value,match", [
    ("num_heads", 4, "num_heads: estimator has 4"),
    ("head_dim", 64, "head_dim: estimator has 64"),
    ("num_layers", 3, "num_layers: estimator has 3"),
    ("model_class", "HunyuanVideoTransformer3DModel", "model_class"),
    ("tile_shapes", (8, 4, 4), "tile shapes of layer 0"),
])
def test_mismatched_estimator_is_a_clear_error(field, value, match):
    est = make_est(**{field: value})
    with pytest.raises(ValueError, match=match):
        VedaMethod(VedaConfig(density=0.1, estimator=est, tiling=(4, 4, 8)), INFO)


@pytest.mark.parametrize("num_layers", [1, 3])
def test_estimator_of_another_depth_is_a_clear_error_with_its_own_tiling(num_layers):
    """With the default tiling (the estimator's own tile shapes) a shallower estimator is the same clear error,
    not an IndexError from looking up the shapes of layers it does not have."""
    with pytest.raises(ValueError, match=f"num_layers: estimator has {num_layers}, the model/config has 2"):
        VedaMethod(VedaConfig(density=0.1, estimator=make_est(num_layers=num_layers)), INFO)


def test_default_tiling_is_the_estimators_own():
    per_head = [[(8, 4, 4), (2, 8, 8), (4, 4, 8)], (8, 4, 4)]
    method = VedaMethod(VedaConfig(density=0.1, estimator=make_est(tile_shapes=per_head)), INFO)
    assert [tuple(s) for s in method.tile_shapes(0, 3)] == [(8, 4, 4), (2, 8, 8), (4, 4, 8)]
    assert method.head_shapes(1, 3) == [(8, 4, 4)] * 3
    assert VedaMethod(VedaConfig(density=0.1), INFO).tile_shapes(0, 3) == (4, 4, 8)
    assert VedaMethod(VedaConfig(density=0.1, block=64), INFO).tile_shapes(0, 3) == (4, 4, 4)


def test_estimator_config_validation():
    with pytest.raises(ValueError, match="num_heads=0"):
        make_est(num_heads=0)
    with pytest.raises(ValueError, match="product|pt\\*ph\\*pw"):
        make_est(tile_shapes=(4, 4, 4))
    with pytest.raises(ValueError, match="names 3 layers"):
        make_est(tile_shapes=[(4, 4, 8)] * 3)
    per_head = [[(4, 4, 8), (8, 4, 4), (2, 8, 8)], (4, 4, 8)]
    assert make_est(tile_shapes=per_head).layer_tiles(0) == [(4, 4, 8), (8, 4, 4), (2, 8, 8)]
    assert make_est(tile_shapes="4x4x8").layer_tiles(1) == [(4, 4, 8)] * 3     # the string form VedaConfig takes
    assert make_est(tile_shapes=["8x4x4", ["4x4x8", (8, 4, 4), "2x8x8"]]).layer_tiles(1) == [(4, 4, 8), (8, 4, 4),
                                                                                           (2, 8, 8)]
    with pytest.raises(ValueError, match=r"tile_shapes\[0\]\[0\]=\[-4, -4, 8\] must be three positive ints"):
        make_est(tile_shapes=(-4, -4, 8))
    with pytest.raises(ValueError, match=r"tile_shapes=\(4, 4, 8.0\) names 3 layers; expected one \(pt, ph, pw\)"):
        make_est(tile_shapes=(4, 4, 8.0))
    with pytest.raises(ValueError, match=r"tile_shapes\[1\]=7: expected one \(pt, ph, pw\)"):
        make_est(tile_shapes=[(4, 4, 8), 7])
    with pytest.raises(ValueError, match="tile_shapes=128 must be one"):
        make_est(tile_shapes=128)
    with pytest.raises(ValueError, match="density='0.1' must be a number"):
        make_est(density="0.1")
    # a block no config takes (its mismatch error at apply suggested VedaConfig(block=96), which is refused)
    with pytest.raises(ValueError, match=r"block=96 is not supported; choose one of \(64, 128\)"):
        make_est(block=96, tile_shapes=(4, 4, 6))
    with pytest.raises(TypeError, match="VedaEstimator"):
        VedaMethod(VedaConfig(density=0.1, estimator=object()), INFO)


def test_kl_loss_definition_and_masking():
    torch.manual_seed(1)
    heat = torch.rand(2, 3, 4, 5)
    p = heat / heat.sum(-1, keepdim=True)
    logits = torch.randn(2, 3, 4, 5)
    ref = (p * (p.log() - torch.log_softmax(logits, -1))).sum(-1).mean()
    torch.testing.assert_close(tile_kl_loss(logits, heat), ref)
    assert float(tile_kl_loss(p.log() + 3.0, heat)) == pytest.approx(0.0, abs=1e-6)   # matching logits: zero
    # masked columns: the loss equals the loss on the unmasked columns alone
    col = torch.tensor([True, True, True, False, False])
    garbage = heat.clone()
    garbage[..., 3:] = 100.0
    masked = tile_kl_loss(logits, garbage, col_valid=col)
    torch.testing.assert_close(masked, tile_kl_loss(logits[..., :3], heat[..., :3]))
    # rows with zero teacher mass are skipped, and the mean is over valid rows then heads
    z = heat.clone()
    z[0, 0, 1:] = 0.0
    lz = tile_kl_loss(logits, z)
    row_kl = (p * (p.log() - torch.log_softmax(logits, -1))).sum(-1)               # [B, H, M]
    per_head = row_kl.mean(-1)
    per_head[0, 0] = row_kl[0, 0, 0]
    torch.testing.assert_close(lz, per_head.mean())


def test_recall():
    torch.manual_seed(0)
    heat = torch.rand(1, 2, 10, 10)
    assert tile_recall(heat.log(), heat, 0.3)["recall"] == 1.0
    r = tile_recall(-heat, heat, 0.3)                    # reversed ranking: only the forced diagonal agrees
    assert r["recall_offdiag"] == 0.0 and r["recall"] == pytest.approx(1 / 3)


def test_heat_recall_weighs_each_tile_by_its_teacher_heat():
    """4 tiles at density 0.5: the diagonal and one more per row. The estimator takes every row's second-best
    off-diagonal tile, so it keeps the diagonal's heat plus the second best against the diagonal plus the best."""
    torch.manual_seed(0)
    heat = torch.rand(1, 1, 4, 4) * 0.5 + 0.1
    off = ~torch.eye(4, dtype=torch.bool)
    ranked = heat[0, 0].masked_fill(~off, -1).sort(-1, descending=True)
    best, second = ranked.values[:, 0], ranked.values[:, 1]
    scores = torch.zeros(4, 4)
    scores[torch.arange(4), ranked.indices[:, 1]] = 1.0           # the second-best off-diagonal tile, per row
    r = tile_recall(scores[None, None], heat, 0.5)
    diag = heat[0, 0].diagonal()
    assert r["recall"] == pytest.approx(0.5) and r["recall_offdiag"] == 0.0
    assert r["heat_recall"] == pytest.approx(float((diag + second).sum() / (diag + best).sum()))
    assert r["heat_recall_offdiag"] == pytest.approx(float(second.sum() / best.sum()))
    assert tile_recall(heat.log(), heat, 0.5)["heat_recall"] == 1.0


def test_oracle_near_ties_counts_rows_whose_best_skipped_tile_is_close_to_the_weakest_kept():
    """4 tiles at density 0.5 (the diagonal, whose heat plays no part, and the best other tile per row)."""
    from videosparse.veda.losses import oracle_near_ties

    heat = torch.tensor([[0.0, 1.0, 0.95, 0.1],          # 0.95 of the kept tile's heat: a tie within 10%
                         [1.0, 9.0, 0.5, 0.1],           # the diagonal's 9 plays no part: no tie
                         [1.0, 0.99, 0.0, 0.0],          # a tie within 2%
                         [1.0, 0.2, 0.1, 0.0]])[None, None]
    assert oracle_near_ties(heat, 0.5) == pytest.approx(0.5)
    assert oracle_near_ties(heat, 0.5, within=0.02) == pytest.approx(0.25)
    assert oracle_near_ties(heat, 0.5, within=0.005) == 0.0
    assert oracle_near_ties(heat, 1.0) != oracle_near_ties(heat, 1.0)          # nothing skipped: NaN
    with pytest.raises(ValueError, match="within=1.0"):
        oracle_near_ties(heat, 0.5, within=1.0)


def test_estimator_paths_that_hold_no_estimator_are_clear_errors(tmp_path):
    from videosparse.veda.estimator import load_estimator

    with pytest.raises(ValueError, match="neither an existing directory nor a hub id"):
        load_estimator(tmp_path / "no_such_dir")
    with pytest.raises(ValueError, match="neither an existing directory nor a hub id"):
        load_estimator("./estimators/wan13b")
    # a hub id in form that is meant as a local folder: named, not the hub client's LocalEntryNotFoundError (offline)
    with pytest.raises(ValueError, match="'my_runs/est': no such local directory .* as a hub id it cannot be loaded"):
        load_estimator("my_runs/est")
    with pytest.raises(ValueError, match="'my_runs/est': no such local directory"):     # review 54: the class method
        VedaEstimator.from_pretrained("my_runs/est")                                  # gave the hub's bare error
    with pytest.raises(ValueError, match="estimator='my_runs/est@v2': no such local directory"):    # with its revision
        load_estimator("my_runs/est@v2")
    with pytest.raises(ValueError, match=r"estimator='\./my_runs/est': no such local directory"):  # a path takes none
        VedaEstimator.from_pretrained("./my_runs/est", revision="v2")
    with pytest.raises(ValueError, match="has no config.json or model.safetensors"):
        load_estimator(tmp_path)
    (tmp_path / "tiling.json").write_text("{}")             # a file where the directory belongs: said so
    with pytest.raises(ValueError, match="tiling.json' is a file; give the directory"):
        load_estimator(tmp_path / "tiling.json")
    with pytest.raises(ValueError, match="holds no config.json"):
        VedaEstimator.from_pretrained(tmp_path)

    # weights without config.json still load when every constructor argument is given
    est = make_est()
    (tmp_path / "weights_only").mkdir()
    est.save_pretrained(tmp_path / "with_config")
    (tmp_path / "with_config" / "model.safetensors").rename(tmp_path / "weights_only" / "model.safetensors")
    config = json.loads((tmp_path / "with_config" / "config.json").read_text())
    loaded = VedaEstimator.from_pretrained(tmp_path / "weights_only", **config)
    assert torch.equal(loaded.proj_q, est.proj_q)
    # a damaged config.json is named, not a JSONDecodeError / AttributeError from inside huggingface_hub
    for text, match in (("garbage", "cannot be read as JSON"), ("[1, 2]", "holds a list, not the JSON object")):
        (tmp_path / "with_config" / "model.safetensors").write_bytes(b"")
        (tmp_path / "with_config" / "config.json").write_text(text)
        with pytest.raises(ValueError, match=f"estimator config .*config.json.* {match}"):
            load_estimator(tmp_path / "with_config")


def test_config_with_a_loaded_estimator_round_trips_through_its_dict(tmp_path):
    """to_dict writes the path an estimator was loaded from; the rebuilt config loads the same weights."""
    make_est(init_std=0.3).save_pretrained(tmp_path / "est")
    for given in (str(tmp_path / "est"), tmp_path / "est"):
        est = VedaEstimator.from_pretrained(given)
        assert est.source == str(tmp_path / "est")
        cfg = VedaConfig(density=0.2, estimator=est)
        d = json.loads(json.dumps(cfg.to_dict()))
        assert d["estimator"] == str(tmp_path / "est")
        back = config_from_dict(d)
        assert back == VedaConfig(density=0.2, estimator=str(tmp_path / "est"))
        assert torch.equal(VedaMethod(back, INFO).estimator.proj_q, est.proj_q)
    assert make_est().source is None


def test_config_with_an_in_memory_estimator_is_marked_and_refused_on_load():
    """An estimator built in memory has no path: its dict entry cannot pass for one, and loading it says why."""
    d = VedaConfig(density=0.2, estimator=make_est()).to_dict()
    assert d["estimator"] == "<in-memory VedaEstimator for WanTransformer3DModel, never saved>"
    with pytest.raises(ValueError, match=r"never saved.*save_pretrained"):
        config_from_dict(d)
    with pytest.raises(ValueError, match="never saved"):
        VedaConfig(estimator=d["estimator"])


def test_the_callers_estimator_is_left_as_it_was():
    """VedaMethod runs an fp32 eval copy without grads; the caller's module keeps dtype, mode, grads and device."""
    est = make_est(init_std=0.3).to(torch.bfloat16).train()
    est.proj_q.grad = torch.ones_like(est.proj_q)
    weights = est.proj_q.detach().clone()
    method = VedaMethod(VedaConfig(density=0.2, estimator=est), INFO)
    layout = head_tiling((4, 8, 16), (4, 4, 8), 3, 128)
    q, k = (layout.gather(torch.randn(1, 512, 3, 32)) for _ in range(2))
    method.scores(q, k, layout, 1)
    method.prepare("meta")
    assert est.proj_q.dtype == torch.bfloat16 and est.training and est.proj_q.requires_grad
    assert est.proj_q.device.type == "cpu" and torch.equal(est.proj_q.detach(), weights)
    assert torch.equal(est.proj_q.grad, torch.ones_like(est.proj_q))
    run = method.estimator
    assert run is not est and run.proj_q.dtype == torch.float32 and not run.training
    assert not run.proj_q.requires_grad and run.proj_q.grad is None


def test_the_callers_estimator_is_left_as_it_was_through_apply():
    import videosparse
    from videosparse.models.tiny_wan import build_tiny_wan_pipeline

    transformer = build_tiny_wan_pipeline().transformer
    est = make_est(num_heads=2, head_dim=64, block=64, tile_shapes=(1, 4, 16)).to(torch.bfloat16).train()
    videosparse.apply(transformer, VedaConfig(density=0.5, estimator=est, block=64, dense_steps=0))
    with torch.no_grad():
        transformer(hidden_states=torch.randn(1, 4, 2, 16, 24), timestep=torch.tensor([500]),
                    encoder_hidden_states=torch.randn(1, 8, 32))
    videosparse.remove(transformer)
    assert est.proj_q.dtype == torch.bfloat16 and est.training and est.proj_q.requires_grad


def test_default_tiling_rule_is_the_documented_one():
    """VedaConfig's docstring states the tile shape used without an estimator or tiling, per block size."""
    from videosparse.config import DEFAULT_TILES

    for block, shape in DEFAULT_TILES.items():
        assert f"{shape} for block={block}" in " ".join(VedaConfig.__doc__.split())
        assert VedaMethod(VedaConfig(density=0.1, block=block), INFO).tile_shapes(0, 3) == shape


def test_tile_mismatch_hint_names_tiling_json_only_when_there_is_one(tmp_path):
    """An estimator trained with one fixed tile shape has no tiling.json: the error names the shape to pass."""
    make_est(tile_shapes=(8, 4, 4)).save_pretrained(tmp_path / "est")
    est = VedaEstimator.from_pretrained(tmp_path / "est")
    with pytest.raises(ValueError, match=r"tiling=None.*VedaConfig\(tiling=\(8, 4, 4\)\) \(--tiling 8x4x4\)\)") as err:
        VedaMethod(VedaConfig(density=0.1, estimator=est, tiling=(4, 4, 8)), INFO)
    assert "tiling.json" not in str(err.value)
    (tmp_path / "est" / "tiling.json").write_text(json.dumps({"layers": est.tile_shapes}))   # the estimator's own
    with pytest.raises(ValueError, match=f"tiling={str(tmp_path / 'est' / 'tiling.json')!r}"):
        VedaMethod(VedaConfig(density=0.1, estimator=est, tiling=(4, 4, 8)), INFO)
    per_head = make_est(tile_shapes=[[(8, 4, 4), (2, 8, 8), (4, 4, 8)], (8, 4, 4)])
    with pytest.raises(ValueError,
                       match=r"tiling=None\) \(no --tiling\), the default, to use the tile shapes .* trained with\)"):
        VedaMethod(VedaConfig(density=0.1, estimator=per_head, tiling=(4, 4, 8)), INFO)


def test_estimator_tile_shapes_may_be_numpy_ints(tmp_path):
    np = pytest.importorskip("numpy")
    est = make_est(tile_shapes=(np.int64(8), np.int32(4), np.int64(4)))
    assert est.layer_tiles(1) == [(8, 4, 4)] * 3 and all(type(v) is int for v in est.tile_shapes[0][0])
    est.save_pretrained(tmp_path / "est")
    assert json.loads((tmp_path / "est" / "config.json").read_text())["tile_shapes"] == [8, 4, 4]
    assert VedaEstimator.from_pretrained(tmp_path / "est").tile_shapes == est.tile_shapes
    est = make_est(density=np.float32(0.25))            # the hub mixin would save a numpy float as null
    est.save_pretrained(tmp_path / "est2")
    assert VedaEstimator.from_pretrained(tmp_path / "est2").density == 0.25


def test_estimator_sizes_may_be_numpy_ints_and_block_64_takes_its_own_default_tiles(tmp_path):
    """Review 55: numpy sizes were refused ("must be a positive int") and block=64 without tile_shapes raised about
    the 4x4x8 of block 128; the repr names what it serves and where it came from."""
    np = pytest.importorskip("numpy")
    est = VedaEstimator("WanTransformer3DModel", np.int64(2), np.int32(3), 64, block=np.int64(64))
    assert (est.num_layers, est.num_heads, est.block) == (2, 3, 64) and type(est.num_layers) is int
    assert est.layer_tiles(0) == [(4, 4, 4)] * 3
    assert VedaEstimator("WanTransformer3DModel", 2, 3, 32).layer_tiles(0)[0] == (4, 4, 8)
    est.save_pretrained(tmp_path / "est")
    saved = json.loads((tmp_path / "est" / "config.json").read_text())
    assert (saved["num_layers"], saved["num_heads"], saved["block"], saved["tile_shapes"]) == (2, 3, 64, [4, 4, 4])
    assert repr(est) == "VedaEstimator(WanTransformer3DModel, 2 layers x 3 heads x 64, block=64, source=None)"
    assert f"source={os.fspath(tmp_path / 'est')!r}" in repr(VedaEstimator.from_pretrained(tmp_path / "est"))
    for bad in (np.float64(2.0), True, 0):
        with pytest.raises(ValueError, match="num_layers=.* must be a positive int"):
            VedaEstimator("WanTransformer3DModel", bad, 3, 64)


def test_an_estimator_object_with_non_finite_weights_is_refused_at_apply():
    """Review 55: from_pretrained refused NaN weights, an estimator object passed to VedaConfig ran them (NaN scores
    are never chosen: each query tile kept only its own tile, at any density)."""
    import videosparse
    from videosparse.models.tiny_wan import build_tiny_wan_pipeline

    transformer = build_tiny_wan_pipeline().transformer
    est = make_est(num_heads=2, head_dim=64, block=64, tile_shapes=(1, 4, 16))
    with torch.no_grad():
        est.proj_k[1, 0, 3, 2] = float("inf")
    with pytest.raises(ValueError, match="estimator 'built in memory' holds non-finite values in proj_k"):
        videosparse.apply(transformer, VedaConfig(density=0.5, estimator=est, block=64))
    assert not videosparse.sessions(transformer)                # nothing half-applied


def test_kl_loss_with_nothing_valid_is_zero_even_with_masked_columns():
    """Review find: with col_valid masking a column and no valid row, the 'zero' was -inf * 0 = NaN."""
    logits = torch.randn(1, 2, 3, 4, requires_grad=True)
    col = torch.tensor([True, True, True, False])
    nothing = torch.zeros(1, 2, 3, dtype=torch.bool)
    for heat, rows in ((torch.rand(1, 2, 3, 4), nothing), (torch.zeros(1, 2, 3, 4), None)):
        loss = tile_kl_loss(logits, heat, row_valid=rows, col_valid=col)
        assert loss.item() == 0.0 and loss.requires_grad
        loss.backward()
        assert bool(torch.isfinite(logits.grad).all())


@pytest.mark.parametrize("field, value", [("init_std", float("nan")), ("init_std", float("inf")), ("init_std", True),
                                          ("density", float("nan")), ("density", 0.0), ("density", 7.0)])
def test_estimator_refuses_a_bad_init_std_or_density(field, value):
    with pytest.raises(ValueError, match=f"{field}={value!r} must be"):
        make_est(**{field: value})


def test_from_pretrained_names_a_damaged_config(tmp_path):
    make_est().save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="config.json' holds a list, not the JSON object"):
        VedaEstimator.from_pretrained(tmp_path)


def test_from_pretrained_refuses_a_config_without_its_tiles_or_with_unknown_fields_and_non_finite_weights(tmp_path,
                                                                                                      monkeypatch):
    """Review finds: a config.json without `block` / `tile_shapes` loaded with the constructor's defaults (4x4x8 tiles
    for an estimator trained on others) and a misspelt field was dropped, both silently; NaN weights (a diverged
    distillation) loaded and then kept only each query tile's own tile."""
    est = VedaEstimator("WanTransformer3DModel", num_layers=2, num_heads=2, head_dim=64, block=64, tile_shapes=(1, 8, 8))
    est.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    for edit, match in ((lambda c: c.pop("tile_shapes"), r"lacks \['tile_shapes'\]"),
                        (lambda c: c.pop("block"), r"lacks \['block'\]"),
                        (lambda c: c.update(tile_shape=c.pop("tile_shapes")),
                         r"lacks \['tile_shapes'\]; holds unknown fields \['tile_shape'\]")):
        config = dict(saved)
        edit(config)
        (tmp_path / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=match):
            VedaEstimator.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(saved, num_heads="two")))
    with pytest.raises(ValueError, match="config.json of estimator .* does not describe a VedaEstimator"):
        VedaEstimator.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert VedaEstimator.from_pretrained(tmp_path).tile_shapes == est.tile_shapes
    # from the hub as well (huggingface_hub fills and drops fields the same way): the config file it fetches is checked
    import videosparse.veda.estimator as estimator_module

    bad = tmp_path / "hub" / "config.json"
    bad.parent.mkdir()
    bad.write_text(json.dumps({k: v for k, v in saved.items() if k != "tile_shapes"}))
    monkeypatch.setattr(estimator_module, "hf_hub_download", lambda repo_id, filename, **kw: str(bad))
    with pytest.raises(ValueError, match=r"lacks \['tile_shapes'\]"):
        VedaEstimator.from_pretrained("someone/veda-estimator")
    with torch.no_grad():
        est.proj_k[1, 0, 0, 0] = float("nan")
    est.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="hold non-finite values in proj_k"):
        VedaEstimator.from_pretrained(tmp_path)


def test_an_estimator_loaded_at_a_revision_or_from_a_cache_dir_reloads_from_its_config(tmp_path, monkeypatch):
    """Review finds: an estimator loaded from the hub at revision 'v2' recorded only its hub id, so its config's
    to_dict reloaded the main revision's weights, and one loaded from a cache_dir could not be reloaded; a model class
    given as the class itself, or a numpy init_std, were saved wrongly."""
    import numpy as np
    from diffusers import WanTransformer3DModel
    from huggingface_hub import constants

    from videosparse.config import VedaConfig, config_from_dict
    from videosparse.veda.estimator import load_estimator

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    repo = tmp_path / "hub" / "models--owner--est"
    torch.manual_seed(0)
    for ref, commit in (("main", "a" * 40), ("v2", "b" * 40)):      # an offline hub cache with two revisions
        VedaEstimator("WanTransformer3DModel", 2, 3, 32, init_std=0.3).save_pretrained(repo / "snapshots" / commit)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    v2 = VedaEstimator.from_pretrained("owner/est", revision="v2")
    assert v2.source == "owner/est@v2"
    reloaded = load_estimator(config_from_dict(VedaConfig(density=0.2, estimator=v2).to_dict()).estimator)
    main = load_estimator("owner/est")
    assert torch.equal(reloaded.proj_q, v2.proj_q) and not torch.equal(reloaded.proj_q, main.proj_q)
    other_cache = tmp_path / "elsewhere"
    (other_cache / "models--owner--est").parent.mkdir()
    import shutil

    shutil.copytree(repo, other_cache / "models--owner--est")
    cached = VedaEstimator.from_pretrained("owner/est", cache_dir=other_cache)
    assert os.path.isdir(cached.source) and torch.equal(load_estimator(cached.source).proj_q, cached.proj_q)
    est = VedaEstimator(WanTransformer3DModel, 1, 1, 8, init_std=np.float32(0.25))
    est.save_pretrained(tmp_path / "est")
    back = VedaEstimator.from_pretrained(tmp_path / "est")
    assert back.model_class == "WanTransformer3DModel" and back.init_std == 0.25
    for bad in (None, ""):
        with pytest.raises(ValueError, match="model_class=.* must be the name of the transformer class"):
            VedaEstimator(bad, 1, 1, 8)


def test_a_hub_id_that_cannot_be_reached_is_asked_for_once(monkeypatch):
    """Review find: every failed hub lookup ran twice (our config check swallowed the error, then the mixin asked
    again), so a mistyped local folder took two rounds of huggingface_hub's retries (46 s offline) to fail."""
    import huggingface_hub.hub_mixin as hub_mixin
    from huggingface_hub.errors import LocalEntryNotFoundError

    import videosparse.veda.estimator as estimator_module

    calls = []

    def unreachable(*args, **kwargs):
        calls.append(kwargs.get("filename"))
        raise LocalEntryNotFoundError("no network")

    monkeypatch.setattr(estimator_module, "hf_hub_download", unreachable)
    monkeypatch.setattr(hub_mixin, "hf_hub_download", unreachable)
    with pytest.raises(ValueError, match="estimator='runs/est': no such local directory"):
        estimator_module.load_estimator("runs/est")
    assert calls == ["config.json"]


def test_a_revision_is_split_at_the_first_at_sign_and_a_local_folder_named_like_the_hub_id_is_refused(
        tmp_path, monkeypatch):
    """Review finds: a recorded 'owner/est@v2' loaded a local folder 'owner/est' (huggingface_hub takes a folder
    before the hub and ignores the revision), and a revision holding '@' was split at the wrong '@'."""
    from videosparse.veda.estimator import split_revision

    monkeypatch.chdir(tmp_path)
    assert split_revision("owner/est@feat@x") == ("owner/est", "feat@x")
    assert split_revision("owner/est") == ("owner/est", None)
    (tmp_path / "local@v2").mkdir()
    assert split_revision("local@v2") == ("local@v2", None)                    # an existing path is never split
    (tmp_path / "owner" / "est").mkdir(parents=True)
    with pytest.raises(ValueError, match="read as revision 'v2' of the hub id 'owner/est', the local folder"):
        split_revision("owner/est@v2")


def test_an_estimator_folder_under_home_is_found_through_a_tilde(tmp_path, monkeypatch):
    """Review find: `load_estimator('~/est')` with an existing ~/est said it was neither a directory nor a hub id (the
    file check expanded '~', the folder check did not)."""
    from videosparse.veda.estimator import distilled_component, load_estimator

    monkeypatch.setenv("HOME", str(tmp_path))
    VedaEstimator("WanTransformer3DModel", 1, 1, 8, component="transformer_2").save_pretrained(tmp_path / "est")
    assert load_estimator("~/est").num_layers == 1 and distilled_component("~/est") == "transformer_2"
    with pytest.raises(ValueError, match="is a file; give the directory"):
        load_estimator("~/est/config.json")


def test_a_target_density_below_the_forced_tiles_warns_once_per_tile_count(caplog):
    """Every query tile keeps its own tile and the global (text) tiles are always kept: a target below what they
    already make warns once per tile count, never for a dense layer (mutation testing: an inverted threshold that
    silenced the warning survived)."""
    import logging

    info = ModelInfo("X", 1, 2, 64, (1, 2, 2))
    layout = head_tiling((2, 16, 16), (4, 4, 8), 2, text_len=256)     # 4 video + 2 text tiles: 24 of 36 pairs
    with caplog.at_level(logging.WARNING, logger="videosparse"):
        method = VedaMethod(VedaConfig(density=0.05), info)
        for _ in range(2):
            method.on_layout(0, layout)
        VedaMethod(VedaConfig(density=0.05, dense_layers=(0,)), info).on_layout(0, layout)
        VedaMethod(VedaConfig(density=0.9), info).on_layout(0, layout)
        one_tile = head_tiling((4, 4, 8), (4, 4, 8), 2, text_len=64)    # 1 video + 1 text tile: "tile", not "tiles"
        VedaMethod(VedaConfig(density=0.05), info).on_layout(0, one_tile)
    warned = [r.getMessage() for r in caplog.records if "cannot be lower" in r.getMessage()]
    assert len(warned) == 2 and "target density 0.05 gives 0.667" in warned[0], warned
    assert "4 video tiles" in warned[0] and "2 global tiles" in warned[0], warned
    assert "1 video tile (" in warned[1] and "1 global tile (" in warned[1], warned


def test_offdiagonal_recall_counts_only_the_oracles_offdiagonal_tiles():
    """4 tiles at density 0.5: the oracle keeps the diagonal and one more tile per row. The estimator finds that
    tile in rows 0 and 1 only, so it recalls 2 of the oracle's 4 off-diagonal tiles (and 6 of its 8 tiles); the
    forced diagonal is not in the off-diagonal denominator (mutation testing)."""
    heat = torch.full((4, 4), 0.1)
    best = torch.tensor([1, 2, 3, 0])
    heat[torch.arange(4), best] = 0.5
    heat.fill_diagonal_(0.3)
    scores = torch.zeros(4, 4)
    scores[torch.arange(4), torch.tensor([1, 2, 0, 1])] = 1.0           # rows 2 and 3 pick a wrong tile
    r = tile_recall(scores[None, None], heat[None, None], 0.5)
    assert r["recall"] == pytest.approx(6 / 8) and r["recall_offdiag"] == pytest.approx(2 / 4)
    assert r["heat_recall_offdiag"] == pytest.approx((0.5 + 0.5 + 0.1 + 0.1) / (4 * 0.5))


def test_the_floor_warning_counts_video_and_global_tiles_each_by_its_own_number(caplog):
    """Mutation find: the floor warning's plurals were tested only where both counts agree (4 and 2, 1 and 1); the
    global tiles' "s" taken from the video tile count passed. 4 video tiles beside 1 text tile, and the reverse."""
    import logging

    info = ModelInfo("X", 1, 2, 64, (1, 2, 2))
    with caplog.at_level(logging.WARNING, logger="videosparse"):
        VedaMethod(VedaConfig(density=0.05), info).on_layout(0, head_tiling((2, 16, 16), (4, 4, 8), 2, text_len=128))
        VedaMethod(VedaConfig(density=0.05), info).on_layout(0, head_tiling((4, 4, 8), (4, 4, 8), 2, text_len=256))
    warned = [r.getMessage() for r in caplog.records if "cannot be lower" in r.getMessage()]
    assert len(warned) == 2, warned
    assert "4 video tiles (" in warned[0] and "1 global tile (" in warned[0], warned
    assert "1 video tile (" in warned[1] and "2 global tiles (" in warned[1], warned


def test_from_pretrained_names_an_argument_it_does_not_take_as_the_callers(tmp_path):
    """Review find (a user check of the docs): `from_pretrained(dir, transformer=pipe.transformer)` was reported as
    "the config.json of estimator ... does not describe a VedaEstimator", blaming a good estimator for the call."""
    from videosparse.veda.estimator import hub_load_args

    est = make_est()
    est.save_pretrained(tmp_path / "est")
    with pytest.raises(TypeError, match=r"unexpected argument\(s\) 'transformer'; it takes .*revision.*checked by "
                                        r"videosparse.apply"):
        VedaEstimator.from_pretrained(tmp_path / "est", transformer=torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="1 positional"):
        VedaEstimator.from_pretrained(tmp_path / "est", "main")
    # what it takes still works: huggingface_hub's own keywords (read from the installed version), the loader's,
    # and explicit constructor fields
    assert {"revision", "cache_dir", "token", "local_files_only", "map_location", "strict"} <= set(hub_load_args())
    loaded = VedaEstimator.from_pretrained(tmp_path / "est", local_files_only=True, map_location="cpu", strict=True)
    assert loaded.tile_shapes == est.tile_shapes
    assert VedaEstimator.from_pretrained(tmp_path / "est", density=0.3).density == 0.3


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_saved_weights_are_as_readable_as_the_umask_allows(tmp_path, umask, mode):
    """Review find: safetensors writes model.safetensors owner-only (0600) while config.json and README.md beside it
    follow the umask (0644), so a serving account could read the estimator's config but not its weights."""
    old = os.umask(umask)
    try:
        make_est().save_pretrained(tmp_path / "est")
    finally:
        os.umask(old)
    assert {name: os.stat(tmp_path / "est" / name).st_mode & 0o777 for name in os.listdir(tmp_path / "est")} == \
        {"model.safetensors": mode, "config.json": mode, "README.md": mode}
