"""Mutation finds of a pass over `videosparse.models.loading` (loading pipelines by name, offline) and
`videosparse.eval.generate` (the `videosparse generate` run: call, dense comparison, video, timings)."""

import numpy as np
import pytest
import torch

from videosparse.eval import generate as generate_module
from videosparse.eval.generate import GenerationResult, dense_comparison, generate, write_video
from videosparse.models import loading
from videosparse.models.tiny_wan import build_tiny_wan_pipeline

# 5 frames 32x32, one step: a tiny Wan call of well under a second on the CPU
CALL = dict(prompt="a red circle", num_frames=5, height=32, width=32, num_inference_steps=1, guidance_scale=1.0,
            max_sequence_length=8)


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_wan_pipeline(num_layers=1)


def test_default_dtype_is_bf16_on_every_cuda_device_and_fp32_elsewhere():
    """Mutation find: the dtype a run takes when --dtype is not given was tested only on the CPU (fp32); on a GPU it
    is bf16, on any CUDA device ("cuda:1" too, not only "cuda")."""
    assert loading.default_dtype("cuda") is torch.bfloat16
    assert loading.default_dtype("cuda:1") is torch.bfloat16
    assert loading.default_dtype(torch.device("cuda", 0)) is torch.bfloat16
    assert loading.default_dtype("cpu") is torch.float32


def test_tiny_is_built_offline_in_the_given_dtype_on_the_given_device():
    """Mutation find: no test loaded `--model tiny` through `load_pipeline`: the --dtype given (or the device it is
    given for) could be dropped unnoticed. The meta device stands in for a second device here (nothing computed)."""
    loaded = loading.load_pipeline("tiny", "meta", torch.bfloat16)
    assert loaded.name.startswith("tiny-wan")
    assert loaded.pipe.transformer.dtype == torch.bfloat16
    assert loaded.pipe.transformer.device.type == "meta" and loaded.pipe.vae.device.type == "meta"


def test_tiny_defaults_are_a_frame_count_and_size_the_pipeline_takes_as_asked():
    """Mutation find: the tiny model's call defaults were never checked against the pipeline: a frame count that is
    not 4k + 1 is rounded by Wan's pipeline (with a warning), a size off the VAE x patch grid refused."""
    loaded = loading.load_pipeline("tiny", "meta")
    pipe, call = loaded.pipe, loaded.defaults
    assert (call["num_frames"] - 1) % pipe.vae_scale_factor_temporal == 0
    loading.check_size(pipe, call)
    assert call == loading.TINY_DEFAULTS and call is not loading.TINY_DEFAULTS    # a copy: the caller updates it


def test_a_hub_model_loads_safetensors_only_in_the_given_dtype_with_its_own_call_defaults(tiny, monkeypatch):
    """Mutation find: `from_pretrained` was only ever stubbed to fail, so the dtype it is given went unchecked
    (dropped, diffusers loads fp32 on a GPU run meant for bf16). It is asked for safetensors only, and the defaults
    are the pipeline's own, its step count included (timings are per step only where the call names its steps)."""
    import diffusers

    asked = []

    def from_pretrained(model, **kwargs):
        asked.append((model, kwargs))
        return tiny

    monkeypatch.setattr(diffusers.DiffusionPipeline, "from_pretrained", from_pretrained)
    loaded = loading.load_pipeline("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "cpu", torch.bfloat16)
    assert asked == [("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", {"dtype": torch.bfloat16, "use_safetensors": True})]
    assert loaded.pipe is tiny and loaded.name == "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    assert loaded.defaults == {"prompt": loading.HUB_PROMPT, "num_frames": 81, "height": 480, "width": 832,
                               "num_inference_steps": 50, "guidance_scale": 5.0}


def test_a_failed_load_names_the_reason_that_fits(tmp_path, monkeypatch):
    """Mutation find: the two messages of a local folder that fails to load were never told apart (swapped, every test
    passed): a folder without a model_index.json is no pipeline folder, one with it a pipeline with a component
    missing. A hub repo of pickled weights (diffusers: no safetensors file) is named safetensors-only too."""
    import diffusers

    def fails(message):
        def from_pretrained(model, **kwargs):
            raise OSError(message)
        return from_pretrained

    monkeypatch.setattr(diffusers.DiffusionPipeline, "from_pretrained",
                        fails("Could not find the necessary `safetensors` weights in {...} (variant=None)"))
    with pytest.raises(OSError, match="'org/pickled': videosparse loads weights from safetensors files only"):
        loading.load_pipeline("org/pickled", "cpu")
    monkeypatch.setattr(diffusers.DiffusionPipeline, "from_pretrained", fails("Error no file named model_index.json"))
    with pytest.raises(OSError, match="has no model_index.json, so it is not a diffusers pipeline folder"):
        loading.load_pipeline(str(tmp_path), "cpu")
    (tmp_path / "model_index.json").write_text('{"_class_name": "WanPipeline"}')
    with pytest.raises(OSError, match="is a pipeline folder with a component missing or damaged"):
        loading.load_pipeline(str(tmp_path), "cpu")


