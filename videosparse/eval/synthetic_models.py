"""The synthetic models: real-size video transformers built from their published configs with random weights, and
inputs for one forward at each model's default video (no download). `videosparse evaluate --synthetic` times them
(`synthetic.py`).

==========  ===================================  =========================  ===============================
name        architecture                         default video              token grid
==========  ===================================  =========================  ===============================
wan-1.3b    Wan2.1 T2V 1.3B: 30 x 12 x 128       81 x 480 x 832             21 x 30 x 52 = 32,760
wan-14b     Wan2.1 T2V 14B: 40 x 40 x 128        81 x 720 x 1280            21 x 45 x 80 = 75,600
hunyuan     HunyuanVideo: 20+40 x 24 x 128       129 x 720 x 1280           33 x 45 x 80 = 118,800
hunyuan15   HunyuanVideo 1.5: 54 x 16 x 128      121 x 480 x 848            31 x 30 x 53 = 49,290
cogvideox   CogVideoX-5B: 42 x 48 x 64           49 x 480 x 720             13 x 30 x 45 = 17,550
ltx         LTX-Video 0.9.x 2B: 28 x 32 x 64     121 x 512 x 768            16 x 16 x 24 = 6,144
ltx2        LTX-2 19B: 48 x 32 x 128 (+audio)    121 x 512 x 768            16 x 16 x 24 = 6,144
mochi       Mochi 1 preview: 48 x 24 x 128       163 x 480 x 848            28 x 30 x 53 = 44,520
cosmos      Cosmos-Predict2.5: 28 x 16 x 128     93 x 704 x 1280            24 x 44 x 80 = 84,480
kandinsky5  Kandinsky 5.0 Video Pro 19B:         121 x 768 x 1024           31 x 48 x 64 = 95,232
            60 x 32 x 128 (+4 text blocks)
framepack   FramePack I2V (HunyuanVideo):        33 x 640 x 640             9 x 40 x 40 = 14,400
            20+40 x 24 x 128                     (a 9-latent-frame window)  + 4,985 global (*)
allegro     Allegro: 32 x 24 x 96                88 x 720 x 1280            22 x 45 x 80 = 79,200
minimax-h3  MiniMax-H3 33B: 50 x 56 x 128        124 x 768 x 1344           37 x 24 x 42 = 37,296
            (one packed text/audio/video seq.)   (37 latent frames)         + 670 global (**)
wan-animate2  Wan-Animate-2 (Wan 14B):           81 x 800 x 640 segment     22 x 50 x 40 = 44,000
            40 x 40 x 128                        (+ reference image frame)  + 2,000 per-frame keys (***)
cosmos3     Cosmos 3 (Qwen3-8B-size MoT):        189 x 720 x 1280           48 x 23 x 40 = 44,160
            36 x 32 x 128, 8 KV heads            (48 latent frames)         + 256 text keys (****)
==========  ===================================  =========================  ===============================

(*) FramePack attends over [history; video; image; text]: the window's 14,400 video tokens are the tile grid; the
history (start image + 1 frame at 1x: 3,200, 2 frames at 2x: 400, 16 frames at 4x: 400), the 729 SigLIP image tokens
and the 256 text tokens are global tiles, always kept, so the realised density has a floor near 0.45 at this size
(1 - (14,400 / 19,385)^2 = 0.448): a method's target density below it is not reached.

(**) MiniMax-H3 attends over one packed sequence [text | audio | video] (t2va): 256 text rows (a fixed count: the
prompt's Qwen3-VL tokens, no template) and the 414 rows of its stereo soundtrack (2 x 207 latents) are global tiles.

(***) Wan-Animate-2's generation pass (one denoising forward of a segment): the reference image's latent frame and the
segment's 21 latent frames are the grid; each frame f >= 1 also attends to the 2,000 cached reference tokens of
frame f - 1 (dense per frame, merged by log-sum-exp), which the reference-extraction pass (untimed, stock, before
the methods) fills.

(****) Cosmos 3's generation rows (the video, one time-major grid; its latent height 45 is padded to 46 for the 2 x 2
patches) attend to themselves and to the keys of the prompt's 256 rows (whose own causal understanding pathway stays
stock), which join the same kernel call as global tiles.

A model whose transformer class has no videosparse processor is refused with the registry's message.
"""

from __future__ import annotations

import importlib
import math
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

# Largest estimated forward (FLOPs) allowed on a CPU, and the rate used to quote a time for it.
CPU_FLOP_LIMIT = 1e12
CPU_FLOPS_PER_S = 5e10


@dataclass(frozen=True)
class SyntheticModel:
    """A published transformer architecture and its default video size.

    Attributes:
        name: the `--synthetic` name.
        transformer_cls: diffusers class name.
        config: constructor arguments (the published config).
        video: default (frames, height, width) in pixels.
        latent_channels: VAE latent channels (the transformer's input channels where it concatenates a condition).
        vae_scale: (temporal, spatial) VAE compression: latent frames = (frames - 1) // t + 1.
        text_len, text_dim: text-encoder sequence length and width fed to the transformer.
        joint_text: the text tokens join the video tokens in self-attention (HunyuanVideo, CogVideoX),
            so attention runs over video + text tokens; otherwise they enter by cross-attention (Wan).
        description: one line for reports.
        layer_keys: the config keys whose values add up to the served blocks; `--synthetic-layers N` sets the first
            to N and the others to 0.
        attention_shape: config -> (heads, head dim) of the served layers, for configs without
            `num_attention_heads` / `attention_head_dim` (Kandinsky 5); None reads those two keys.
        image_tokens: image tokens that join the self-attention (FramePack's SigLIP tokens, `image_proj_dim` wide).
        history: latent frames of the history that FramePack packs before the video, at 1x (the start image and
            the 1x history), 2x and 4x compression (`HISTORY_KERNELS`).
        audio_rows: latent frames -> audio rows that join the self-attention (MiniMax-H3's packed soundtrack).
        prepare: (setup, transformer, inputs) -> None, run once after the build with the stock processors, for
            state a forward reads besides its inputs (Wan-Animate-2's reference K/V cache: its extraction pass).
        pad_patches: the model pads the latents to whole patches (Cosmos 3), so any latent size fits.
    """

    name: str
    transformer_cls: str
    config: dict
    video: tuple[int, int, int]
    latent_channels: int = 16
    vae_scale: tuple[int, int] = (4, 8)
    text_len: int = 512
    text_dim: int = 4096
    joint_text: bool = False
    description: str = ""
    layer_keys: tuple[str, ...] = ("num_layers", "num_single_layers")
    attention_shape: Callable[[dict], tuple[int, int]] | None = None
    image_tokens: int = 0
    history: tuple[int, ...] = ()
    audio_rows: Callable[[int], int] | None = None
    prepare: Callable | None = None
    pad_patches: bool = False

    @property
    def patch(self) -> tuple[int, int, int]:
        if "latent_patch_size" in self.config:
            return (1, int(self.config["latent_patch_size"]), int(self.config["latent_patch_size"]))
        p = self.config.get("patch_size", (1, 2, 2))
        if isinstance(p, int):
            return (int(self.config.get("patch_size_t", 1)), p, p)
        return tuple(p)

    @property
    def heads(self) -> int:
        return self._attention_shape()[0]

    @property
    def head_dim(self) -> int:
        return self._attention_shape()[1]

    @property
    def num_layers(self) -> int:
        return self.count_layers(self.config)

    def count_layers(self, config: dict) -> int:
        """Served blocks of `config` (this model's config, possibly with a layers override)."""
        return sum(int(config.get(key, 0)) for key in self.layer_keys)

    def _attention_shape(self) -> tuple[int, int]:
        if self.attention_shape is not None:
            return self.attention_shape(self.config)
        return int(self.config["num_attention_heads"]), int(self.config["attention_head_dim"])


