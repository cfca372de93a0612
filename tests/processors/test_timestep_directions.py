"""`ModelSpec.timestep_direction` against the pipelines: each family's tiny pipeline (built from the other tests'
helpers) runs 3 steps while a forward pre-hook reads the value step counting by timestep compares (the spec's
`step_timestep`, else the forward's `timestep`; the mean of its entries), which must move only in the declared
direction, and a `TimestepCounter` told that direction counts one step per distinct value, never starting again
within the call."""

import sys
import types

import numpy as np
import pytest
import torch
from PIL import Image

from videosparse.processors.forward_args import forward_arg
from videosparse.processors.registry import _MODEL_SPECS, _load_builtins, model_spec
from videosparse.processors.steps import TimestepCounter


def counted_timestep(transformer, args, kwargs) -> float | None:
    """What the context hook's `_step` hands the step counter, as `TimestepCounter.step` reads it (the mean)."""
    spec = model_spec(transformer)
    t = (spec.step_timestep(transformer, args, kwargs) if spec.step_timestep is not None else
         forward_arg(args, kwargs, "timestep", 1))
    return None if t is None else float(torch.as_tensor(t).detach().flatten().double().mean())


def _image(height, width, seed=0):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def _no_ftfy(monkeypatch, pipe):
    # the prompt cleaning of the Wan-style pipelines calls ftfy (not a videosparse dependency): an identity stand-in
    monkeypatch.setattr(sys.modules[type(pipe).__module__], "ftfy", types.SimpleNamespace(fix_text=lambda t: t),
                        raising=False)


PROMPT = dict(prompt="a red circle moving left", negative_prompt="blue")


# ------------------------------------------------------------------------------------------- the families' cases
# each: (monkeypatch) -> (pipeline, its call's keyword arguments); 3 steps, latent output where the pipeline has one
def _wan(monkeypatch):
    from videosparse.models.tiny_wan import build_tiny_wan_pipeline

    pipe = build_tiny_wan_pipeline()
    pipe.set_progress_bar_config(disable=True)
    _no_ftfy(monkeypatch, pipe)
    return pipe, dict(PROMPT, num_frames=5, height=32, width=32, num_inference_steps=3, output_type="latent",
                      max_sequence_length=16)


def _wan_family(name, **kw):
    def case(monkeypatch):
        from test_wan_family import _tiny_family_pipeline

        pipe = _tiny_family_pipeline(name)
        _no_ftfy(monkeypatch, pipe)
        return pipe, {**PROMPT, "num_frames": 5, "height": 32, "width": 32, "num_inference_steps": 3,
                      "output_type": "latent", "max_sequence_length": 16, **kw}
    return case


def _wan_animate(monkeypatch):
    from test_wan_family import _tiny_animate_pipeline

    pipe = _tiny_animate_pipeline()
    _no_ftfy(monkeypatch, pipe)
    return pipe, dict(PROMPT, image=_image(32, 32), pose_video=[_image(32, 32, i) for i in range(5)],
                      face_video=[_image(8, 8, i) for i in range(5)], height=32, width=32, segment_frame_length=5,
                      num_inference_steps=3, output_type="latent", max_sequence_length=16)


def _chronoedit(monkeypatch):
    from test_chronoedit_anyflow import _tiny_chronoedit_pipeline

    pipe = _tiny_chronoedit_pipeline()
    _no_ftfy(monkeypatch, pipe)
    return pipe, dict(PROMPT, image=_image(64, 64), num_frames=5, height=64, width=64, num_inference_steps=3,
                      guidance_scale=2.0, output_type="latent", max_sequence_length=16)


