"""Mutation pass over the Veda estimator, its losses and the torch teacher: each test closes a gap a surviving
mutant showed (the docstrings name what it guards)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from helpers import rel_err
from videosparse.veda.estimator import (VedaEstimator, estimator_label, load_estimator, records_no_component,
                                         split_revision)
from videosparse.veda.losses import oracle_near_ties, tile_kl_loss
from videosparse.veda.teacher import dense_lse_torch, teacher_heat, teacher_heat_torch


def make_est(**kw) -> VedaEstimator:
    args = dict(model_class="WanTransformer3DModel", num_layers=2, num_heads=3, head_dim=32, block=128,
                tile_shapes=(4, 4, 8))
    args.update(kw)
    return VedaEstimator(**args)


def row_kls(logits: torch.Tensor, heat: torch.Tensor) -> torch.Tensor:
    """fp64 KL(heat row normalised || softmax(logits row)) per row, [B, H, M]."""
    p = heat.double() / heat.double().sum(-1, keepdim=True)
    return (p * (p.log() - torch.log_softmax(logits.double(), -1))).sum(-1)


# ---------------------------------------------------------------- estimator
def test_a_negative_layer_is_refused_not_read_from_the_end():
    """Mutation find: `layer < num_layers` alone let layer=-1 score with the last layer's weights; only a layer past
    the end was tested."""
    est = make_est()
    qf, kf = torch.randn(1, 3, 5, 96), torch.randn(1, 3, 5, 96)
    with pytest.raises(ValueError, match="layer=-1 is out of range for an estimator of 2 layers"):
        est(qf, kf, -1)


def test_features_of_the_wrong_rank_are_a_clear_error():
    """Mutation find: without the `feat.dim() != 4` check, [B, H, 3D] features (one tile, its N dim dropped) failed
    with an IndexError from the shape lookup instead of the message naming the expected (B, H, N, 3D)."""
    est = make_est()
    with pytest.raises(ValueError, match=r"features have shape \(1, 3, 96\); expected \(B, 3, N, 96\)"):
        est(torch.randn(1, 3, 96), torch.randn(1, 3, 96), 0)


def test_a_bf16_estimator_scores_fp32_features_in_fp32():
    """Mutation find: the features are cast to the weights' dtype for the projection; without it a bf16 estimator
    given the fp32 TripPool features raised a dtype mismatch. The residual and the logits stay fp32."""
    est = make_est(init_std=0.3).to(torch.bfloat16)
    qf, kf = torch.randn(1, 3, 5, 96), torch.randn(1, 3, 5, 96)
    out = est(qf, kf, 1).detach()
    assert out.dtype == torch.float32 and out.shape == (1, 3, 5, 5)
    with torch.no_grad():
        ref = VedaEstimator.logits_with(qf.double(), kf.double(), est.proj_q[1].double(), est.proj_k[1].double())
    assert rel_err(out, ref) < 3e-2                 # the projection runs on bf16-rounded features


def test_logits_stay_fp32_under_autocast():
    """Mutation find: `forward` computes the logits with autocast off; without it the GEMM ran in bf16 under a
    training step's autocast and returned bf16 logits (documented fp32) to the KL. Only fp32 runs were tested."""
    est = make_est(init_std=0.3)
    qf, kf = torch.randn(1, 3, 5, 96), torch.randn(1, 3, 5, 96)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = est(qf, kf, 0)
    assert out.dtype == torch.float32
    assert rel_err(out.detach(), est(qf, kf, 0).detach()) < 3e-2     # the projection itself may run in bf16


def test_tile_shapes_for_too_few_layers_or_heads_are_refused():
    """Mutation finds: only a list of too *many* layers was tested, and no layer with the wrong number of per-head
    shapes; `len > num_layers` or a per-head list of any length built a ragged `tile_shapes` silently."""
    with pytest.raises(ValueError, match=r"names 1 layers; expected one \(pt, ph, pw\) of ints or 2 layers"):
        make_est(tile_shapes=[(4, 4, 8)])
    with pytest.raises(ValueError, match=r"tile_shapes\[0\]=\[\(4, 4, 8\), \(8, 4, 4\)\]: expected one \(pt, ph, pw\) "
                                         r"of ints or 3 of them \(one per head\)"):
        make_est(tile_shapes=[[(4, 4, 8), (8, 4, 4)], (4, 4, 8)])