# kernels (t, h, w) of FramePack's history patch embeddings (`HunyuanVideoHistoryPatchEmbed`: proj, proj_2x,
# proj_4x), which pad their input to whole kernels
HISTORY_KERNELS = ((1, 2, 2), (2, 4, 4), (4, 8, 8))


def _processor_attention_shape(module: str, rule: str) -> Callable[[dict], tuple[int, int]]:
    """config dict -> (heads, head dim) by the rule `rule` of `videosparse.processors.<module>` (for configs without
    `num_attention_heads` / `attention_head_dim`: Kandinsky 5, Wan-Animate-2), imported on first use."""

    def shape(config: dict) -> tuple[int, int]:
        from types import SimpleNamespace

        return getattr(importlib.import_module(f"..processors.{module}", __package__), rule)(SimpleNamespace(**config))

    return shape


def _minimax_h3_audio_rows(latent_frames: int) -> int:
    """Audio rows MiniMax-H3 packs with `latent_frames` video latent frames: its video VAE turns 17 n + 5 frames (24
    fps) into 5 n + 2 latent frames, so they stand for 17 (T - 2) / 5 + 5 frames (rounded where T is not 5 n + 2),
    whose soundtrack has `audio_latent_num_frames` latents per channel (40 per second), in 2 channels."""
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
        MINIMAX_H3_AUDIO_CHANNELS,
        audio_latent_num_frames,
    )

    frames = max(1, round(17 * (latent_frames - 2) / 5 + 5))
    return audio_latent_num_frames(frames) * MINIMAX_H3_AUDIO_CHANNELS


