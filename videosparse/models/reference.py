"""The reference text-to-video model trained here: a small pixel-space Wan transformer on procedural clips.

No model weights can be downloaded on the machines this project runs on, and a randomly initialised
transformer has near-uniform attention. This model, trained by `scripts/train_reference_model.py` on
the clips of `reference_data`, gives the demo, the evaluation and the distillation a real attention
structure. Its parts are ordinary diffusers / transformers objects:

* transformer: diffusers' `WanTransformer3DModel` (3 heads of dim 128, 4 layers) working directly on
  RGB pixels with patch (1, 4, 4), so the stock Wan attention processors (and videosparse's) run on it;
  its input also carries 3 absolute-position channels (`position_channels`);
* text: a word-level `tokenizers` tokenizer and `ReferenceTextEncoder` (token + position embeddings and a
  norm: the shipped encoder has no transformer layers, which kept opposite direction words apart);
* scheduler: `FlowMatchEulerDiscreteScheduler` (rectified flow, velocity = noise - data).

The default clip, 16 frames of 64x64 pixels, is a (16, 16, 16) token grid: 4,096 video tokens.

    from videosparse.models import load_reference_pipeline
    pipe = load_reference_pipeline()
    frames = pipe("a red circle moving right on a dark background").frames[0]   # [16, 64, 64, 3] in [0, 1]
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

import torch
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
from diffusers.pipelines.wan.pipeline_output import WanPipelineOutput
from diffusers.utils.torch_utils import randn_tensor
from diffusers.video_processor import VideoProcessor

from ..validation import int_at_least
from .reference_data import DEFAULT_PROMPT
from .reference_text import MAX_TEXT_LENGTH, ReferenceTextEncoder, build_reference_tokenizer

logger = logging.getLogger(__name__)

REFERENCE_WEIGHTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reference_weights")

PATCH_SIZE = (1, 4, 4)
OUTPUT_TYPES = ("np", "pt", "pil", "latent")    # what ReferenceVideoPipeline returns
TEXT_DIM = 256
POSITION_CHANNELS = 3   # (t, y, x) ramps appended to the input when in_channels == out_channels + 3
# the shipped model's architecture: 3 RGB channels in and out, plus the position ramps on the input
REFERENCE_TRANSFORMER_CONFIG: dict[str, Any] = dict(
    patch_size=PATCH_SIZE, num_attention_heads=3, attention_head_dim=128, in_channels=3 + POSITION_CHANNELS,
    out_channels=3,
    text_dim=TEXT_DIM, freq_dim=256, ffn_dim=1024, num_layers=4, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
)
# embedding-only (num_layers 0): encoder layers trained here merged "left" with "right"
# (benchmarks/reference_model_stage5_h200.json)
REFERENCE_TEXT_CONFIG: dict[str, Any] = dict(dim=TEXT_DIM, num_layers=0, num_heads=4, ffn_dim=512,
                                             max_length=MAX_TEXT_LENGTH)
SCHEDULER_SHIFT = 2.0


def position_channels(batch: int, num_frames: int, height: int, width: int, device=None,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Absolute-position input channels: [B, 3, T, H, W] ramps of (t, y, x), each from -1 to 1.

    Wan's transformer sees positions only relatively (3D RoPE), so "starts on the right" is hard for
    a small model to produce; a transformer built with `in_channels = out_channels + 3` gets these
    ramps next to the noisy video (the pipeline and the training script append them).
    """
    def ramp(n: int) -> torch.Tensor:
        return torch.linspace(-1.0, 1.0, n, device=device, dtype=dtype) if n > 1 else torch.zeros(1, device=device, dtype=dtype)

    t, y, x = torch.meshgrid(ramp(num_frames), ramp(height), ramp(width), indexing="ij")
    return torch.stack([t, y, x])[None].expand(batch, -1, -1, -1, -1)