def test_weights_saved_in_bf16_load_as_fp32(tmp_path):
    """Mutation find: the loaded tensors are cast to the parameters' dtype (fp32) before `assign=True`; without the
    cast an estimator saved in bf16 loaded as bf16 parameters (the documented proj_q, proj_k are fp32)."""
    est = make_est(init_std=0.3).to(torch.bfloat16)
    est.save_pretrained(tmp_path / "est")
    loaded = VedaEstimator.from_pretrained(tmp_path / "est")
    assert loaded.proj_q.dtype == torch.float32 and loaded.proj_k.dtype == torch.float32
    assert torch.equal(loaded.proj_q, est.proj_q.float()) and torch.equal(loaded.proj_k, est.proj_k.float())


def test_a_config_with_an_unknown_field_and_no_missing_one_is_refused(tmp_path):
    """Mutation find: unknown fields were tested only beside a missing one (a renamed `tile_shape`), so refusing on
    `missing` alone passed; a misspelt optional field (huggingface_hub drops it: the default init_std) is refused too."""
    make_est().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["init_sdt"] = config.pop("init_std")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json' holds unknown fields \['init_sdt'\]; save_pretrained"):
        VedaEstimator.from_pretrained(tmp_path)


def test_an_estimator_object_without_a_component_records_none():
    """Mutation find: `records_no_component` of an object (what decides apply's 'serves every transformer'
    warning) was only reached with directories; an object answering False passed."""
    assert records_no_component(make_est()) is True
    assert records_no_component(make_est(component="transformer_2")) is False


def test_an_estimator_path_is_named_by_its_string(tmp_path):
    """Mutation find: errors name a path estimator by `repr(os.fspath(path))`; `repr(path)` (PosixPath('...')) passed,
    as only string paths reached the messages in the tests."""
    path = tmp_path / "est"
    assert estimator_label(path) == repr(str(path))
    assert estimator_label((path, str(path))) == f"({str(path)!r}, {str(path)!r})"
    assert estimator_label(make_est()) == "<VedaEstimator object>"


def test_an_empty_component_name_is_refused():
    """Mutation find: `not component` in the component check: an empty name was accepted, saved, and later matched
    no transformer of any pipeline; only None and real names were tested."""
    with pytest.raises(ValueError, match="component='' must be the pipeline component it was distilled from"):
        make_est(component="")


def test_a_hub_id_without_an_owner_is_still_a_hub_id(tmp_path, monkeypatch):
    """Mutation find: hub ids may lack the owner ("gpt2"-style); requiring "owner/name" passed every test. Such a
    name with a revision is split, and one that is no folder is tried on the hub (offline here), not refused as
    neither a folder nor a hub id."""
    monkeypatch.chdir(tmp_path)
    assert split_revision("veda-est@v2") == ("veda-est", "v2")
    with pytest.raises(ValueError, match="estimator='veda-est': no such local directory .* as a hub id it cannot be"):
        load_estimator("veda-est")


def test_the_mismatch_hint_leaves_out_a_tiling_json_of_other_shapes(tmp_path):
    """Mutation find: the error names the estimator folder's tiling.json only when it holds the estimator's own shapes
    (one left by an earlier run into the folder would not); only a matching file, and none, were tested."""
    make_est(tile_shapes=(8, 4, 4)).save_pretrained(tmp_path / "est")
    est = VedaEstimator.from_pretrained(tmp_path / "est")
    other = [[[4, 4, 8]] * 3] * 2
    for text in (json.dumps({"layers": other}), "garbage"):
        (tmp_path / "est" / "tiling.json").write_text(text)
        with pytest.raises(ValueError, match=r"VedaConfig\(tiling=\(8, 4, 4\)\) \(--tiling 8x4x4\)\)") as err:
            est.check_compatible(tile_shapes=other)
        assert "tiling.json" not in str(err.value)