def _wan_animate2_prepare(setup: SyntheticSetup, transformer, inputs: dict, seed: int = 1) -> None:
    """Wan-Animate-2's reference-extraction pass, as `WanAnimate2SegmentReferenceStep` calls it: the driving segment's
    latents (the generation grid without its first frame; random, 16 channels) with their 20-channel condition, the
    same text and CLIP states, the first timestep, filling `inputs["kv_cache"]`."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    latents, condition = inputs["hidden_states"][0], inputs["condition_latents"][0]
    device, dtype = latents.device, latents.dtype
    T, H, W = setup.grid

    def randn(like: torch.Tensor) -> torch.Tensor:
        return torch.randn(like[:, 1:].shape, generator=g).to(device=device, dtype=dtype)

    with torch.no_grad():
        transformer(hidden_states=[randn(latents)], condition_latents=[randn(condition)],
                    timestep=inputs["timestep"], encoder_hidden_states=inputs["encoder_hidden_states"],
                    encoder_hidden_states_image=inputs["encoder_hidden_states_image"], kv_cache=inputs["kv_cache"],
                    kv_cache_mode="extract", seq_len=(T - 1) * H * W, offset_grid_sizes=inputs["reference_grid_sizes"])


_WAN_COMMON = dict(patch_size=(1, 2, 2), attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096,
                   freq_dim=256, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
                   rope_max_seq_len=1024)

_HUNYUAN = dict(in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
                num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1,
                qk_norm="rms_norm", guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768,
                rope_theta=256.0, rope_axes_dim=(16, 56, 56))

SYNTHETIC_MODELS: dict[str, SyntheticModel] = {
    "wan-1.3b": SyntheticModel(
        "wan-1.3b", "WanTransformer3DModel",
        dict(_WAN_COMMON, num_attention_heads=12, ffn_dim=8960, num_layers=30), (81, 480, 832),
        description="Wan2.1 T2V 1.3B (dim 1536, 12 heads x 128, 30 layers, ffn 8960), 480P 81 frames"),
    "wan-14b": SyntheticModel(
        "wan-14b", "WanTransformer3DModel",
        dict(_WAN_COMMON, num_attention_heads=40, ffn_dim=13824, num_layers=40), (81, 720, 1280),
        description="Wan2.1 T2V 14B (dim 5120, 40 heads x 128, 40 layers, ffn 13824), 720P 81 frames"),
    "hunyuan": SyntheticModel(
        "hunyuan", "HunyuanVideoTransformer3DModel", _HUNYUAN,
        (129, 720, 1280), text_len=256, joint_text=True,
        description="HunyuanVideo (24 heads x 128, 20 dual + 40 single blocks), 720P 129 frames"),
    "hunyuan15": SyntheticModel(
        # hunyuanvideo-community/HunyuanVideo-1.5 480p T2V: HunyuanVideo15Transformer3DModel's defaults; the keys
        # read here are spelled out. Input channels 65 = 32 latent + 32 condition latent + 1 mask (the pipeline's
        # concatenation); text: 256 Qwen tokens, no quoted glyph text (ByT5 masked), no image (T2V)
        "hunyuan15", "HunyuanVideo15Transformer3DModel",
        dict(num_attention_heads=16, attention_head_dim=128, num_layers=54, patch_size=1, patch_size_t=1),
        (121, 480, 848), latent_channels=65, vae_scale=(4, 16), text_len=256, text_dim=3584, joint_text=True,
        description="HunyuanVideo 1.5 (16 heads x 128, 54 blocks, VAE 4 x 16 x 16), 480P 121 frames"),
    "cogvideox": SyntheticModel(
        "cogvideox", "CogVideoXTransformer3DModel",
        dict(num_attention_heads=48, attention_head_dim=64, in_channels=16, out_channels=16, flip_sin_to_cos=True,
             freq_shift=0, time_embed_dim=512, text_embed_dim=4096, num_layers=42, dropout=0.0,
             attention_bias=True, sample_width=90, sample_height=60, sample_frames=49, patch_size=2,
             temporal_compression_ratio=4, max_text_seq_length=226, activation_fn="gelu-approximate",
             timestep_activation_fn="silu", norm_elementwise_affine=True, norm_eps=1e-5,
             spatial_interpolation_scale=1.875, temporal_interpolation_scale=1.0,
             use_rotary_positional_embeddings=True, use_learned_positional_embeddings=False),
        (49, 480, 720), text_len=226, joint_text=True,
        description="CogVideoX-5B (48 heads x 64, 42 layers, text before video), 480x720 49 frames"),
    "ltx": SyntheticModel(
        # Lightricks/LTX-Video's transformer config is LTXVideoTransformer3DModel's defaults (caption_channels
        # 4096, cross_attention_dim 2048, qk_norm "rms_norm_across_heads", ...); the keys read here are spelled out
        "ltx", "LTXVideoTransformer3DModel",
        dict(num_attention_heads=32, attention_head_dim=64, num_layers=28, patch_size=1, patch_size_t=1),
        (121, 512, 768), latent_channels=128, vae_scale=(8, 32), text_len=128,
        description="LTX-Video 0.9.x 2B (32 heads x 64, 28 layers, VAE 8 x 32 x 32), 512x768 121 frames"),
    "ltx2": SyntheticModel(
        # Lightricks/LTX-2 (19B audio-video): LTX2VideoTransformer3DModel's defaults, which are the "2.0" config of
        # diffusers' scripts/convert_ltx2_to_diffusers.py (48 layers, video 32 heads x 128 with cross-attention 4096
        # and captions 3840, audio 32 heads x 64 with 128 input channels = 8 latent channels x 16 mel bins); rope_type
        # "split" as in the published transformer/config.json (the class default is "interleaved"). The keys read
        # here are spelled out. Default size from LTX2Pipeline: 512 x 768, 121 frames at 24 fps (VAE 8 x 32 x 32), so
        # 126 audio latent frames (25 per second); 1024 text tokens from the connectors, for video and audio alike
        "ltx2", "LTX2VideoTransformer3DModel",
        dict(num_attention_heads=32, attention_head_dim=128, num_layers=48, patch_size=1, patch_size_t=1,
             audio_in_channels=128, rope_type="split"),
        (121, 512, 768), latent_channels=128, vae_scale=(8, 32), text_len=1024, text_dim=3840,
        description="LTX-2 19B (video 32 heads x 128, 48 layers, VAE 8 x 32 x 32; audio stream 32 heads x 64), "
                    "512x768 121 frames"),
    "mochi": SyntheticModel(
        # genmo/mochi-1-preview's transformer config is MochiTransformer3DModel's defaults (pooled_projection_dim
        # 1536, text_embed_dim 4096, in_channels 12, ...); the keys read here are spelled out. No temporal patch:
        # the token grid is the latent's frames x (H / 2) x (W / 2); the 256 T5 tokens join the video tokens
        "mochi", "MochiTransformer3DModel",
        dict(num_attention_heads=24, attention_head_dim=128, num_layers=48, patch_size=2),
        (163, 480, 848), latent_channels=12, vae_scale=(6, 8), text_len=256, joint_text=True,
        description="Mochi 1 preview (24 heads x 128, 48 layers, VAE 6 x 8 x 8, text after video), 480x848 "
                    "163 frames"),
    "cosmos": SyntheticModel(
        # nvidia/Cosmos-Predict2.5-2B: the "Cosmos-2.5-Predict-Base-2B" transformer config of diffusers'
        # scripts/convert_cosmos_to_diffusers.py (16 heads x 128, 28 layers, patch (1, 2, 2), RoPE scale (1, 3, 3), no
        # learnable position embedding; 17 input channels = 16 latent + the condition mask; the text states, the 28
        # hidden states of 3584 of its Qwen2.5-VL-7B text encoder stacked, 100,352 wide, projected to 1024). One change:
        # concat_padding_mask=False, while the published config concatenates the (all-zero) padding mask as an 18th
        # input channel, which the forward resizes with torchvision, not a videosparse dependency; it adds no token and
        # 4 x 2048 weights. Default size from Cosmos2_5_PredictBasePipeline: 704 x 1280, 93 frames (Wan 2.1 VAE
        # 4 x 8 x 8), max_sequence_length 512 text tokens (cross-attention only)
        "cosmos", "CosmosTransformer3DModel",
        dict(in_channels=17, out_channels=16, num_attention_heads=16, attention_head_dim=128, num_layers=28,
             mlp_ratio=4.0, text_embed_dim=1024, adaln_lora_dim=256, max_size=(128, 240, 240), patch_size=(1, 2, 2),
             rope_scale=(1.0, 3.0, 3.0), concat_padding_mask=False, extra_pos_embed_type=None,
             use_crossattn_projection=True, crossattn_proj_in_channels=100352, encoder_hidden_states_channels=1024),
        (93, 704, 1280), text_len=512, text_dim=100352,
        description="Cosmos-Predict2.5 2B (16 heads x 128, 28 layers, VAE 4 x 8 x 8), 704x1280 93 frames"),
    "kandinsky5": SyntheticModel(
        # kandinskylab Kandinsky 5.0 Video Pro (19B) with full attention (attention_type "regular": no NABLA
        # sparse_params): 60 visual blocks (self-attention over the video, served; cross-attention to the text, stock)
        # after 4 text refiner blocks (stock, not counted as layers); heads 4096 / (32 + 48 + 48) = 32 of 128. The I2V
        # layout (visual_cond) takes 33 input channels, channels last: 16 latent + 16 condition latent + 1 mask, which
        # Kandinsky5T2VPipeline fills with zeros for text to video. HunyuanVideo VAE 4 x 8 x 8; 768 x 1024, 121 frames;
        # 256 Qwen2.5-VL tokens (3584 wide) plus the pooled CLIP embedding (768)
        "kandinsky5", "Kandinsky5Transformer3DModel",
        dict(in_visual_dim=16, out_visual_dim=16, in_text_dim=3584, in_text_dim2=768, time_dim=1024,
             patch_size=(1, 2, 2), model_dim=4096, ff_dim=16384, num_text_blocks=4, num_visual_blocks=60,
             axes_dims=(32, 48, 48), visual_cond=True, attention_type="regular"),
        (121, 768, 1024), latent_channels=33, text_len=256, text_dim=3584, layer_keys=("num_visual_blocks",),
        attention_shape=_processor_attention_shape("kandinsky", "kandinsky_attention_shape"),
        description="Kandinsky 5.0 Video Pro 19B (32 heads x 128, 60 visual blocks, text by cross-attention), "
                    "768x1024 121 frames"),
    "framepack": SyntheticModel(
        # lllyasviel/FramePackI2V_HY: HunyuanVideo's transformer (20 dual + 40 single blocks, 24 heads x 128) with the
        # history patch embeddings (has_clean_x_embedder) and the SigLIP image projection (has_image_proj, 729 tokens
        # of 1152). One forward of one section of HunyuanVideoFramepackPipeline at 640 x 640: a window of 9 latent
        # frames (33 video frames) after the history of its default inverted anti-drifting sampling (history sizes
        # 1, 2, 16 latent frames; the start image joins the 1x history); 256 Llama tokens with their mask (all valid)
        # and the pooled CLIP embedding. History, image and text tokens join the self-attention of every block
        "framepack", "HunyuanVideoFramepackTransformer3DModel",
        dict(_HUNYUAN, image_condition_type=None, has_image_proj=True, image_proj_dim=1152, has_clean_x_embedder=True),
        (33, 640, 640), text_len=256, joint_text=True, image_tokens=729, history=(2, 2, 16),
        description="FramePack I2V (HunyuanVideo 24 heads x 128, 20 dual + 40 single blocks), 640x640, a window of "
                    "9 latent frames + 4,000 history and 729 image tokens"),
    "allegro": SyntheticModel(
        # rhymes-ai/Allegro: AllegroTransformer3DModel's defaults (24 heads x 96, 32 layers, patch 1 x 2 x 2, caption
        # projection of 4096-wide T5 states; the published config). Default size 720 x 1280, 88 frames, which its VAE
        # (4 x 8 x 8, 4 channels) turns into 22 latent frames: given here as 85 frames, the 1 + 4k form with the same
        # 22; 512 T5 tokens by cross-attention. Head dim 96 runs on the GPU kernels zero-padded to 128
        "allegro", "AllegroTransformer3DModel",
        dict(num_attention_heads=24, attention_head_dim=96, num_layers=32, patch_size=2, patch_size_t=1),
        (85, 720, 1280), latent_channels=4, text_len=512, text_dim=4096, layer_keys=("num_layers",),
        description="Allegro (24 heads x 96, 32 layers, VAE 4 x 8 x 8), 720x1280 88 frames (22 latent frames)"),
    "minimax-h3": SyntheticModel(
        # MiniMaxAI/MiniMax-H3 (33B): MiniMaxH3Transformer3DModel's defaults (50 blocks of 56 heads x 128 over a
        # 5376-wide residual, SwiGLU 14336, 2 token-refiner blocks (text only, stock; not counted as layers), patch
        # (1, 2, 2), 24 video / 32 audio latent channels, 5120-wide Qwen3-VL text states); the keys read here are
        # spelled out. One packed sequence, no cross-attention: the t2va layout [text | target audio | target video]
        # of MiniMaxH3PrepareLayoutStep, all of it in every block's self-attention. Default size of the modular
        # pipeline: 768 x 1344 (its 16:9 canvas), 124 frames at 24 fps, which its VAE (17 n + 5 frames -> 5 n + 2
        # latent frames, 16 x 16 spatially) turns into 37 latent frames of 48 x 84: given here as 145 frames, the
        # 1 + 4k form with the same 37 (so `--frames` counts 4 frames a latent frame); the soundtrack is that of the
        # frames the latent frames stand for (124: 2 x 207 audio rows, `_minimax_h3_audio_rows`). Text: 256 tokens, a
        # fixed count for a detailed prompt (t2va encodes the prompt verbatim, no template, no padding)
        "minimax-h3", "MiniMaxH3Transformer3DModel",
        dict(num_attention_heads=56, attention_head_dim=128, num_layers=50, ffn_dim=14336, patch_size=(1, 2, 2),
             in_channels=24, audio_in_channels=32, text_dim=5120),
        (145, 768, 1344), latent_channels=24, vae_scale=(4, 16), text_len=256, text_dim=5120, joint_text=True,
        layer_keys=("num_layers",), audio_rows=_minimax_h3_audio_rows,
        description="MiniMax-H3 33B (56 heads x 128, 50 blocks, one packed [text | audio | video] sequence), "
                    "768x1344 124 frames (37 latent frames) + 414 audio rows"),
    "wan-animate2": SyntheticModel(
        # WanAnimate2Transformer3DModel's defaults (the Wan 14B backbone: dim 5120, 40 heads x 128, 40 layers, ffn
        # 13824; 36 input channels = 16 latent + 20 condition (4 mask + 16 latent), CLIP image context), the keys read
        # here spelled out. One generation forward of a segment at the modular pipeline's defaults (800 x 640,
        # segment_frame_length 81 -> 21 latent frames after the reference image's one): 22 latent frames, given as 85
        # frames (the 1 + 4k form with the same 22); `origin_len` 81. The reference K/V come from an untimed
        # extraction pass (`prepare`); 512 umT5 tokens and 257 CLIP tokens by cross-attention
        "wan-animate2", "WanAnimate2Transformer3DModel",
        dict(dim=5120, num_heads=40, num_layers=40, ffn_dim=13824, in_dim=36, patch_size=(1, 2, 2), use_img_emb=True),
        (85, 800, 640), layer_keys=("num_layers",), prepare=_wan_animate2_prepare,
        attention_shape=_processor_attention_shape("wan", "wan_animate2_attention_shape"),
        description="Wan-Animate-2 (Wan 14B: 40 heads x 128, 40 layers), generation pass of an 81-frame 800x640 "
                    "segment (22 latent frames with the reference image's) + per-frame reference keys"),
    "cosmos3": SyntheticModel(
        # Cosmos3OmniTransformer's defaults (a Qwen3-8B-size backbone per pathway: 36 layers of 32 query heads and 8
        # KV heads x 128 over a 4096-wide residual, SwiGLU 12288; 48 latent channels in 2 x 2 patches), the keys read
        # here spelled out. Text to video at the pipeline's default 189 frames of 720 x 1280 (its Wan 2.2 VAE: 4 x 16 x
        # 16, 48 channels -> 48 x 45 x 80 latents, padded to 46 rows for the patches); no sound. The understanding
        # pathway holds the prompt's 256 tokens (a fixed count for a detailed prompt with the system prompt)
        "cosmos3", "Cosmos3OmniTransformer",
        dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
             intermediate_size=12288, latent_channel=48, latent_patch_size=2, patch_latent_dim=192),
        (189, 720, 1280), latent_channels=48, vae_scale=(4, 16), text_len=256, joint_text=True,
        layer_keys=("num_hidden_layers",), pad_patches=True,
        attention_shape=_processor_attention_shape("cosmos3", "cosmos3_attention_shape"),
        description="Cosmos 3 (36 layers of 32 query / 8 KV heads x 128, understanding + generation pathways), "
                    "720x1280 189 frames (48 latent frames) + 256 text keys"),
}


@dataclass(frozen=True)
class SyntheticSetup:
    """One model at one size: the config with overrides and the shapes that follow."""

    model: SyntheticModel
    video: tuple[int, int, int]
    layers_override: int | None = None

    @property
    def config(self) -> dict:
        cfg = dict(self.model.config)
        if self.layers_override is not None:
            first, *rest = self.model.layer_keys
            cfg[first] = self.layers_override
            cfg.update({key: 0 for key in rest if key in cfg})
        return cfg

    @property
    def latent(self) -> tuple[int, int, int, int]:
        """(C, T, H, W) of the latent video."""
        F, H, W = self.video
        t, s = self.model.vae_scale
        return (self.model.latent_channels, (F - 1) // t + 1, H // s, W // s)

    @property
    def grid(self) -> tuple[int, int, int]:
        _, T, H, W = self.latent
        pt, ph, pw = self.model.patch
        if self.model.pad_patches:
            return (-(-T // pt), -(-H // ph), -(-W // pw))
        return (T // pt, H // ph, W // pw)

    @property
    def tokens(self) -> int:
        return math.prod(self.grid)

    @property
    def history_tokens(self) -> tuple[int, ...]:
        """Tokens of each part of FramePack's history (1x, 2x, 4x; each padded to whole kernels); () without one."""
        _, _, H, W = self.latent
        return tuple(math.prod(-(-n // k) for n, k in zip((frames, H, W), kernel))
                     for frames, kernel in zip(self.model.history, HISTORY_KERNELS))

    @property
    def audio_tokens(self) -> int:
        """Audio rows that join the self-attention (`SyntheticModel.audio_rows`); 0 without."""
        return self.model.audio_rows(self.latent[1]) if self.model.audio_rows else 0

    @property
    def attention_tokens(self) -> int:
        """Tokens of one self-attention call: video, plus the history, image, audio and text tokens that join it."""
        joined = sum(self.history_tokens) + self.model.image_tokens + self.audio_tokens
        return self.tokens + joined + (self.model.text_len if self.model.joint_text else 0)

    @property
    def num_layers(self) -> int:
        return self.model.count_layers(self.config)

    def describe(self) -> dict[str, Any]:
        shape = {"video": list(self.video), "latent": list(self.latent), "grid": list(self.grid),
                 "tokens": self.tokens, "heads": self.model.heads, "head_dim": self.model.head_dim,
                 "layers": self.num_layers, "text_tokens": self.model.text_len,
                 "attention_tokens": self.attention_tokens}
        if self.model.history:
            shape["history_tokens"] = list(self.history_tokens)
        if self.model.image_tokens:
            shape["image_tokens"] = self.model.image_tokens
        if self.audio_tokens:
            shape["audio_tokens"] = self.audio_tokens
        return shape


def synthetic_setup(name: str, frames: int | None = None, height: int | None = None, width: int | None = None,
                    layers: int | None = None) -> SyntheticSetup:
    """The `SyntheticSetup` of a named model, at its default size unless overridden.

    Raises:
        ValueError: unknown name, a size below 1, or a size that does not make whole latent patches.
    """
    if name not in SYNTHETIC_MODELS:
        raise ValueError(f"--synthetic {name!r} is not known; choose one of {sorted(SYNTHETIC_MODELS)}.")
    model = SYNTHETIC_MODELS[name]
    for label, value in (("frames", frames), ("height", height), ("width", width)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{label}={value!r} must be a positive int (or None for {name}'s default).")
    video = tuple(given if given is not None else default for given, default in zip((frames, height, width),
                                                                                  model.video))
    t, s = model.vae_scale
    _, ph, pw = model.patch
    ph, pw = (1, 1) if model.pad_patches else (ph, pw)
    if (video[0] - 1) % t or video[1] % (s * ph) or video[2] % (s * pw):
        raise ValueError(f"video size {video} does not fit {name}: frames must be 1 + a multiple of {t}, height a "
                         f"multiple of {s * ph}, width a multiple of {s * pw}.")
    if layers is not None and layers < 1:
        raise ValueError(f"layers={layers} must be >= 1.")
    if layers is not None and layers > model.num_layers:
        raise ValueError(f"layers={layers} (--synthetic-layers) is more than the {model.num_layers} layers of {name}; "
                         f"give 1 to {model.num_layers}, or none for all.")
    return SyntheticSetup(model, video, layers)


def _transformer_class(name: str):
    import diffusers

    return getattr(diffusers, name)


def count_parameters(setup: SyntheticSetup) -> int:
    """Exact parameter count, from the model built on the meta device (no memory, no init)."""
    with torch.device("meta"):
        model = _transformer_class(setup.model.transformer_cls)(**setup.config)
    return sum(p.numel() for p in model.parameters())


def estimate_flops(setup: SyntheticSetup, params: int) -> dict[str, float]:
    """Rough FLOPs of one forward: 4*S^2*D*H per self-attention layer, 2*S*params for the matmuls."""
    S, H, D = setup.attention_tokens, setup.model.heads, setup.model.head_dim
    attention = 4.0 * S * S * D * H * setup.num_layers
    linear = 2.0 * S * params
    return {"attention": attention, "linear": linear, "total": attention + linear}


def check_supported(setup: SyntheticSetup) -> None:
    """Refuse a model videosparse has no processor for (the registry's message, which lists the supported classes)."""
    from ..processors.registry import model_spec

    with torch.device("meta"):
        model = _transformer_class(setup.model.transformer_cls)(**setup.config)
    try:
        model_spec(model)
    except ValueError as err:
        raise ValueError(f"--synthetic {setup.model.name}: videosparse has no attention processor for "
                         f"{setup.model.transformer_cls} yet, so it cannot be sped up or timed ({err})") from None


def check_feasible(setup: SyntheticSetup, device: torch.device, dtype: torch.dtype, params: int) -> dict[str, float]:
    """Refuse sizes that cannot run on `device`; return the estimates.

    On CPU the estimated forward must stay under `CPU_FLOP_LIMIT` and the weights under half the
    memory; on CUDA the weights plus activations must fit in the free memory.

    Raises:
        ValueError: with the estimates and what to change.
    """
    flops = estimate_flops(setup, params)
    weight_bytes = params * torch.finfo(dtype).bits // 8
    S, dim = setup.tokens, setup.model.heads * setup.model.head_dim
    act_bytes = 12 * S * max(dim, int(setup.config.get("ffn_dim", 4 * dim))) * torch.finfo(dtype).bits // 8
    est = {"params": params, "weight_gib": weight_bytes / 2**30, "activation_gib": act_bytes / 2**30,
           "flops": flops["total"], "attention_flops": flops["attention"]}
    where = f"--synthetic {setup.model.name} at {setup.video[0]}x{setup.video[1]}x{setup.video[2]} " \
            f"({'x'.join(map(str, setup.grid))} = {setup.tokens} tokens, {setup.num_layers} layers)"
    if device.type == "cpu":
        total_mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if flops["total"] > CPU_FLOP_LIMIT or weight_bytes > total_mem / 2:
            raise ValueError(
                f"{where} cannot run on this CPU: one forward is ~{flops['total'] / 1e12:.1f} TFLOP (about "
                f"{flops['total'] / CPU_FLOPS_PER_S / 60:.0f} min at {CPU_FLOPS_PER_S / 1e9:.0f} GFLOP/s, limit "
                f"{CPU_FLOP_LIMIT / 1e12:.1f} TFLOP) with {weight_bytes / 2**30:.1f} GiB of weights "
                f"({total_mem / 2**30:.0f} GiB of memory). Run it on a CUDA GPU, or shrink it with --frames/--height/"
                "--width and --synthetic-layers."
            )
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if weight_bytes + act_bytes > free:
            raise ValueError(f"{where} needs ~{(weight_bytes + act_bytes) / 2**30:.0f} GiB on {device}, "
                             f"{free / 2**30:.0f} GiB are free.")
    return est


def cast_like_from_pretrained(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast `model`'s floating parameters and buffers to `dtype` in place, except the modules its class lists in
    `_keep_in_fp32_modules`, which stay fp32 as diffusers' `from_pretrained(torch_dtype=dtype)` keeps them."""
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if tensor.is_floating_point() and not any(k in name.split(".") for k in keep):
            tensor.data = tensor.data.to(dtype)
    return model


def build_transformer(setup: SyntheticSetup, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """The transformer with random weights, initialised directly on `device`, cast to `dtype`.

    The modules the class lists in `_keep_in_fp32_modules` stay fp32, as diffusers' `from_pretrained`
    keeps them. Linear layers that the constructor leaves all zero are drawn at random too.
    """
    torch.manual_seed(seed)
    with torch.device(device):
        model = _transformer_class(setup.model.transformer_cls)(**setup.config)
        # linear layers a constructor zero-initialises (Kandinsky 5's modulations: training starts from blocks that
        # add nothing) are trained nonzero: drawn like the others, so that every block's output depends on its
        # attention and the output error vs dense shows that the sparse path ran
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and not module.weight.any():
                module.reset_parameters()
    cast_like_from_pretrained(model, dtype)
    return model.eval().requires_grad_(False)


def make_inputs(setup: SyntheticSetup, device: torch.device, dtype: torch.dtype, seed: int = 0) -> dict:
    """Random forward inputs of the transformer class (latents, timestep, text states)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    C, T, H, W = setup.latent
    m = setup.model

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    if m.transformer_cls == "Cosmos3OmniTransformer":
        text = torch.randint(0, int(setup.config.get("vocab_size", 151936)), (m.text_len,), generator=g).tolist()
        return dict(cosmos3_inputs(setup.config, randn(1, C, T, H, W), text, device=device), return_dict=False)
    inputs = {"hidden_states": randn(1, C, T, H, W), "timestep": torch.tensor([500], device=device),
              "encoder_hidden_states": randn(1, m.text_len, m.text_dim), "return_dict": False}
    if m.transformer_cls == "HunyuanVideoTransformer3DModel":
        inputs.update(encoder_attention_mask=torch.ones(1, m.text_len, device=device, dtype=torch.bool),
                      pooled_projections=randn(1, int(m.config["pooled_projection_dim"])),
                      guidance=torch.tensor([6000.0], device=device, dtype=torch.float32))
    if m.transformer_cls == "CogVideoXTransformer3DModel":
        inputs["hidden_states"] = inputs["hidden_states"].transpose(1, 2)       # (B, F, C, H, W)
        inputs["image_rotary_emb"] = _cogvideox_rotary_emb(setup, device)
    if m.transformer_cls == "HunyuanVideo15Transformer3DModel":
        # as HunyuanVideo15Pipeline passes them for text-to-video: the timestep in the model's dtype, the ByT5
        # states all masked (no quoted text in the prompt), zero image embeddings (which the forward masks out)
        inputs.update(timestep=torch.tensor([500.0], device=device, dtype=dtype),
                      encoder_attention_mask=torch.ones(1, m.text_len, device=device, dtype=torch.bool),
                      encoder_hidden_states_2=randn(1, 256, 1472),
                      encoder_attention_mask_2=torch.zeros(1, 256, device=device, dtype=torch.bool),
                      image_embeds=torch.zeros(1, 729, 1152, device=device, dtype=dtype))
    if m.transformer_cls == "LTXVideoTransformer3DModel":
        inputs.update(_ltx_inputs(setup, inputs["hidden_states"], device))
    if m.transformer_cls == "LTX2VideoTransformer3DModel":
        inputs.update(_ltx2_inputs(setup, inputs["hidden_states"], inputs["encoder_hidden_states"], randn, device))
    if m.transformer_cls == "MochiTransformer3DModel":
        # as MochiPipeline passes them: the timestep in the latents' dtype and T5's boolean prompt mask
        inputs.update(timestep=torch.tensor([500.0], device=device, dtype=dtype),
                      encoder_attention_mask=torch.ones(1, m.text_len, device=device, dtype=torch.bool))
    if m.transformer_cls == "CosmosTransformer3DModel":
        inputs.update(_cosmos_inputs(setup, device, dtype))
    if m.transformer_cls == "Kandinsky5Transformer3DModel":
        inputs.update(_kandinsky5_inputs(setup, inputs["hidden_states"], randn, device, dtype))
    if m.transformer_cls == "HunyuanVideoFramepackTransformer3DModel":
        inputs.update(_framepack_inputs(setup, randn, device, dtype))
    if m.transformer_cls == "AllegroTransformer3DModel":
        inputs.update(encoder_attention_mask=torch.ones(1, m.text_len, device=device, dtype=dtype),
                      image_rotary_emb=_allegro_rotary_emb(setup, device))
    if m.transformer_cls == "MiniMaxH3Transformer3DModel":
        inputs.update(_minimax_h3_inputs(setup, inputs["hidden_states"], randn, device))
    if m.transformer_cls == "WanAnimate2Transformer3DModel":
        inputs.update(_wan_animate2_inputs(setup, inputs["hidden_states"], randn, device, dtype))
    return inputs


def cosmos3_inputs(config, latents: torch.Tensor, text_ids: list[int], sound_latents: torch.Tensor | None = None,
                   fps: float = 24.0, condition_frames: tuple[int, ...] = (), timestep: float = 500.0,
                   device: torch.device | str = "cpu") -> dict:
    """The keyword arguments `Cosmos3OmniPipeline` passes its transformer for one step of one guidance branch, laid
    out by the pipeline's own segment builders: the `text_ids` (the understanding rows), then the video latents
    [1, C, T, H, W] as one vision item (`condition_frames`: latent frames held clean, not predicted), then the sound
    latents [C_sound, L] when given. config: the transformer's config (a dict or its FrozenDict)."""
    from types import SimpleNamespace

    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import Cosmos3OmniPipeline as Pipeline

    stub = SimpleNamespace(transformer=SimpleNamespace(config=_cosmos3_config(config)), vae_scale_factor_temporal=4)
    text = Pipeline._prepare_text_segment(stub, list(text_ids), device)
    offset = text["vision_start_temporal_offset"]
    vision = Pipeline._prepare_vision_segment(stub, latents, bool(condition_frames), offset, fps, text["und_len"],
                                              device, condition_frame_indexes=list(condition_frames))
    length = text["und_len"] + vision["num_vision_tokens"]
    positions = [text["text_mrope_ids"], vision["vision_mrope_ids"]]
    inputs = dict(input_ids=text["input_ids"], text_indexes=text["text_indexes"], und_len=text["und_len"],
                  vision_tokens=[latents], vision_token_shapes=vision["vision_token_shapes"],
                  vision_sequence_indexes=vision["vision_sequence_indexes"],
                  vision_mse_loss_indexes=vision["vision_mse_loss_indexes"],
                  vision_timesteps=torch.full((vision["num_noisy_vision_tokens"],), timestep, device=device),
                  vision_noisy_frame_indexes=vision["vision_noisy_frame_indexes"])
    if sound_latents is not None:
        sound_fps = float(stub.transformer.config.sound_latent_fps)
        sound = Pipeline._prepare_sound_segment(stub, sound_latents, offset, sound_fps, length, device)
        positions.append(sound["sound_mrope_ids"])
        length += sound["sound_len"]
        inputs.update(sound_tokens=[sound_latents], sound_token_shapes=sound["sound_token_shapes"],
                      sound_sequence_indexes=sound["sound_sequence_indexes"],
                      sound_mse_loss_indexes=sound["sound_mse_loss_indexes"],
                      sound_timesteps=torch.full((sound["sound_len"],), timestep, device=device),
                      sound_noisy_frame_indexes=sound["sound_noisy_frame_indexes"])
    return dict(inputs, position_ids=torch.cat(positions, dim=1), sequence_length=length)


def _cosmos3_config(config) -> Any:
    """`config` (a dict of constructor arguments, or a model's config) read by attribute, with the constructor's
    defaults for the keys it leaves out (what the pipeline's segment builders read)."""
    import inspect
    from types import SimpleNamespace

    from diffusers import Cosmos3OmniTransformer

    defaults = {name: p.default for name, p in inspect.signature(Cosmos3OmniTransformer.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    return SimpleNamespace(**{**defaults, **dict(config)})


def _wan_animate2_inputs(setup: SyntheticSetup, latents: torch.Tensor, randn, device: torch.device,
                         dtype: torch.dtype) -> dict:
    """What `WanAnimate2SegmentDenoiseInner` passes its transformer for one generation step (batch 1, one guidance
    branch): per-item lists of the latents (16 channels) and of the 20-channel condition latents and of the text
    states, the CLIP image states, the timestep in the model's dtype, the segment's KV cache (filled by
    `_wan_animate2_prepare`), the token count and the reference grid, and the segment's geometry the block mask is
    built for (`origin_len` frames such that `origin_len // 4 + 1` is the reference's latent frames; `origin_area`
    the pixel size)."""
    from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2KVCache

    T, H, W = setup.grid
    in_dim = int(setup.config["in_dim"])
    return {"hidden_states": [latents[0]], "condition_latents": [randn(in_dim - latents.shape[1], *latents.shape[2:])],
            "encoder_hidden_states": [randn(setup.model.text_len, setup.model.text_dim)],
            "encoder_hidden_states_image": randn(1, 257, 1280),
            "timestep": torch.tensor([500.0], device=device, dtype=dtype),
            "kv_cache": WanAnimate2KVCache(setup.num_layers), "kv_cache_mode": "cached", "seq_len": T * H * W,
            "reference_grid_sizes": torch.tensor([[T - 1, H, W]]), "origin_len": 4 * (T - 2) + 1,
            "origin_area": list(setup.video[1:])}


def _ltx_inputs(setup: SyntheticSetup, latents: torch.Tensor, device: torch.device) -> dict:
    """What `LTXPipeline` passes its transformer besides the text: the latents packed into tokens (B, S, C),
    the latent sizes, the RoPE scale (VAE ratios, 25 fps) and the prompt's attention mask."""
    from diffusers.pipelines.ltx.pipeline_ltx import LTXPipeline

    _, T, H, W = setup.latent
    pt, p, _ = setup.model.patch
    t, s = setup.model.vae_scale
    return {"hidden_states": LTXPipeline._pack_latents(latents, p, pt), "num_frames": T, "height": H, "width": W,
            "rope_interpolation_scale": (t / 25, s, s),
            "encoder_attention_mask": torch.ones(1, setup.model.text_len, device=device, dtype=torch.long)}


def _ltx2_inputs(setup: SyntheticSetup, latents: torch.Tensor, text: torch.Tensor, randn, device: torch.device,
                 fps: float = 24.0) -> dict:
    """What `LTX2Pipeline` passes its transformer besides the video text states: the latents packed into tokens
    (B, S, C), the packed audio latents of the video's duration (25 latent frames per second), the audio text states
    (the connectors give both streams the same length), the all-ones connector mask, the fp32 timestep (also the
    sigma of LTX-2.3 models) and the latent sizes and frame rate from which the forward builds its RoPE coordinates
    (the pipeline passes those coordinates too: the same values)."""
    from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline

    _, T, H, W = setup.latent
    pt, p, _ = setup.model.patch
    audio_frames = round(setup.video[0] / fps * 16000 / 160 / 4)
    mask = torch.ones(1, setup.model.text_len, device=device, dtype=torch.long)
    timestep = torch.tensor([500.0], device=device)
    return {"hidden_states": LTX2Pipeline._pack_latents(latents, p, pt),
            "audio_hidden_states": randn(1, audio_frames, int(setup.model.config["audio_in_channels"])),
            "audio_encoder_hidden_states": text.clone(), "timestep": timestep, "sigma": timestep,
            "encoder_attention_mask": mask, "audio_encoder_attention_mask": mask,
            "num_frames": T, "height": H, "width": W, "fps": fps, "audio_num_frames": audio_frames}


def _cosmos_inputs(setup: SyntheticSetup, device: torch.device, dtype: torch.dtype, sigma: float = 0.5) -> dict:
    """What `Cosmos2_5_PredictBasePipeline` passes its transformer for text to world besides the latents and the text
    states: the condition mask (no conditioning frame), per-frame fp32 timesteps [B, 1, T, 1, 1] (the flow sigma) and
    the all-zero padding mask at the video's pixel size (used only with `concat_padding_mask`)."""
    _, T, H, W = setup.latent
    return {"condition_mask": torch.zeros(1, 1, T, H, W, device=device, dtype=dtype),
            "timestep": torch.full((1, 1, T, 1, 1), sigma, device=device, dtype=torch.float32),
            "padding_mask": torch.zeros(1, 1, *setup.video[1:], device=device, dtype=dtype)}


def _kandinsky5_inputs(setup: SyntheticSetup, latents: torch.Tensor, randn, device: torch.device,
                       dtype: torch.dtype) -> dict:
    """What `Kandinsky5T2VPipeline` passes its transformer besides the Qwen text states: the latents channels last
    (B, T, H, W, C) with the condition latents and mask of `visual_cond` zero (text to video), the pooled CLIP
    embedding, the timestep in the model's dtype, the RoPE positions (arange over the patch grid and the text) and
    the resolution's RoPE scale (1, 2, 2) when both sides are within 480..854 pixels, else (1, 3.16, 3.16); no
    `sparse_params` (full attention). Its forward returns a bare tensor when `return_dict=False`, so the output
    object is asked for (indexed by `[0]` like the others' tuples)."""
    cfg = setup.model.config
    noise = latents[:, : int(cfg["in_visual_dim"])].movedim(1, -1)
    condition = torch.zeros(*noise.shape[:-1], latents.shape[1] - noise.shape[-1], device=device, dtype=dtype)
    height, width = setup.video[1:]
    scale = (1.0, 2.0, 2.0) if all(480 <= side <= 854 for side in (height, width)) else (1.0, 3.16, 3.16)
    return {"hidden_states": torch.cat([noise, condition], dim=-1),
            "pooled_projections": randn(1, int(cfg["in_text_dim2"])),
            "timestep": torch.tensor([500.0], device=device, dtype=dtype),
            "visual_rope_pos": [torch.arange(n, device=device) for n in setup.grid],
            "text_rope_pos": torch.arange(setup.model.text_len, device=device),
            "scale_factor": scale, "sparse_params": None, "return_dict": True}


def _framepack_inputs(setup: SyntheticSetup, randn, device: torch.device, dtype: torch.dtype,
                      guidance_scale: float = 6.0) -> dict:
    """What `HunyuanVideoFramepackPipeline` passes its transformer besides the window's latents and the text states,
    in its default inverted anti-drifting sampling, last section (no padding frames; the others differ only in the
    RoPE frame indices): the clean latents (start image + 1x history), the 2x and 4x history latents and their frame
    indices, split from arange as the pipeline splits them ([start, window, 1x, 2x, 4x]); the SigLIP image
    embeddings; the text mask (all valid) and the pooled CLIP embedding in the model's dtype; the fp32 timestep;
    the distilled guidance (guidance_scale x 1000)."""
    m = setup.model
    C, T, H, W = setup.latent
    clean, history_2x, history_4x = m.history
    start, window, history_1x, indices_2x, indices_4x = torch.arange(
        clean + T + history_2x + history_4x, device=device).split([1, T, clean - 1, history_2x, history_4x])
    return {"timestep": torch.tensor([500.0], device=device),
            "encoder_attention_mask": torch.ones(1, m.text_len, device=device, dtype=dtype),
            "pooled_projections": randn(1, int(m.config["pooled_projection_dim"])),
            "image_embeds": randn(1, m.image_tokens, int(m.config["image_proj_dim"])),
            "guidance": torch.tensor([guidance_scale * 1000.0], device=device, dtype=dtype),
            "indices_latents": window,
            "latents_clean": randn(1, C, clean, H, W), "indices_latents_clean": torch.cat([start, history_1x]),
            "latents_history_2x": randn(1, C, history_2x, H, W), "indices_latents_history_2x": indices_2x,
            "latents_history_4x": randn(1, C, history_4x, H, W), "indices_latents_history_4x": indices_4x}


def _minimax_h3_inputs(setup: SyntheticSetup, latents: torch.Tensor, randn, device: torch.device,
                       sigma: float = 0.5) -> dict:
    """What `MiniMaxH3LoopDenoiser` passes its transformer in the t2va workflow besides the text states: the latents
    as packed patch rows (`patchify_video_latents`), the audio rows, and the layout of
    `MiniMaxH3PrepareLayoutStep.build_packed_sequence` ([text | target audio | target video], no keyframes; every
    text row tagged text) with the per-row timesteps of `MiniMaxH3SetTimestepsStep.build_row_timesteps` at a mid step
    (grid sigma 0.5 through the video (12) and audio (3) shifts of its two schedulers; timestep = 1 - sigma)."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (
        MiniMaxH3PrepareLayoutStep,
        MiniMaxH3SetTimestepsStep,
        patchify_video_latents,
    )
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
        MINIMAX_H3_AUDIO_CHANNELS,
        MINIMAX_H3_AUDIO_TAG,
        MINIMAX_H3_TEXT_TAG,
        MINIMAX_H3_VIDEO_TAG,
    )

    m = setup.model
    _, T, H, W = setup.latent
    audio_rows = setup.audio_tokens
    positions, tags, video, audio, text, condition_video, condition_audio = \
        MiniMaxH3PrepareLayoutStep.build_packed_sequence(
            torch.full((m.text_len,), MINIMAX_H3_TEXT_TAG), T, H, W, audio_rows // MINIMAX_H3_AUDIO_CHANNELS, m.patch,
            MINIMAX_H3_AUDIO_CHANNELS, MINIMAX_H3_AUDIO_TAG, MINIMAX_H3_VIDEO_TAG)
    video_t, audio_t = (1 - shift * sigma / (1 + (shift - 1) * sigma) for shift in (12.0, 3.0))
    timestep, timestep_indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        video, audio, condition_video, condition_audio, m.text_len, video_t, audio_t, max(video_t, 0.999), 1.0)
    layout = dict(timestep=timestep, timestep_indices=timestep_indices, token_tags=tags, position_ids=positions,
                  video_indices=video, audio_indices=audio, text_indices=text)
    return {"hidden_states": patchify_video_latents(latents, m.patch)[None],
            "audio_hidden_states": randn(1, audio_rows, int(m.config["audio_in_channels"])),
            **{name: value.to(device) for name, value in layout.items()}}


def _cogvideox_rotary_emb(setup: SyntheticSetup, device: torch.device):
    """The video RoPE (cos, sin) that `CogVideoXPipeline` passes to its transformer (CogVideoX 1.0 form)."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed
    from diffusers.pipelines.cogvideo.pipeline_cogvideox import get_resize_crop_region_for_grid

    cfg = setup.config
    T, H, W = setup.grid
    p = int(cfg["patch_size"])
    crops = get_resize_crop_region_for_grid((H, W), cfg["sample_width"] // p, cfg["sample_height"] // p)
    return get_3d_rotary_pos_embed(int(cfg["attention_head_dim"]), crops, (H, W), T, device=device)


def _allegro_rotary_emb(setup: SyntheticSetup, device: torch.device):
    """The 3D RoPE that `AllegroPipeline` passes to its transformer: (freqs_t, freqs_h, freqs_w) and the (t, h, w)
    position of every token."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed_allegro

    cfg = setup.config
    T, H, W = setup.grid
    freqs_t, freqs_h, freqs_w, grid_t, grid_h, grid_w = get_3d_rotary_pos_embed_allegro(
        embed_dim=int(cfg["attention_head_dim"]), crops_coords=((0, 0), (H, W)), grid_size=(H, W), temporal_size=T,
        interpolation_scale=(2.2, 2.0, 2.0), device=device)
    pos = torch.cartesian_prod(grid_t.long(), grid_h.long(), grid_w.long())
    return (freqs_t, freqs_h, freqs_w), tuple(pos.reshape(-1, 3).transpose(0, 1).reshape(3, 1, -1).contiguous())


__all__ = ["SYNTHETIC_MODELS", "SyntheticModel", "SyntheticSetup", "synthetic_setup", "build_transformer", "make_inputs",
           "check_feasible"]
