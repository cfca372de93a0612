"""scripts/profile_forward.py: kernel categories, and a CPU smoke run on a one-block Wan."""

import json

import pytest
from helpers import load_script


@pytest.fixture(scope="module")
def profile_forward():
    return load_script("profile_forward")


@pytest.mark.parametrize("name, category", [
    ("_gluon_fwd", "sparse kernel"),
    ("_hopper_fwd", "sparse kernel"),
    ("triton_poi_fused_add_block_sparse_attention_copy_eq_index_scalar", "inductor fused"),
    ("triton_red_fused__fused_rms_norm__scaled_dot_product_cudnn_attention_permute_view_14", "inductor fused"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", "dense attention"),
    ("nvjet_sm90_tst_256x152_64x4_1x2_h_bz_coopA_bias_TNT", "gemm"),
    ("_trippool_kernel", "plan building"),
    ("_topk_rows_kernel", "plan building"),
    ("void at::native::sbtopk::gatherTopK<c10::Half, unsigned int, 2, false>", "plan building"),
    ("_rope_gather_kernel", "layout gather"),
    ("Memset (Device)", "copies"),
    ("some_new_kernel", "other"),
])
def test_kernel_categories(profile_forward, name, category):
    assert profile_forward.kernel_category(name) == category


def test_cpu_smoke_run_writes_a_report(profile_forward, tmp_path, caplog):
    out = tmp_path / "profile.json"
    report = profile_forward.main(["--model", "wan-1.3b", "--frames", "5", "--height", "128", "--width", "128",
                                   "--layers", "1", "--device", "cpu", "--methods", "dense", "veda@0.5:block=64",
                                   "--warmup", "1", "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["meta"]["grid"] == [2, 8, 8] and report["meta"]["layers"] == 1
    for label in ("dense", "veda@0.5:block=64"):
        row = report["methods"][label]
        assert row["forward_ms"] > 0 and row["busy_ms"] > 0
        assert sum(row["by_category_ms"].values()) == pytest.approx(row["busy_ms"])
        assert row["top_kernels"] and row["idle_gaps"] is None     # no device timeline on CPU
        assert row["host_syncs"] is None and 0 < row["host_issue_ms"] <= row["forward_ms"] * 1.5
    assert "gemm" in report["methods"]["dense"]["by_category_ms"]
    # every profiled forward is a sparse step: no warning about fractional dense steps
    assert not [r for r in caplog.records if "dense_steps" in r.getMessage()]


def test_bad_repeats_are_refused(profile_forward):
    with pytest.raises(SystemExit):
        profile_forward.main(["--repeats", "0", "--device", "cpu"])


def test_sync_sites_are_recorded_and_counted_by_the_innermost_videosparse_frame(profile_forward, monkeypatch):
    """host_sync_sites keeps only the sync warnings, with their stacks; the script counts them by the innermost
    frame inside the package (CUDA's debug mode itself is stubbed here: no GPU on CPU)."""
    import os
    import warnings

    import torch

    import videosparse
    from videosparse.eval.timing import host_sync_sites, package_frames

    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def forward():
        warnings.warn("called a synchronizing CUDA operation")
        warnings.warn("an unrelated warning")

    sites = host_sync_sites(forward)
    assert modes == ["warn", 0] and len(sites) == 1 and sites[0][-1].endswith(":forward")
    assert not package_frames(sites[0])  # the helper's own frame (in the package) is not part of a site
    package = os.path.dirname(os.path.abspath(videosparse.__file__)) + os.sep
    stacks = [[f"{package}sol/threshold.py:192:pack_mask", f"{package}sol/method.py:140:plan", "/x/y.py:1:run"],
              [f"{package}sol/threshold.py:192:pack_mask", "/x/y.py:1:run"], ["/site-packages/diffusers/z.py:3:f"]]
    assert profile_forward.sync_sites_by_frame(stacks) == {"sol/threshold.py:192:pack_mask": 2,
                                                          "outside videosparse": 1}