def _anyflow(monkeypatch):
    from test_chronoedit_anyflow import _tiny_anyflow_pipeline

    pipe = _tiny_anyflow_pipeline()
    _no_ftfy(monkeypatch, pipe)
    # a conditioning latent frame: its tokens' timestep is 0, the others' the step's
    video_latents = torch.randn(1, 1, 4, 12, 16, generator=torch.Generator().manual_seed(3))
    return pipe, dict(PROMPT, num_frames=9, height=96, width=128, num_inference_steps=3, guidance_scale=2.0,
                      output_type="latent", max_sequence_length=16, video_latents=video_latents)


def _helios(monkeypatch):
    from diffusers import HeliosPipeline, HeliosScheduler
    from test_helios import tiny_helios

    from videosparse.models.tiny_wan import build_tiny_wan_pipeline

    wan = build_tiny_wan_pipeline()
    pipe = HeliosPipeline(tokenizer=wan.tokenizer, text_encoder=wan.text_encoder, vae=wan.vae,
                          scheduler=HeliosScheduler(stages=1), transformer=tiny_helios(text_dim=32))
    pipe.set_progress_bar_config(disable=True)
    _no_ftfy(monkeypatch, pipe)
    monkeypatch.setattr(pipe.vae, "decode", lambda latents, return_dict=False: (latents,))   # decodes every chunk
    return pipe, dict(PROMPT, num_frames=9, height=64, width=192, num_inference_steps=3, guidance_scale=1.0,
                      output_type="latent", max_sequence_length=16, history_sizes=[4, 2, 1],
                      num_latent_frames_per_chunk=3)


def _hunyuan(monkeypatch):
    from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline
    from test_hunyuan import TEXT, TestHunyuanProcessors

    pipe = HunyuanVideoPipeline(text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None, vae=None,
                                transformer=TestHunyuanProcessors().make_transformer(),
                                scheduler=FlowMatchEulerDiscreteScheduler())
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(1)
    return pipe, dict(prompt_embeds=torch.randn(1, TEXT, 16, generator=g),
                      pooled_prompt_embeds=torch.randn(1, 8, generator=g),
                      prompt_attention_mask=torch.ones(1, TEXT, dtype=torch.bool), num_frames=9, height=64, width=64,
                      num_inference_steps=3, output_type="latent")


def _framepack(monkeypatch):
    from test_hunyuan_framepack import TEXT, build_tiny_framepack_pipeline

    # 9 frames in windows of 3 latent frames: one section (each section runs its own schedule)
    return build_tiny_framepack_pipeline(), dict(
        PROMPT, image=_image(64, 64), true_cfg_scale=2.0, height=64, width=64, num_frames=9, latent_window_size=3,
        num_inference_steps=3, output_type="latent", max_sequence_length=TEXT,
        prompt_template={"template": "{}", "crop_start": 0})


def _cogvideox(monkeypatch):
    from diffusers import CogVideoXDDIMScheduler, CogVideoXPipeline
    from test_cogvideox import TEXT, TestCogVideoXProcessors

    pipe = CogVideoXPipeline(tokenizer=None, text_encoder=None, vae=None,
                             transformer=TestCogVideoXProcessors().make_transformer(),
                             scheduler=CogVideoXDDIMScheduler(timestep_spacing="trailing"))
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(1)
    return pipe, dict(prompt_embeds=torch.randn(1, TEXT, 16, generator=g),
                      negative_prompt_embeds=torch.randn(1, TEXT, 16, generator=g), num_frames=9, height=112,
                      width=288, num_inference_steps=3, output_type="latent")


def _consisid(monkeypatch):
    from test_consisid import ID_DIM, SCALES, VIT_DIM, build_tiny_consisid_pipeline

    g = torch.Generator().manual_seed(1)
    return build_tiny_consisid_pipeline(), dict(
        PROMPT, image=_image(64, 288), num_frames=9, height=64, width=288, num_inference_steps=3,
        max_sequence_length=16, output_type="latent", id_cond=torch.randn(1, ID_DIM, generator=g),
        id_vit_hidden=[torch.randn(1, 5, VIT_DIM, generator=g) for _ in range(SCALES)])