def test_check_component_leaves_the_embedded_tiny_model_alone_beside_a_folder_named_tiny(tmp_path, monkeypatch):
    """Mutation find: `--model tiny` is the embedded model even where the working directory holds a folder named
    tiny (as check_model treats it); checked as that folder, --component was refused by the folder's index."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "model_index.json").write_text(
        '{"_class_name": "WanPipeline", "vae": ["diffusers", "AutoencoderKLWan"]}')
    loading.check_component("tiny", "transformer")
    with pytest.raises(ValueError, match="has no such component"):           # the folder itself is checked
        loading.check_component("./tiny", "transformer")


def test_generate_seeds_its_own_generator_and_returns_float32_frames(tiny):
    """Mutation find: no test generated twice with one seed and once with another: the seed could be ignored, or the
    generator not passed (the pipeline then draws from the global RNG, so one seed gives two videos)."""
    torch.manual_seed(123)
    first = generate(tiny, None, CALL, seed=1)
    torch.manual_seed(456)                                  # the global RNG must not matter
    again = generate(tiny, None, CALL, seed=1)
    other = generate(tiny, None, CALL, seed=0)
    assert first.frames.dtype == np.float32 and first.frames.shape == (5, 32, 32, 3)
    assert np.array_equal(first.frames, again.frames)
    assert not np.allclose(first.frames, other.frames)


def test_a_latent_generation_decodes_nothing_and_waits_for_its_latents(tiny, monkeypatch):
    """Mutation find: `output_type="latent"` (the warm-up runs) must reach the pipeline (no VAE decode, frames None)
    and its latents be synced before the clock stops (CUDA runs asynchronously): neither was checked."""
    synced = []
    monkeypatch.setattr(generate_module, "_sync_outputs", lambda out: synced.append(type(out.frames)))
    result = generate(tiny, None, CALL, output_type="latent")
    assert result.frames is None and synced == [torch.Tensor]
    assert len(result.transformer_s) == 1 and result.wall_s > 0


def test_dense_comparison_reads_the_dense_arm_and_the_psnr_between_the_arms():
    """Mutation find: `dense_comparison` was only checked for its speedup: the PSNR could compare the sparse video
    with itself (inf) and the dense wall time be the sparse arm's. Known frames and times: dense 0.2 s per forward,
    sparse 0.1 s, 4 forwards in 2 steps."""
    from videosparse.eval.metrics import psnr_video

    rng = np.random.default_rng(0)
    dense_frames = rng.uniform(0.2, 0.8, (3, 8, 8, 3)).astype(np.float32)
    sparse_frames = dense_frames + np.float32(0.01)
    sparse = GenerationResult(sparse_frames, [0.1] * 4, 3.0, None)
    dense = GenerationResult(dense_frames, [0.2] * 4, 7.0, None)
    got = dense_comparison(sparse, dense, steps=2)
    assert got["wall_s"] == 7.0 and got["transformer_s_per_step"] == pytest.approx(0.4)
    assert got["speedup"] == pytest.approx(2.0)
    expected = psnr_video(sparse_frames.astype(np.float16), dense_frames.astype(np.float16))
    assert np.isfinite(got["psnr_db"]) and got["psnr_db"] == pytest.approx(expected)
    assert got["psnr_db"] == pytest.approx(40.0, abs=0.1)         # 0.01 everywhere: 20 log10(1 / 0.01)


def test_seconds_per_step_of_a_call_without_steps_or_forwards_is_zero():
    """Mutation find: a pipeline that takes no step count and whose timer saw no transformer forward reads 0 s per
    forward, not a ZeroDivisionError after the whole run."""
    assert GenerationResult(None, [], 1.0, None).seconds_per_step(None) == 0.0
    assert GenerationResult(None, [0.5, 0.5], 1.0, None).seconds_per_step(None) == 0.5
    assert GenerationResult(None, [0.5, 0.5], 1.0, None).seconds_per_step(4) == 0.25


def test_ran_sparse_when_any_transformer_ran_a_sparse_call():
    """Mutation find: Wan 2.2's two experts: one expert kept dense (its dense steps) and the other sparse is a run
    that ran sparse; only single-transformer stats were tested."""
    stats = {"transformer": {"sparse_calls": 0, "dense_calls": 8, "kernel_backend": None},
             "transformer_2": {"sparse_calls": 8, "dense_calls": 0, "kernel_backend": "reference"}}
    result = GenerationResult(None, [], 0.0, stats)
    assert result.ran_sparse and result.kernels == ["reference"]
    assert not GenerationResult(None, [], 0.0, {"transformer": stats["transformer"]}).ran_sparse


def test_write_video_keeps_the_frame_rate_given(tmp_path):
    """Mutation find: --fps reached `write_video`, but no test read the rate of the video written (8, the default,
    for every video would have passed)."""
    import imageio.v2 as iio2

    # (a declared dependency; the GPU machine's environment, which gets only what a call carries, has none)
    pytest.importorskip("imageio_ffmpeg", reason="no ffmpeg for imageio to write the video with")

    frames = np.random.default_rng(0).random((4, 16, 16, 3)).astype(np.float32)
    path = write_video(frames, str(tmp_path / "v.mp4"), fps=5)
    reader = iio2.get_reader(path, format="FFMPEG")
    try:
        assert reader.get_meta_data()["fps"] == pytest.approx(5.0)
    finally:
        reader.close()


def test_generate_times_the_forwards_of_both_wan22_experts():
    """Mutation find: timing `pipe.transformer` alone (not every transformer of the pipeline) missed the steps of Wan
    2.2's low-noise expert, `transformer_2`; one forward per step here (guidance 1), half of them on each expert."""
    pipe = build_tiny_wan_pipeline(num_layers=1)
    pipe.register_modules(transformer_2=build_tiny_wan_pipeline(num_layers=1).transformer)
    pipe.register_to_config(boundary_ratio=0.5)                # transformer_2 takes the low-noise steps
    pipe.set_progress_bar_config(disable=True)
    result = generate(pipe, None, dict(CALL, num_inference_steps=4), output_type="latent")
    assert len(result.transformer_s) == 4 and all(t > 0 for t in result.transformer_s)