# ---------------------------------------------------------------- losses
def test_kl_loss_refuses_logits_and_heat_of_other_shapes():
    """Mutation find: comparing only the number of dims let heat of one head broadcast against logits of two; no test
    gave mismatched shapes."""
    with pytest.raises(ValueError, match=r"logits \(1, 2, 3, 5\) and heat \(1, 1, 3, 5\) must have the same shape"):
        tile_kl_loss(torch.randn(1, 2, 3, 5), torch.rand(1, 1, 3, 5))


def test_kl_loss_takes_negative_heat_as_zero():
    """Mutation find: the teacher heat is clamped at 0 (it is >= 0 by definition; rounding may leave -0 or a
    negative), so a negative entry counts as zero mass, not as a smaller row mass; no test had one."""
    logits, heat = torch.randn(1, 2, 3, 5), torch.rand(1, 2, 3, 5)
    clipped = heat.clone()
    clipped[0, 1, 2, 3] = 0.0
    negative = heat.clone()
    negative[0, 1, 2, 3] = -0.5
    torch.testing.assert_close(tile_kl_loss(logits, negative), tile_kl_loss(logits, clipped))


def test_kl_loss_leaves_a_head_with_no_valid_row_out_of_the_mean():
    """Mutation find: a (batch, head) with no valid row is left out of the mean (docstring); averaging it in as 0
    passed, as the tests had either every head valid or none."""
    logits, heat = torch.randn(1, 3, 4, 5), torch.rand(1, 3, 4, 5)
    heat[0, 1] = 0.0                                            # head 1: no teacher mass in any row
    ref = row_kls(logits, heat)[0, [0, 2]].mean()
    torch.testing.assert_close(tile_kl_loss(logits, heat).double(), ref)


def test_kl_loss_rows_marked_invalid_neither_count_nor_poison_the_gradient():
    """Mutation finds: row_valid was tested only with no valid row at all (the early zero). A pad row marked invalid
    but holding teacher mass must add nothing to the loss (its KL zeroed), and its logits, here NaN, must not turn
    the gradient NaN (they are replaced before the log-softmax)."""
    heat = torch.rand(1, 2, 3, 5)
    logits = torch.randn(1, 2, 3, 5)
    logits[0, 1, 2] = float("nan")
    logits.requires_grad_(True)
    row_valid = torch.ones(1, 2, 3, dtype=torch.bool)
    row_valid[0, 1, 2] = False
    loss = tile_kl_loss(logits, heat, row_valid=row_valid)
    kl = row_kls(logits.detach(), heat)
    ref = (kl[0, 0].mean() + kl[0, 1, :2].mean()) / 2
    torch.testing.assert_close(loss.detach().double(), ref)
    loss.backward()
    assert bool(torch.isfinite(logits.grad).all())
    assert bool((logits.grad[0, 1, 2] == 0).all()) and bool((logits.grad[0, 1, :2] != 0).any())


def test_oracle_near_ties_within_zero_counts_exact_ties():
    """Mutation finds: `within` lies in [0, 1) and a tie is best skipped >= (1 - within) * weakest kept; refusing
    within=0 or comparing with `>` passed. With within=0 only exact ties count: rows 0 and 2 (two equal best tiles,
    one kept and one skipped) of 4 at density 0.5."""
    heat = torch.tensor([[0.0, 1.0, 1.0, 0.1],
                         [1.0, 9.0, 0.5, 0.1],
                         [0.5, 0.5, 0.0, 0.1],
                         [1.0, 0.2, 0.1, 0.0]])[None, None]
    assert oracle_near_ties(heat, 0.5, within=0.0) == pytest.approx(0.5)


def test_oracle_near_ties_is_nan_when_the_oracle_keeps_only_the_diagonal():
    """Mutation find: rows that keep no off-diagonal tile are not counted (NaN when no row is left); counting them
    as non-ties gave 0.0. Only 'nothing skipped' (density 1) was tested; at 8 tiles and density 0.1 each row keeps
    just its forced diagonal."""
    value = oracle_near_ties(torch.rand(1, 2, 8, 8), 0.1)
    assert math.isnan(value)


# ---------------------------------------------------------------- teacher (torch path)
def test_the_teacher_refuses_zero_tiles():
    """Mutation find: `0 < n` in teacher_num_tiles: with `0 <= n` num_tiles=0 gave an empty heat; only a
    num_tiles above the limit was tested for the teacher."""
    q = torch.randn(1, 2, 100, 16)
    with pytest.raises(ValueError, match=r"num_tiles=0 must lie in \[1, 2\]"):
        teacher_heat(q, q, 64, num_tiles=0, backend="torch")