def _ltx(cls):
    def case(monkeypatch):
        import diffusers
        from test_ltx import build_tiny_ltx_pipeline

        kw = dict(PROMPT, num_frames=9, height=32, width=96, num_inference_steps=3, output_type="latent",
                  max_sequence_length=16)
        if cls != "LTXPipeline":                    # the clean first frame's tokens at timestep 0
            kw["image"] = _image(32, 96)
        return build_tiny_ltx_pipeline(getattr(diffusers, cls)), kw
    return case


def _ltx2(monkeypatch):
    from test_ltx2 import build_tiny_ltx2_pipeline

    # guidance off (its default runs 3 forwards a step: CFG, STG and modality isolation)
    return build_tiny_ltx2_pipeline(rope_type="split"), dict(
        PROMPT, num_frames=9, height=32, width=64, frame_rate=25.0, num_inference_steps=3, max_sequence_length=16,
        guidance_scale=1.0, audio_guidance_scale=1.0, stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0,
        audio_modality_scale=1.0, output_type="latent")


def _mochi(monkeypatch):
    from diffusers import FlowMatchEulerDiscreteScheduler, MochiPipeline
    from test_mochi import TEXT, TestMochiProcessors

    # Mochi's published scheduler inverts the sigmas (diffusers' conversion script: invert_sigmas=True): the
    # transformer is given 1000 * (1 - sigma), rising, and the pipeline's `_current_timestep` is 1000 - t
    pipe = MochiPipeline(scheduler=FlowMatchEulerDiscreteScheduler(invert_sigmas=True), vae=None, text_encoder=None,
                         tokenizer=None, transformer=TestMochiProcessors().make_transformer())
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(1, TEXT, dtype=torch.bool)
    return pipe, dict(prompt_embeds=torch.randn(1, TEXT, 16, generator=g), prompt_attention_mask=mask,
                      negative_prompt_embeds=torch.randn(1, TEXT, 16, generator=g),
                      negative_prompt_attention_mask=mask, num_frames=7, height=32, width=64, num_inference_steps=3,
                      output_type="latent")


def _cosmos(name):
    def case(monkeypatch):
        from test_cosmos import _tiny_pipeline

        pipe, kw = _tiny_pipeline(name)
        return pipe, dict(kw, height=32, width=64, num_inference_steps=3, output_type="latent",
                          **({"image": _image(32, 64)} if kw.get("image") else {}))
    return case


def _kandinsky5(monkeypatch):
    from test_kandinsky import PIPE_KW, build_tiny_kandinsky5_pipeline

    return build_tiny_kandinsky5_pipeline(), dict(PIPE_KW, num_frames=5, num_inference_steps=3, output_type="latent")


def _kandinsky6(monkeypatch):
    from test_kandinsky6 import POOLED_DIM, TEXT, TEXT_DIM, build_tiny_kandinsky6_pipeline

    g = torch.Generator().manual_seed(5)
    embeds = {name: torch.randn(1, *shape, generator=g) for name, shape in [
        ("prompt_embeds", (TEXT, TEXT_DIM)), ("pooled_prompt_embeds", (POOLED_DIM,)),
        ("negative_prompt_embeds", (TEXT, TEXT_DIM)), ("negative_pooled_prompt_embeds", (POOLED_DIM,))]}
    return build_tiny_kandinsky6_pipeline(), dict(embeds, height=80, width=288, num_frames=5, num_inference_steps=3,
                                                  guidance_scale=5.0, sample_audio=False, output_type="latent")