def transformer_input(transformer, video: torch.Tensor) -> torch.Tensor:
    """`video` [B, C, T, H, W] with the position channels appended when the transformer takes them.

    Raises:
        ValueError: if in_channels - out_channels is neither 0 nor `POSITION_CHANNELS`.
    """
    config = transformer.config if hasattr(transformer, "config") else transformer.module.config  # DDP-wrapped
    extra = config.in_channels - config.out_channels
    if extra == 0:
        return video
    if extra != POSITION_CHANNELS:
        raise ValueError(f"transformer has in_channels={config.in_channels}, out_channels={config.out_channels}; "
                         f"the reference pipeline supports in = out (plain) or in = out + {POSITION_CHANNELS} "
                         "(position channels).")
    B, _, T, H, W = video.shape
    return torch.cat([video, position_channels(B, T, H, W, video.device, video.dtype)], dim=1)

DEFAULT_NUM_FRAMES = 16
DEFAULT_HEIGHT = 64
DEFAULT_WIDTH = 64
DEFAULT_NUM_INFERENCE_STEPS = 10
DEFAULT_GUIDANCE_SCALE = 4.0
REFERENCE_CALL_DEFAULTS: dict[str, Any] = dict(
    prompt=DEFAULT_PROMPT, num_frames=DEFAULT_NUM_FRAMES, height=DEFAULT_HEIGHT, width=DEFAULT_WIDTH,
    num_inference_steps=DEFAULT_NUM_INFERENCE_STEPS, guidance_scale=DEFAULT_GUIDANCE_SCALE,
    max_sequence_length=MAX_TEXT_LENGTH,
)
"""Keyword arguments of the default `videosparse generate` call (16 x 64 x 64 pixels = 4,096 video tokens)."""


def video_token_grid(num_frames: int, height: int, width: int, patch_size=PATCH_SIZE) -> tuple[int, int, int]:
    """(T, H, W) of the transformer's video tokens for a clip size (pixel space, so latent = pixels)."""
    pt, ph, pw = patch_size
    return num_frames // pt, height // ph, width // pw


def encode_text(tokenizer, text_encoder: ReferenceTextEncoder, prompts: list[str],
                device: torch.device | str, max_sequence_length: int = MAX_TEXT_LENGTH) -> torch.Tensor:
    """Text embeddings [B, L, dim] with padding positions set to zero (as Wan does with its T5 embeddings).

    An empty prompt is all padding, hence all zeros: the unconditional embedding of classifier-free
    guidance. Training and the pipeline both use this function.
    """
    enc = tokenizer(prompts, padding="max_length", max_length=max_sequence_length, truncation=True,
                    add_special_tokens=False, return_attention_mask=True, return_tensors="pt")
    ids = enc.input_ids.to(device)
    mask = enc.attention_mask.to(device)
    hidden = text_encoder(ids, mask).last_hidden_state
    return hidden * mask[..., None].to(hidden.dtype)