def test_warm_up_runs_one_step_of_a_pipeline_whose_step_count_defaults_to_none(monkeypatch):
    """Mutation find: a pipeline that takes `num_inference_steps` with no default of its own (so the call names none)
    must still warm up with one step; only a pipeline that takes no step count at all runs the call as given (an
    `or` for the `and` warmed such a pipeline up with its full default schedule)."""
    ran = []
    monkeypatch.setattr(generate_module, "generate", lambda pipe, config, call, **kw: ran.append(call))

    class StepsWithoutDefault:
        def __call__(self, prompt=None, num_inference_steps=None, generator=None, output_type="np"):
            pass

    class NoSteps:
        def __call__(self, prompt=None, generator=None, output_type="np"):
            pass

    assert generate_module.warm_up(StepsWithoutDefault(), None, {"prompt": "a cat"}) == 1
    assert ran == [{"prompt": "a cat", "num_inference_steps": 1}]
    assert generate_module.warm_up(NoSteps(), None, {"prompt": "a cat"}) is None
    assert ran[-1] == {"prompt": "a cat"}


def test_the_early_kernel_check_asks_about_the_dtype_autocast_attends_in(tiny, monkeypatch):
    """Mutation find: the check before any step must ask the kernel backend about the dtype the attention runs in,
    not the model's: an fp32 model run under bf16 autocast attends in bf16 (only a bf16 model was tested, where the
    two agree)."""
    import videosparse
    from videosparse.eval.generate import check_config_applies
    from videosparse.processors.session import SparseSession

    asked = []
    check = SparseSession.check_kernel
    monkeypatch.setattr(SparseSession, "check_kernel", lambda self, device, dtype: (asked.append(dtype),
                                                                                    check(self, device, dtype))[1])
    config = videosparse.SolConfig(density=0.5, block=64, tiling=(1, 4, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        check_config_applies(tiny, config, "cpu")
    check_config_applies(tiny, config, "cpu")
    assert asked == [torch.bfloat16, torch.float32] and videosparse.sessions(tiny) == {}