def test_the_teacher_refuses_q_and_k_of_other_batch_or_heads():
    """Mutation find: without the `q.shape[:2] != k.shape[:2]` check a k of batch 1 broadcast against a q of batch 2
    (and one head against two) in the torch teacher's matmul, scoring silently."""
    q = torch.randn(2, 2, 128, 16)
    for k in (torch.randn(1, 2, 128, 16), torch.randn(2, 1, 128, 16)):
        with pytest.raises(ValueError, match=r"q and k must be \(B, H, S, D\) and \(B, H, Sk, D\); got \(2, 2, 128"):
            teacher_heat(q, k, 64, backend="torch")


def test_the_teacher_takes_its_scale_on_the_torch_path():
    """Mutation find: `teacher_heat` passes `scale` on to the torch teacher; dropping it (the default 1/sqrt(D)) passed,
    as no test gave a scale. Checked against the fp64 definition with that scale."""
    q, k = torch.randn(1, 2, 200, 16), torch.randn(1, 2, 200, 16)
    heat = teacher_heat(q, k, 64, scale=0.6, backend="torch")
    p = torch.softmax(q.double() @ k.double().transpose(-1, -2) * 0.6, -1)
    ref = torch.stack([torch.stack([p[..., i * 64:(i + 1) * 64, j * 64:(j + 1) * 64].amax((-1, -2)) for j in range(4)],
                                   -1) for i in range(4)], -2)
    torch.testing.assert_close(heat.double(), ref, rtol=1e-5, atol=1e-7)


def test_dense_lse_in_chunks_smaller_than_one_row_equals_one_pass():
    """Mutation find: the dense LSE takes at least one row per chunk; without `max(1, ...)` a bound below one row
    (B*H*Sk logits) gave a range() step of 0. The teacher's own chunking was tested, the LSE's was not."""
    q, k = torch.randn(1, 2, 100, 16), torch.randn(1, 2, 130, 16)
    torch.testing.assert_close(dense_lse_torch(q, k, max_chunk_elems=100), dense_lse_torch(q, k))


def test_the_triton_teacher_refuses_a_bad_lse_shape_before_launching():
    """Mutation find: the Triton wrapper checks the LSE's shape itself (its kernel would read out of bounds); only
    the torch path's check was tested. The check runs before any launch, so no GPU or interpreter is needed."""
    pytest.importorskip("triton")
    from videosparse.veda.triton_kernels import teacher_heat_triton

    q = torch.randn(2, 2, 100, 16)
    for lse in (torch.zeros(2, 2, 1), torch.zeros(2, 2, 128)):
        with pytest.raises(ValueError, match=r"lse has shape .*; expected \(2, 2, 100\)"):
            teacher_heat_triton(q, q, 64, lse=lse)


def test_fp64_inputs_are_scored_in_fp64():
    """Mutation finds: the torch teacher and dense LSE compute fp64 inputs in fp64 and round only the result to fp32;
    computing in fp32 passed every test (all fp32). In fp64 the result is the correctly rounded definition (<= half
    an fp32 ulp, 6e-8 relative); in fp32 the LSE was ~2 ulp off and the heat ~8e-7 relative here."""
    q, k = (torch.randn(1, 2, 256, 16, dtype=torch.float64) * 4 for _ in range(2))
    lse_ref = torch.logsumexp(q @ k.transpose(-1, -2) / 4, -1)
    lse = dense_lse_torch(q, k)
    assert lse.dtype == torch.float32
    assert float(((lse.double() - lse_ref).abs() / lse_ref.abs()).max()) < 1.2e-7
    q, k = q / 2, k / 2
    heat_ref = torch.softmax(q @ k.transpose(-1, -2) / 4, -1).view(1, 2, 4, 64, 4, 64).amax((3, 5))
    heat = teacher_heat_torch(q, k, 64)
    assert heat.dtype == torch.float32
    assert float(((heat.double() - heat_ref).abs() / heat_ref).max()) < 2e-7