def _motif(monkeypatch):
    from diffusers import FlowMatchEulerDiscreteScheduler, MotifVideoPipeline
    from diffusers.guiders import ClassifierFreeGuidance
    from test_motif_video import TEXT, TEXT_DIM, tiny_motif

    from videosparse.models.tiny_wan import build_tiny_wan_pipeline

    # latents | condition latents | mask: 4 + 4 + 1 input channels
    pipe = MotifVideoPipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), vae=build_tiny_wan_pipeline().vae,
                              text_encoder=None, tokenizer=None, transformer=tiny_motif(in_channels=9),
                              guider=ClassifierFreeGuidance(guidance_scale=5.0))
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(1, TEXT, dtype=torch.long)
    return pipe, dict(prompt_embeds=torch.randn(1, TEXT, TEXT_DIM, generator=g), prompt_attention_mask=mask,
                      negative_prompt_embeds=torch.randn(1, TEXT, TEXT_DIM, generator=g),
                      negative_prompt_attention_mask=mask, num_frames=9, height=64, width=64, num_inference_steps=3,
                      output_type="latent")


def _easyanimate(monkeypatch):
    from test_easyanimate import build_tiny_easyanimate_pipeline

    return build_tiny_easyanimate_pipeline(), dict(PROMPT, num_frames=9, height=64, width=64, num_inference_steps=3,
                                                   output_type="latent")


def _allegro(monkeypatch):
    from test_allegro import build_tiny_allegro_pipeline

    return build_tiny_allegro_pipeline(), dict(PROMPT, num_frames=24, height=64, width=64, num_inference_steps=3,
                                               max_sequence_length=16, clean_caption=False, output_type="latent")


def _minimax_h3(monkeypatch):
    from diffusers import MiniMaxH3Scheduler
    from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3FL2VACoreDenoiseStep
    from test_minimax_h3 import TEXT, TEXT_DIM, VIDEO_CHANNELS, tiny_minimax

    pipe = MiniMaxH3FL2VACoreDenoiseStep().init_pipeline()
    pipe.update_components(transformer=tiny_minimax(), scheduler=MiniMaxH3Scheduler(shift=12.0),
                           audio_scheduler=MiniMaxH3Scheduler(shift=3.0))
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(0)
    # 4 schedule points = 3 forwards; first and last keyframe conditions, pinned near the clean end
    return pipe, dict(prompt_embeds=torch.randn(1, TEXT, TEXT_DIM, generator=g), text_token_tags=torch.ones(TEXT).long(),
                      height=96, width=160, num_frames=124, keyframe_anchors=("first", "last"), num_inference_steps=4,
                      condition_latents=[torch.randn(1, VIDEO_CHANNELS, 1, 6, 10, generator=g) for _ in range(2)],
                      output="latents")