class ReferenceVideoPipeline(DiffusionPipeline):
    r"""Text-to-video pipeline of the reference model (pixel space, no VAE).

    Follows diffusers' `WanPipeline`: classifier-free guidance with separate cond / uncond transformer
    calls, each inside `transformer.cache_context("cond" | "uncond", step_index=..., num_inference_steps=...,
    timestep=..., sigma=...)`, Euler steps of `FlowMatchEulerDiscreteScheduler`, and a `WanPipelineOutput`
    whose `.frames` is np [B, T, H, W, 3] in [0, 1] (or "pt" [B, T, 3, H, W], "pil", "latent" [B, 3, T, H, W]:
    the last step's sample as is, about [-1, 1] but not clamped).

    Args:
        tokenizer (`PreTrainedTokenizerFast`): word-level tokenizer.
        text_encoder (`ReferenceTextEncoder`): tiny text encoder.
        transformer (`WanTransformer3DModel`): the denoiser, out_channels = 3; in_channels = 3, or 6 with
            the absolute-position channels (`position_channels`) appended to its input.
        scheduler (`FlowMatchEulerDiscreteScheduler`): the sampler.

    Example:
        >>> from videosparse.models import load_reference_pipeline
        >>> pipe = load_reference_pipeline()
        >>> video = pipe("a blue square moving up on a light background", num_inference_steps=3).frames[0]
        >>> video.shape, video.dtype                   # [T, H, W, 3] in [0, 1]; 3 steps keep the doctest short
        ((16, 64, 64, 3), dtype('float32'))
    """

    model_cpu_offload_seq = "text_encoder->transformer"
    _callback_tensor_inputs = ["latents", "prompt_embeds", "negative_prompt_embeds"]

    def __init__(self, tokenizer, text_encoder: ReferenceTextEncoder, transformer: WanTransformer3DModel,
                 scheduler: FlowMatchEulerDiscreteScheduler):
        super().__init__()
        self.register_modules(tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer,
                              scheduler=scheduler)
        # pixel space: the "latent" grid is the pixel grid
        self.vae_scale_factor_temporal = 1
        self.vae_scale_factor_spatial = 1
        self.video_processor = VideoProcessor(vae_scale_factor=1)

    def encode_prompt(
        self,
        prompt: str | list[str] | None,
        negative_prompt: str | list[str] | None = None,
        do_classifier_free_guidance: bool = True,
        num_videos_per_prompt: int = 1,
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        max_sequence_length: int = MAX_TEXT_LENGTH,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prompt (and negative prompt) embeddings [B * num_videos_per_prompt, L, text_dim] (given ones [B, L,
        text_dim] are repeated)."""
        device = device or self._execution_device
        dtype = dtype or self.transformer.dtype
        prompt = [prompt] if isinstance(prompt, str) else prompt
        batch_size = len(prompt) if prompt is not None else prompt_embeds.shape[0]

        def embed(texts):
            emb = encode_text(self.tokenizer, self.text_encoder, texts, device, max_sequence_length)
            return emb.repeat_interleave(num_videos_per_prompt, dim=0).to(dtype)

        if prompt_embeds is None:
            prompt_embeds = embed(prompt)
        else:                   # given embeddings: one per prompt, repeated as computed ones are
            prompt_embeds = prompt_embeds.repeat_interleave(num_videos_per_prompt, dim=0)
            if negative_prompt_embeds is not None:
                negative_prompt_embeds = negative_prompt_embeds.repeat_interleave(num_videos_per_prompt, dim=0)
        if do_classifier_free_guidance and negative_prompt_embeds is None:
            negative_prompt = negative_prompt or ""
            negative_prompt = batch_size * [negative_prompt] if isinstance(negative_prompt, str) else negative_prompt
            if len(negative_prompt) != batch_size:
                raise ValueError(f"negative_prompt has batch size {len(negative_prompt)}, but prompt has batch size "
                                 f"{batch_size}; pass one negative prompt per prompt or a single string.")
            negative_prompt_embeds = embed(negative_prompt)
        return prompt_embeds.to(device, dtype), (
            negative_prompt_embeds.to(device, dtype) if negative_prompt_embeds is not None else None)

    def check_inputs(self, prompt, negative_prompt, num_frames, height, width, prompt_embeds, negative_prompt_embeds,
                     callback_on_step_end_tensor_inputs, num_inference_steps=1, num_videos_per_prompt=1,
                     output_type="np"):
        pt, ph, pw = self.transformer.config.patch_size
        if height % ph or width % pw or num_frames % pt or num_frames < 1 or height < ph or width < pw:
            raise ValueError(f"height={height} and width={width} must be positive multiples of the patch size ({ph}, "
                             f"{pw}) and num_frames={num_frames} of {pt} (and >= 1).")
        if prompt is not None and prompt_embeds is not None:
            raise ValueError("Pass either `prompt` or `prompt_embeds`, not both.")
        if prompt is None and prompt_embeds is None:
            raise ValueError("Provide either `prompt` or `prompt_embeds`.")
        if prompt is not None and not isinstance(prompt, (str, list)):
            raise TypeError(f"`prompt` must be a str or a list of str, got {type(prompt)}.")
        if negative_prompt is not None and negative_prompt_embeds is not None:
            raise ValueError("Pass either `negative_prompt` or `negative_prompt_embeds`, not both.")
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"output_type={output_type!r} must be one of {OUTPUT_TYPES}.")
        int_at_least(num_inference_steps, 1, "num_inference_steps", "denoising steps")
        int_at_least(num_videos_per_prompt, 1, "num_videos_per_prompt", "clips per prompt")
        if callback_on_step_end_tensor_inputs is not None and not all(
                k in self._callback_tensor_inputs for k in callback_on_step_end_tensor_inputs):
            raise ValueError(f"callback_on_step_end_tensor_inputs must be among {self._callback_tensor_inputs}, "
                             f"got {callback_on_step_end_tensor_inputs}.")

    def prepare_latents(self, batch_size: int, num_frames: int, height: int, width: int, dtype, device, generator,
                        latents: torch.Tensor | None = None) -> torch.Tensor:
        """Initial noise [B, 3, T, H, W] (float32), or `latents` moved to the device."""
        shape = (batch_size, self.transformer.config.out_channels, num_frames, height, width)
        if latents is not None:
            if tuple(latents.shape) != shape:
                raise ValueError(f"latents have shape {tuple(latents.shape)}; this call needs {shape} (batch x "
                                 "num_videos_per_prompt, channels, num_frames, height, width).")
            return latents.to(device=device, dtype=dtype)
        if isinstance(generator, list) and len(generator) != batch_size:
            raise ValueError(f"got {len(generator)} generators for a batch of {batch_size}.")
        return randn_tensor(shape, generator=generator, device=device, dtype=dtype)

    @property
    def guidance_scale(self) -> float:
        return self._guidance_scale

    @property
    def do_classifier_free_guidance(self) -> bool:
        return self._guidance_scale > 1.0

    @property
    def num_timesteps(self) -> int:
        return self._num_timesteps

    @property
    def current_timestep(self):
        return self._current_timestep

    @property
    def interrupt(self) -> bool:
        return self._interrupt

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str] | None = None,
        negative_prompt: str | list[str] | None = None,
        num_frames: int = DEFAULT_NUM_FRAMES,
        height: int = DEFAULT_HEIGHT,
        width: int = DEFAULT_WIDTH,
        num_inference_steps: int = DEFAULT_NUM_INFERENCE_STEPS,
        guidance_scale: float = DEFAULT_GUIDANCE_SCALE,
        num_videos_per_prompt: int = 1,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        output_type: str = "np",
        return_dict: bool = True,
        attention_kwargs: dict[str, Any] | None = None,
        callback_on_step_end: Callable[[Any, int, Any, dict], dict] | None = None,
        callback_on_step_end_tensor_inputs: list[str] = ("latents",),
        max_sequence_length: int = MAX_TEXT_LENGTH,
    ):
        r"""Generate clips.

        Args:
            prompt (`str` or `list[str]`): what to show, e.g. "a red circle moving left on a dark background".
            negative_prompt (`str` or `list[str]`, *optional*): the unconditional prompt ("" by default).
            num_frames (`int`, defaults to 16), height (`int`, defaults to 64), width (`int`, defaults to 64):
                clip size; height and width divisible by 4.
            num_inference_steps (`int`, defaults to 10): Euler steps.
            guidance_scale (`float`, defaults to 4.0): classifier-free guidance; <= 1 disables it.
            num_videos_per_prompt (`int`, defaults to 1): clips per prompt.
            generator (`torch.Generator`, *optional*): for the initial noise.
            latents (`torch.Tensor`, *optional*): initial noise [B, 3, T, H, W].
            prompt_embeds, negative_prompt_embeds (`torch.Tensor`, *optional*): precomputed text embeddings, one
                per prompt [B, L, text_dim] (repeated `num_videos_per_prompt` times, as computed ones).
            output_type (`str`, defaults to "np"): "np", "pt", "pil" or "latent".
            return_dict (`bool`, defaults to True): return a `WanPipelineOutput` rather than a tuple.
            attention_kwargs (`dict`, *optional*): passed to the transformer.
            callback_on_step_end (`Callable`, *optional*): called as `(pipe, i, t, tensors)` after each step.
            callback_on_step_end_tensor_inputs (`list[str]`): tensors handed to the callback.
            max_sequence_length (`int`, defaults to 16): text tokens.

        Returns:
            `WanPipelineOutput` with `frames` (or a tuple `(frames,)`).
        """
        callback_on_step_end_tensor_inputs = list(callback_on_step_end_tensor_inputs)
        self.check_inputs(prompt, negative_prompt, num_frames, height, width, prompt_embeds, negative_prompt_embeds,
                          callback_on_step_end_tensor_inputs, num_inference_steps, num_videos_per_prompt, output_type)
        longest = self.text_encoder.config.max_length
        if isinstance(max_sequence_length, bool) or not isinstance(max_sequence_length, int) or \
                not 1 <= max_sequence_length <= longest:
            raise ValueError(f"max_sequence_length={max_sequence_length!r} must be an int in [1, {longest}] (the text "
                             "encoder's positions).")
        self._guidance_scale = guidance_scale
        self._attention_kwargs = attention_kwargs
        self._current_timestep = None
        self._interrupt = False
        device = self._execution_device
        batch_size = (1 if isinstance(prompt, str) else len(prompt)) if prompt is not None else prompt_embeds.shape[0]

        transformer_dtype = self.transformer.dtype
        prompt_embeds, negative_prompt_embeds = self.encode_prompt(
            prompt, negative_prompt, self.do_classifier_free_guidance, num_videos_per_prompt, prompt_embeds,
            negative_prompt_embeds, max_sequence_length, device, transformer_dtype)

        self.scheduler.set_timesteps(num_inference_steps, device=device)
        timesteps = self.scheduler.timesteps
        latents = self.prepare_latents(batch_size * num_videos_per_prompt, num_frames, height, width, torch.float32,
                                       device, generator, latents)
        self._num_timesteps = len(timesteps)
        self.scheduler.set_begin_index(0)

        with self.progress_bar(total=len(timesteps)) as progress_bar:
            for i, t in enumerate(timesteps):
                if self.interrupt:
                    continue
                self._current_timestep = t
                model_input = transformer_input(self.transformer, latents.to(transformer_dtype))
                timestep = t.expand(latents.shape[0])
                context = dict(step_index=i, num_inference_steps=len(timesteps), timestep=t,
                               sigma=float(self.scheduler.sigmas[i]))
                with self.transformer.cache_context("cond", **context):
                    noise_pred = self.transformer(hidden_states=model_input, timestep=timestep,
                                                  encoder_hidden_states=prompt_embeds,
                                                  attention_kwargs=attention_kwargs, return_dict=False)[0]
                if self.do_classifier_free_guidance:
                    with self.transformer.cache_context("uncond", **context):
                        noise_uncond = self.transformer(hidden_states=model_input, timestep=timestep,
                                                        encoder_hidden_states=negative_prompt_embeds,
                                                        attention_kwargs=attention_kwargs, return_dict=False)[0]
                    noise_pred = noise_uncond + guidance_scale * (noise_pred - noise_uncond)
                latents = self.scheduler.step(noise_pred.float(), t, latents, return_dict=False)[0]

                if callback_on_step_end is not None:
                    # not `locals()` in a comprehension: before Python 3.12 that is the comprehension's own scope
                    available = {"latents": latents, "prompt_embeds": prompt_embeds,
                                 "negative_prompt_embeds": negative_prompt_embeds}
                    tensors = {k: available[k] for k in callback_on_step_end_tensor_inputs}
                    outputs = callback_on_step_end(self, i, t, tensors)
                    latents = outputs.pop("latents", latents)
                    prompt_embeds = outputs.pop("prompt_embeds", prompt_embeds)
                    negative_prompt_embeds = outputs.pop("negative_prompt_embeds", negative_prompt_embeds)
                progress_bar.update()

        self._current_timestep = None
        if output_type == "latent":
            video = latents
        else:
            video = self.video_processor.postprocess_video(latents.clamp(-1.0, 1.0), output_type=output_type)
        self.maybe_free_model_hooks()
        if not return_dict:
            return (video,)
        return WanPipelineOutput(frames=video)


def build_reference_pipeline(*, seed: int = 0, transformer_overrides: dict[str, Any] | None = None,
                             text_overrides: dict[str, Any] | None = None) -> ReferenceVideoPipeline:
    """A reference pipeline with freshly initialised (random) weights, float32 on the CPU.

    Args:
        seed: seed of the initial weights.
        transformer_overrides: changes to `REFERENCE_TRANSFORMER_CONFIG` (e.g. fewer layers for tests).
        text_overrides: changes to `REFERENCE_TEXT_CONFIG`.
    """
    torch.manual_seed(seed)
    tokenizer = build_reference_tokenizer()
    text_encoder = ReferenceTextEncoder(vocab_size=len(tokenizer), **{**REFERENCE_TEXT_CONFIG, **(text_overrides or {})})
    cfg = {**REFERENCE_TRANSFORMER_CONFIG, **(transformer_overrides or {})}
    if cfg["text_dim"] != text_encoder.config.dim:
        raise ValueError(f"transformer text_dim={cfg['text_dim']} must equal the text encoder's dim="
                         f"{text_encoder.config.dim}.")
    transformer = WanTransformer3DModel(**cfg)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=SCHEDULER_SHIFT)
    return ReferenceVideoPipeline(tokenizer=tokenizer, text_encoder=text_encoder.eval(),
                                  transformer=transformer.eval(), scheduler=scheduler)


def load_reference_pipeline(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                            path: str | os.PathLike | None = None) -> ReferenceVideoPipeline:
    """Load the trained reference pipeline shipped inside the package (offline, safetensors only).

    Args:
        device: where to put the pipeline ("cpu", "cuda", ...).
        dtype: parameter dtype (weights are stored in float16 and cast).
        path: another saved pipeline folder instead of the shipped one.

    Returns:
        `ReferenceVideoPipeline` in eval mode.

    Raises:
        FileNotFoundError: if the folder holds no saved pipeline.
    """
    path = os.fspath(path or REFERENCE_WEIGHTS_DIR)
    if not os.path.isfile(os.path.join(path, "model_index.json")):
        raise FileNotFoundError(
            f"no reference pipeline at {path!r} (model_index.json missing); train and export one with "
            "`python scripts/train_reference_model.py --export-dir <dir>`.")
    pipe = ReferenceVideoPipeline.from_pretrained(path, dtype=dtype, use_safetensors=True,
                                                  local_files_only=True)
    pipe.transformer.eval()
    pipe.text_encoder.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


__all__ = [
    "DEFAULT_GUIDANCE_SCALE", "DEFAULT_HEIGHT", "DEFAULT_NUM_FRAMES", "DEFAULT_NUM_INFERENCE_STEPS", "DEFAULT_PROMPT",
    "DEFAULT_WIDTH", "REFERENCE_CALL_DEFAULTS", "REFERENCE_WEIGHTS_DIR", "ReferenceVideoPipeline", "build_reference_pipeline", "encode_text",
    "load_reference_pipeline", "video_token_grid",
]