# class name -> (its cases: name -> builder)
CASES = {
    "WanTransformer3DModel": {"WanPipeline": _wan},
    "WanVACETransformer3DModel": {"WanVACEPipeline": _wan_family("WanVACEPipeline")},
    "SkyReelsV2Transformer3DModel": {
        "SkyReelsV2Pipeline": _wan_family("SkyReelsV2Pipeline"),
        # asynchronous diffusion forcing: per-frame timesteps, the frames starting one after another
        "SkyReelsV2DiffusionForcingPipeline": _wan_family("SkyReelsV2DiffusionForcingPipeline", base_num_frames=9,
                                                          ar_step=1, causal_block_size=1, num_frames=9)},
    "WanAnimateTransformer3DModel": {"WanAnimatePipeline": _wan_animate},
    "ChronoEditTransformer3DModel": {"ChronoEditPipeline": _chronoedit},
    "AnyFlowTransformer3DModel": {"AnyFlowPipeline": _anyflow},
    "HeliosTransformer3DModel": {"HeliosPipeline": _helios},
    "HunyuanVideoTransformer3DModel": {"HunyuanVideoPipeline": _hunyuan},
    "HunyuanVideoFramepackTransformer3DModel": {"HunyuanVideoFramepackPipeline": _framepack},
    "CogVideoXTransformer3DModel": {"CogVideoXPipeline": _cogvideox},
    "ConsisIDTransformer3DModel": {"ConsisIDPipeline": _consisid},
    "LTXVideoTransformer3DModel": {"LTXConditionPipeline": _ltx("LTXConditionPipeline")},
    "LTX2VideoTransformer3DModel": {"LTX2Pipeline": _ltx2},
    "MochiTransformer3DModel": {"MochiPipeline": _mochi},
    "CosmosTransformer3DModel": {"Cosmos2VideoToWorldPipeline": _cosmos("predict2"),
                                 "Cosmos2_5_PredictBasePipeline": _cosmos("predict2.5")},
    "Kandinsky5Transformer3DModel": {"Kandinsky5T2VPipeline": _kandinsky5},
    "Kandinsky6Transformer3DModel": {"Kandinsky6TI2VAPipeline": _kandinsky6},
    "MotifVideoTransformer3DModel": {"MotifVideoPipeline": _motif},
    "EasyAnimateTransformer3DModel": {"EasyAnimatePipeline": _easyanimate},
    "AllegroTransformer3DModel": {"AllegroPipeline": _allegro},
    "MiniMaxH3Transformer3DModel": {"MiniMaxH3FL2VACoreDenoiseStep": _minimax_h3},
}
# registered classes no case runs, and why
NOT_RUN = {
    "WanAnimate2Transformer3DModel": "its tiny modular pipeline (test_wan_animate2._tiny_pipeline) takes about 20 s "
                                     "on 2 CPU cores (torch.compile of its block mask) and has no latent output",
    "HunyuanVideo15Transformer3DModel": "no tiny pipeline helper: its pipelines need a HunyuanVideo 1.5 VAE and a "
                                        "transformer taking latents, condition and mask (2C + 1 channels)",
    "Cosmos3OmniTransformer": "direction 0: its forward takes no `timestep` (per-modality vision / sound / action "
                              "timesteps), so no step is counted by timestep",
}


def _builtin_specs() -> dict:
    """Class name -> spec of the built-in registrations (diffusers' classes; a test's own registrations left out)."""
    _load_builtins()
    return {cls.__name__: factory() for cls, factory in _MODEL_SPECS.items() if cls.__module__.startswith("diffusers")}


def test_every_registered_class_has_a_direction_and_a_case_or_a_reason():
    specs = _builtin_specs()
    assert {name: spec.timestep_direction for name, spec in specs.items()
            if spec.timestep_direction not in (-1, 0, 1)} == {}
    assert set(specs) == set(CASES) | set(NOT_RUN) and not set(CASES) & set(NOT_RUN)
    assert all(specs[name].timestep_direction == 0 for name in NOT_RUN if name.startswith("Cosmos3"))


@pytest.mark.parametrize("cls_name, build", [pytest.param(cls, build, id=name) for cls, cases in CASES.items()
                                             for name, build in cases.items()])
def test_the_counted_timestep_moves_in_the_declared_direction(cls_name, build, monkeypatch):
    direction = _builtin_specs()[cls_name].timestep_direction
    if direction == 0:
        pytest.skip(f"{cls_name} declares no direction")
    pipe, kw = build(monkeypatch)
    transformer = pipe.transformer
    assert type(transformer).__name__ == cls_name
    seen = []
    hook = transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(counted_timestep(module, args, kwargs)), with_kwargs=True)
    try:
        pipe(**kw, generator=torch.Generator().manual_seed(0))
    finally:
        hook.remove()
    assert seen and None not in seen
    changes = [b for a, b in zip(seen, seen[1:]) if b != a]
    moves = {1 if b > a else -1 for a, b in zip([seen[0], *changes], changes)}
    assert len(changes) >= 2 and moves == {direction}, seen        # 3 steps: at least 3 distinct values
    # the counter told the family's direction: a step per distinct value, no new call within this one
    counter = TimestepCounter()
    expected = np.cumsum([0] + [b != a for a, b in zip(seen, seen[1:])]).tolist()
    assert [counter.step(t, direction) for t in seen] == expected
