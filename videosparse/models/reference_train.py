"""Training of the reference model (rectified flow on procedural clips), on accelerate.

`train(TrainConfig(...))` runs the loop: bf16 mixed precision on CUDA, AdamW with warmup, an EMA of
the weights (diffusers' `EMAModel`), checkpoints written atomically into step folders with
accelerate's `save_state` (a temporary folder renamed into place) and resumed with `load_state`,
sample clips at every checkpoint, and an export of the EMA weights as a `ReferenceVideoPipeline`
(safetensors, float16) at the end. Data is made on the fly and seeded by the step index, so a
resumed run sees the same batches as an uninterrupted one (no data loader to fast-forward).

`scripts/train_reference_model.py` is the command-line entry point.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from .._io import replace_durably
from .reference import (
    DEFAULT_GUIDANCE_SCALE,
    DEFAULT_HEIGHT,
    DEFAULT_NUM_FRAMES,
    DEFAULT_WIDTH,
    PATCH_SIZE,
    SCHEDULER_SHIFT,
    ReferenceVideoPipeline,
    build_reference_pipeline,
    encode_text,
    transformer_input,
)
from .reference_data import check_travel, clip_batch

logger = logging.getLogger(__name__)

CONFIG_NAME = "train_config.json"
STATE_NAME = "trainer_state.json"
EMA_NAME = "ema.safetensors"
STAGES_NAME = "training_stages.json"
CHECKPOINT_PREFIX = "step-"

SAMPLE_PROMPTS = (
    "a red circle moving right on a dark background",
    "a blue square moving up on a light background",
    "a yellow triangle moving left on a gray background",
    "a green cross bouncing on a gradient background",
)


@dataclass
class TrainConfig:
    """Settings of one training run (saved as `train_config.json` beside checkpoints and exported weights).

    The defaults are the recipe of the shipped weights (with `REFERENCE_TRANSFORMER_CONFIG` and
    `REFERENCE_TEXT_CONFIG`): 7.4 min on an H200, then a continuation (`init_from`) of 7.6 min at
    learning_rate 2e-4 (`scripts/train_reference_model.py` shows both commands).

    Args:
        output_dir: run folder (checkpoints/, samples/, loss_log.jsonl, train_config.json).
        export_dir: where the final pipeline is written (None: `output_dir/export`).
        seed: seed of the weights, the data and the noise.
        max_steps: optimisation steps in total (across resumes).
        max_minutes: stop (checkpoint and export) after this many minutes of this process, if set.
        batch_size: clips per step (per process).
        learning_rate, weight_decay, warmup_steps, grad_clip: AdamW and its schedule (linear warmup, constant).
        ema_decay: upper bound of the EMA decay ((1 + n) / (10 + n) before it).
        mixed_precision: "auto" (bf16 on CUDA, none on CPU), "bf16", "fp16" or "no".
        num_frames, height, width: the main clip size.
        p_default_size: probability that a step uses the main size; otherwise one of `alt_sizes`.
        alt_sizes: other (frames, height, width) sizes, so the model also works at small sizes (None or empty:
            the main size only).
        p_empty_prompt: probability of an empty prompt (classifier-free guidance).
        shift: time shift of the noise levels (as in `FlowMatchEulerDiscreteScheduler(shift=...)`).
        logit_normal_std: spread of the logit-normal draw of the noise level before the shift.
        logit_normal_mean: centre of that draw; > 0 trains more at high noise, where the layout and the motion
            of a clip (and so the direction word) are decided. The exported scheduler's shift is `shift` either way.
        p_high_noise: share of the clips whose noise level is drawn uniformly in [`high_noise_min`, 1) instead
            (the first sampler steps, where a clip's layout and motion are decided from the prompt alone, are
            almost never drawn by the logit-normal).
        high_noise_min: lower end of that uniform draw.
        travel: (shortest, longest) travel of left / right / up / down clips (`reference_data.render_clips`);
            longer paths make the direction word decide more of what the first sampler steps predict.
        p_directional: probability that a clip moves left / right / up / down (None: motions uniform, 4 / 7).
        twin_fraction: share of each batch in pairs of a directional clip and its time-reversed twin (the
            twin with the opposite direction word, the same noise level and time-reversed noise; `reference_data.clip_batch`).
        checkpoint_every: steps between checkpoints (and samples).
        keep_checkpoints: checkpoints kept on disk (oldest removed first).
        sample_steps: Euler steps of the sample clips.
        log_every: steps between log lines.
        resume: "auto" (latest checkpoint in output_dir if any), "none", or a checkpoint folder.
        transformer_overrides, text_overrides: changes to the model configs (tests use tiny models).
        export_dtype: "float16", "bfloat16" or "float32" storage of the exported weights.
        init_from: a saved pipeline folder whose transformer and text encoder weights start a fresh run
            (ignored when resuming from a checkpoint), e.g. the shipped weights for a continuation.
        scale_batch_by_tokens: at sizes smaller than the main one, grow the batch so a step holds about as
            many tokens as a main-size step (up to `max_batch_size`).
        max_batch_size: cap of the scaled batch.
    """

    output_dir: str = "outputs/reference_train"
    export_dir: str | None = None
    seed: int = 0
    max_steps: int = 20000
    max_minutes: float | None = None
    batch_size: int = 32
    learning_rate: float = 4e-4
    weight_decay: float = 0.0
    warmup_steps: int = 200
    grad_clip: float = 1.0
    ema_decay: float = 0.999
    mixed_precision: str = "auto"
    num_frames: int = DEFAULT_NUM_FRAMES
    height: int = DEFAULT_HEIGHT
    width: int = DEFAULT_WIDTH
    p_default_size: float = 0.3
    alt_sizes: tuple[tuple[int, int, int], ...] = ((16, 32, 32), (8, 32, 32), (16, 48, 48), (12, 48, 48))
    p_empty_prompt: float = 0.1
    shift: float = SCHEDULER_SHIFT
    logit_normal_std: float = 1.0
    logit_normal_mean: float = 0.0
    p_high_noise: float = 0.2
    high_noise_min: float = 0.9
    travel: tuple[float, float] = (0.5, 0.8)
    p_directional: float | None = 0.75
    twin_fraction: float = 0.5
    checkpoint_every: int = 500
    keep_checkpoints: int = 2
    sample_steps: int = 20
    log_every: int = 50
    resume: str = "auto"
    transformer_overrides: dict[str, Any] = field(default_factory=dict)
    text_overrides: dict[str, Any] = field(default_factory=dict)
    export_dtype: str = "float16"
    init_from: str | None = None
    scale_batch_by_tokens: bool = True
    max_batch_size: int = 128

    def __post_init__(self) -> None:
        if self.mixed_precision not in ("auto", "bf16", "fp16", "no"):
            raise ValueError(f"mixed_precision={self.mixed_precision!r}; choose 'auto', 'bf16', 'fp16' or 'no'.")
        if self.export_dtype not in ("float16", "bfloat16", "float32"):
            raise ValueError(f"export_dtype={self.export_dtype!r}; choose 'float16', 'bfloat16' or 'float32'.")
        for name in ("max_steps", "batch_size", "max_batch_size", "checkpoint_every", "keep_checkpoints", "log_every", "sample_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1.")
        if not 0.0 <= self.p_default_size <= 1.0 or not 0.0 <= self.p_empty_prompt < 1.0:
            raise ValueError(f"p_default_size={self.p_default_size} must lie in [0, 1] and "
                             f"p_empty_prompt={self.p_empty_prompt} in [0, 1).")
        if self.p_directional is not None and not 0.0 <= self.p_directional <= 1.0:
            raise ValueError(f"p_directional={self.p_directional} must lie in [0, 1] (or be None).")
        if not 0.0 <= self.twin_fraction <= 1.0:
            raise ValueError(f"twin_fraction={self.twin_fraction} must lie in [0, 1].")
        if not 0.0 <= self.p_high_noise <= 1.0 or not 0.0 <= self.high_noise_min < 1.0:
            raise ValueError(f"p_high_noise={self.p_high_noise} must lie in [0, 1] and "
                             f"high_noise_min={self.high_noise_min} in [0, 1).")
        self.travel = check_travel(self.travel)
        for name, low in (("learning_rate", 0.0), ("shift", None), ("ema_decay", 0.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
                    (low is None and value <= 0) or (low is not None and value < low) or \
                    (name == "ema_decay" and value >= 1):
                allowed = {"learning_rate": ">= 0", "shift": "> 0", "ema_decay": "in [0, 1)"}[name]
                raise ValueError(f"{name}={value!r} must be a finite number {allowed}.")
        for name in ("transformer_overrides", "text_overrides"):
            value = {} if getattr(self, name) is None else getattr(self, name)
            if not isinstance(value, dict):
                raise ValueError(f"{name}={value!r} must be a dict of config fields (or None: none).")
            setattr(self, name, value)
        patch = tuple(self.transformer_overrides.get("patch_size", PATCH_SIZE))
        self.alt_sizes = () if self.alt_sizes is None else tuple(
            _clip_size(s, f"alt_sizes[{i}]", patch) for i, s in enumerate(self.alt_sizes))
        _clip_size((self.num_frames, self.height, self.width), "(num_frames, height, width)", patch)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown TrainConfig fields {sorted(unknown)}; known: {sorted(names)}.")
        return cls(**d)

    def save(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, CONFIG_NAME), "w") as f:
            json.dump(self.to_dict(), f, indent=2)


def sample_sigmas(n: int, shift: float, std: float, generator: torch.Generator, device,
                  mean: float = 0.0, p_high: float = 0.0, high_min: float = 0.9) -> torch.Tensor:
    """Noise levels in (0, 1): logit-normal draws (centre `mean`) mapped by the scheduler's time shift, a share
    `p_high` of them replaced by uniform draws in [`high_min`, 1). float32 [n]."""
    u = torch.sigmoid(torch.randn(n, generator=generator, device=device) * std + mean)
    sigmas = shift * u / (1.0 + (shift - 1.0) * u)
    if p_high > 0.0:
        high = torch.rand(n, generator=generator, device=device) < p_high
        level = high_min + (1.0 - high_min) * torch.rand(n, generator=generator, device=device)
        sigmas = torch.where(high, level, sigmas)
    return sigmas


def flow_matching_loss(transformer, text_encoder, tokenizer, video: torch.Tensor, prompts: list[str],
                       sigmas: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """MSE between the predicted and the true velocity (noise - data) at x = (1 - s) data + s noise."""
    emb = encode_text(tokenizer, text_encoder, prompts, video.device)
    s = sigmas.view(-1, 1, 1, 1, 1)
    noisy = ((1.0 - s) * video + s * noise).to(video.dtype)      # fp32 noise levels keep a half-precision clip's dtype
    pred = transformer(hidden_states=transformer_input(transformer, noisy), timestep=sigmas * 1000.0,
                       encoder_hidden_states=emb, return_dict=False)[0]
    return F.mse_loss(pred.float(), (noise - video).float())


def pair_twins(noise: torch.Tensor, sigmas: torch.Tensor, twin_of: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Give each time-reversed twin (``twin_of[i] >= 0``) its source's noise level and its noise reversed in
    time, so a twin's noisy clip is exactly its source's played backwards: the pair then differs only in
    the direction word, and the model can lower the loss of both only by following that word."""
    twins = (twin_of >= 0).nonzero().flatten()
    if twins.numel() == 0:
        return noise, sigmas
    src = twin_of[twins]
    noise, sigmas = noise.clone(), sigmas.clone()
    twins, src = twins.to(noise.device), src.to(noise.device)
    noise[twins] = noise[src].flip(2)
    sigmas[twins] = sigmas[src]
    return noise, sigmas


def _clip_size(size, name: str, patch: tuple[int, int, int]) -> tuple[int, int, int]:
    """A training clip size (frames, height, width) as three ints the renderer and the model take (at least 2
    frames and 8 x 8 pixels, multiples of the patch), or a ValueError naming it: a size drawn at random would
    otherwise end a run at whichever step first draws it."""
    try:
        values = tuple(size)
        ok = len(values) == 3 and not any(isinstance(v, bool) or int(v) != v for v in values)
    except (TypeError, ValueError):
        ok = False
    if ok:
        T, H, W = (int(v) for v in values)
        ok = T >= 2 and H >= 8 and W >= 8 and not (T % patch[0] or H % patch[1] or W % patch[2])
    if not ok:
        raise ValueError(f"{name}={size!r} must be three ints (frames, height, width): at least 2 frames and 8 x 8 "
                         f"pixels, multiples of the patch size {patch}.")
    return T, H, W


def _truncate_log(path: str, step: int) -> None:
    """Keep the lines of the loss log `path` (JSON lines with a "step") up to `step`, rewritten atomically: a resumed
    run logs the steps after its checkpoint again."""
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    kept = [line for line in lines if (entry := _log_entry(line)) is not None and entry.get("step", 0) <= step]
    if len(kept) != len(lines):
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        replace_durably(tmp, path)


def _log_entry(line: str) -> dict | None:
    """A loss-log line as its dict; None for a damaged one (a line cut by a full disk or a kill), dropped."""
    try:
        entry = json.loads(line)
    except json.JSONDecodeError:
        return None
    return entry if isinstance(entry, dict) else None


def _checkpoints(output_dir: str) -> list[str]:
    folder = os.path.join(output_dir, "checkpoints")
    if not os.path.isdir(folder):
        return []
    names = [n for n in os.listdir(folder) if n.startswith(CHECKPOINT_PREFIX)
             and os.path.isfile(os.path.join(folder, n, STATE_NAME))]
    return [os.path.join(folder, n) for n in sorted(names, key=lambda n: int(n[len(CHECKPOINT_PREFIX):]))]


def latest_checkpoint(output_dir: str) -> str | None:
    """The newest complete step folder under `output_dir/checkpoints`, or None."""
    found = _checkpoints(output_dir)
    return found[-1] if found else None


def _named_params(transformer, text_encoder) -> list[tuple[str, torch.nn.Parameter]]:
    return ([(f"transformer.{n}", p) for n, p in transformer.named_parameters()]
            + [(f"text_encoder.{n}", p) for n, p in text_encoder.named_parameters()])


def _batch_for(cfg: TrainConfig, size: tuple[int, int, int]) -> int:
    if not cfg.scale_batch_by_tokens:
        return cfg.batch_size
    ratio = (cfg.num_frames * cfg.height * cfg.width) / (size[0] * size[1] * size[2])
    return max(cfg.batch_size, min(cfg.max_batch_size, int(round(cfg.batch_size * ratio))))


def _widen_patch_embedding(state: dict[str, torch.Tensor], transformer) -> dict[str, torch.Tensor]:
    """Weights of a plain model for one with position channels (`in_channels` = out + 3): the extra input
    channels of the patch embedding start at zero, so the widened model computes exactly what the
    plain one did and learns to use the positions from there."""
    key = "patch_embedding.weight"
    want = transformer.patch_embedding.weight.shape              # [dim, in_channels, pt, ph, pw]
    have = state.get(key)
    if have is None or have.shape == want or have.shape[0] != want[0] or have.shape[2:] != want[2:] \
            or have.shape[1] > want[1]:
        return state
    wide = have.new_zeros(want)
    wide[:, :have.shape[1]] = have
    return {**state, key: wide}


def _load_initial_weights(transformer, text_encoder, folder: str) -> None:
    from safetensors.torch import load_file

    for module, sub in ((transformer, "transformer"), (text_encoder, "text_encoder")):
        path = os.path.join(folder, sub, "diffusion_pytorch_model.safetensors")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"init_from={folder!r} has no {sub}/diffusion_pytorch_model.safetensors.")
        state = {k: v.float() for k, v in load_file(path).items()}
        if sub == "transformer":
            state = _widen_patch_embedding(state, module)
        missing, unexpected = module.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"init_from={folder!r}: {sub} weights do not match the model config "
                             f"(missing {missing[:5]}, unexpected {unexpected[:5]}).")


def _choose_size(cfg: TrainConfig, generator: torch.Generator) -> tuple[int, int, int]:
    if not cfg.alt_sizes or float(torch.rand(1, generator=generator)) < cfg.p_default_size:
        return cfg.num_frames, cfg.height, cfg.width
    return cfg.alt_sizes[int(torch.randint(len(cfg.alt_sizes), (1,), generator=generator))]


@torch.no_grad()
def render_samples(pipe: ReferenceVideoPipeline, prompts, num_steps: int, seed: int, size) -> torch.Tensor:
    """Sample clips as uint8 [N, T, H, W, 3] (one noise seed per prompt)."""
    T, H, W = size
    gens = [torch.Generator(device="cpu").manual_seed(seed + i) for i in range(len(prompts))]
    latents = torch.stack([torch.randn(3, T, H, W, generator=g) for g in gens]).to(pipe.transformer.device)
    frames = pipe(list(prompts), num_frames=T, height=H, width=W, num_inference_steps=num_steps,
                  guidance_scale=DEFAULT_GUIDANCE_SCALE, latents=latents, output_type="pt").frames
    return (frames.permute(0, 1, 3, 4, 2).clamp(0, 1) * 255).round().to(torch.uint8).cpu()


def write_sample_grid(frames: torch.Tensor, path: str, cols: int = 2) -> None:
    """Tile clips [N, T, H, W, 3] uint8 into one animated GIF (written to a temp name, then renamed)."""
    import imageio.v3 as iio

    N, T, H, W, C = frames.shape
    rows = math.ceil(N / cols)
    grid = torch.zeros(T, rows * (H + 2), cols * (W + 2), C, dtype=torch.uint8)
    for i in range(N):
        r, c = divmod(i, cols)
        grid[:, r * (H + 2) + 1:r * (H + 2) + 1 + H, c * (W + 2) + 1:c * (W + 2) + 1 + W] = frames[i]
    big = grid.repeat_interleave(3, 1).repeat_interleave(3, 2).numpy()
    tmp = path + ".tmp.gif"
    iio.imwrite(tmp, big, duration=125, loop=0)
    replace_durably(tmp, path)


def export_pipeline(transformer, text_encoder, tokenizer, export_dir: str, dtype: torch.dtype,
                    config: TrainConfig | None = None, stages: list[dict] | None = None) -> str:
    """Write a `ReferenceVideoPipeline` (safetensors) into `export_dir`, replacing it atomically.

    The modules are copied to the CPU in `dtype`; `train_config.json` (and `training_stages.json`, the
    history of the runs that led to these weights, if `stages` is given) are written beside the weights.
    """
    import copy

    from diffusers import FlowMatchEulerDiscreteScheduler

    def cast(module):
        # parameters of the modules diffusers keeps in float32 (norms, time embedding, ...) stay float32
        module = copy.deepcopy(module).to("cpu").eval()
        keep = set(getattr(module, "_keep_in_fp32_modules", None) or ())
        for name, param in module.named_parameters():
            if not keep.intersection(name.split(".")):
                param.data = param.data.to(dtype)
        return module

    tr, te = cast(transformer), cast(text_encoder)
    pipe = ReferenceVideoPipeline(tokenizer=tokenizer, text_encoder=te, transformer=tr,
                                  scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000,
                                                                            shift=config.shift if config else
                                                                            SCHEDULER_SHIFT))
    export_dir = os.path.abspath(export_dir)
    parent = os.path.dirname(export_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = export_dir + ".tmp"
    old = export_dir + ".old"
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp, safe_serialization=True)
    if config is not None:
        config.save(tmp)
    if stages is not None:
        with open(os.path.join(tmp, STAGES_NAME), "w") as f:
            json.dump({"stages": stages}, f, indent=2)
    if os.path.exists(export_dir):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(export_dir, old)
    replace_durably(tmp, export_dir)
    shutil.rmtree(old, ignore_errors=True)
    return export_dir


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run (or resume) training; returns a summary (steps done, last loss, paths).

    Example:
        >>> train(TrainConfig(output_dir="outputs/ref", max_minutes=6.0))       # doctest: +SKIP
    """
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration
    from diffusers.training_utils import EMAModel
    from safetensors.torch import load_file, save_file
    from tqdm.auto import tqdm

    start_time = time.time()
    mp = cfg.mixed_precision
    if mp == "auto":
        mp = "bf16" if torch.cuda.is_available() else "no"
    accelerator = Accelerator(mixed_precision=mp,
                              project_config=ProjectConfiguration(project_dir=cfg.output_dir))
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    device = accelerator.device
    if accelerator.is_main_process:
        os.makedirs(os.path.join(cfg.output_dir, "checkpoints"), exist_ok=True)
        os.makedirs(os.path.join(cfg.output_dir, "samples"), exist_ok=True)
        cfg.save(cfg.output_dir)

    pipe = build_reference_pipeline(seed=cfg.seed, transformer_overrides=cfg.transformer_overrides,
                                    text_overrides=cfg.text_overrides)
    tokenizer, text_encoder, transformer = pipe.tokenizer, pipe.text_encoder, pipe.transformer
    if cfg.init_from:
        _load_initial_weights(transformer, text_encoder, cfg.init_from)
    else:
        # the output layer starts at zero (DiT-style), so the first predictions are 0 and training is smooth
        torch.nn.init.zeros_(transformer.proj_out.weight)
        torch.nn.init.zeros_(transformer.proj_out.bias)
    transformer.train()
    text_encoder.train()
    named = _named_params(transformer, text_encoder)
    params = [p for _, p in named]
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                  betas=(0.9, 0.99), eps=1e-8)
    # a prepared scheduler steps once per process at each optimizer step (accelerate, split_batches=False): the
    # warmup counts in those steps, so that it lasts `warmup_steps` optimizer steps on any number of processes
    warmup = max(1, cfg.warmup_steps) * accelerator.num_processes
    lr_schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    transformer, text_encoder, optimizer, lr_schedule = accelerator.prepare(transformer, text_encoder, optimizer,
                                                                            lr_schedule)
    ema = EMAModel(params, decay=cfg.ema_decay, foreach=True)
    ema.to(device)

    step = 0
    first_step = 0
    stages: list[dict] = []
    if cfg.init_from and os.path.isfile(os.path.join(cfg.init_from, STAGES_NAME)):
        with open(os.path.join(cfg.init_from, STAGES_NAME)) as f:
            stages = list(json.load(f).get("stages", []))
    resume_from = None
    if cfg.resume == "auto":
        resume_from = latest_checkpoint(cfg.output_dir)
    elif cfg.resume != "none":
        resume_from = cfg.resume
    if resume_from is not None:
        accelerator.load_state(resume_from)
        with open(os.path.join(resume_from, STATE_NAME)) as f:
            state = json.load(f)
        step = first_step = int(state["step"])
        ema_state = load_file(os.path.join(resume_from, EMA_NAME))
        for (name, _), shadow in zip(named, ema.shadow_params):
            shadow.copy_(ema_state[name].to(shadow.device, shadow.dtype))
        ema.optimization_step = int(state["ema_optimization_step"])
        logger.info("resumed from %s at step %d", resume_from, step)

    unwrapped_tr = accelerator.unwrap_model(transformer)
    unwrapped_te = accelerator.unwrap_model(text_encoder)

    saved = {os.path.abspath(resume_from)} if resume_from is not None else set()

    def save_checkpoint(at_step: int, loss_value: float) -> str:
        folder = os.path.join(cfg.output_dir, "checkpoints")
        final = os.path.join(folder, f"{CHECKPOINT_PREFIX}{at_step:08d}")
        tmp = os.path.join(folder, f".tmp-{CHECKPOINT_PREFIX}{at_step:08d}")
        if os.path.abspath(final) in saved:     # this state is there already (resumed from, or saved this run):
            return final                        # never delete the only checkpoint to write it again
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        accelerator.wait_for_everyone()
        accelerator.save_state(tmp)
        if accelerator.is_main_process:
            save_file({name: shadow.detach().to("cpu").contiguous()
                       for (name, _), shadow in zip(named, ema.shadow_params)}, os.path.join(tmp, EMA_NAME))
            cfg.save(tmp)
            with open(os.path.join(tmp, STATE_NAME), "w") as f:
                json.dump({"step": at_step, "ema_optimization_step": ema.optimization_step, "loss": loss_value,
                           "time": time.time()}, f)
            if os.path.exists(final):           # another run's checkpoint of this step: moved aside, then dropped
                old = f"{tmp}.old"
                shutil.rmtree(old, ignore_errors=True)
                os.rename(final, old)
                replace_durably(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                replace_durably(tmp, final)
            for stale in _checkpoints(cfg.output_dir)[:-cfg.keep_checkpoints]:
                shutil.rmtree(stale, ignore_errors=True)
        accelerator.wait_for_everyone()
        saved.add(os.path.abspath(final))
        return final

    def with_ema(fn):
        ema.store(params)
        ema.copy_to(params)
        try:
            return fn()
        finally:
            ema.restore(params)

    def sample(at_step: int) -> str | None:
        if not accelerator.is_main_process:
            return None
        unwrapped_tr.eval()
        unwrapped_te.eval()
        spipe = ReferenceVideoPipeline(tokenizer=tokenizer, text_encoder=unwrapped_te, transformer=unwrapped_tr,
                                       scheduler=type(pipe.scheduler).from_config(pipe.scheduler.config,
                                                                                  shift=cfg.shift))   # as exported
        spipe.set_progress_bar_config(disable=True)
        frames = with_ema(lambda: render_samples(spipe, SAMPLE_PROMPTS, cfg.sample_steps, cfg.seed,
                                                 (cfg.num_frames, cfg.height, cfg.width)))
        unwrapped_tr.train()
        unwrapped_te.train()
        path = os.path.join(cfg.output_dir, "samples", f"{CHECKPOINT_PREFIX}{at_step:08d}.gif")
        write_sample_grid(frames, path)
        return path

    log_path = os.path.join(cfg.output_dir, "loss_log.jsonl")
    if accelerator.is_main_process and os.path.isfile(log_path):
        _truncate_log(log_path, step)           # lines a killed run wrote past its last checkpoint
    bar = tqdm(total=cfg.max_steps, initial=step, disable=not accelerator.is_main_process, desc="train")
    running, n_running, last_loss, last_logged = 0.0, 0, float("nan"), None
    stopped_early = False
    while step < cfg.max_steps:
        if cfg.max_minutes is not None and (time.time() - start_time) > cfg.max_minutes * 60.0:
            stopped_early = True
            break
        data_gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 101 + accelerator.process_index)
        T, H, W = _choose_size(cfg, data_gen)
        batch = _batch_for(cfg, (T, H, W))
        video, prompts, twin_of = clip_batch(batch, T, H, W, generator=data_gen, device=device,
                                             p_empty_prompt=cfg.p_empty_prompt, p_directional=cfg.p_directional,
                                             twin_fraction=cfg.twin_fraction, return_twins=True,
                                             travel=cfg.travel)
        noise_gen = torch.Generator(device=device).manual_seed(cfg.seed * 7_000_003 + step * 13
                                                               + accelerator.process_index)
        noise = torch.randn(video.shape, generator=noise_gen, device=device)
        sigmas = sample_sigmas(batch, cfg.shift, cfg.logit_normal_std, noise_gen, device, cfg.logit_normal_mean,
                               cfg.p_high_noise, cfg.high_noise_min)
        noise, sigmas = pair_twins(noise, sigmas, twin_of)
        with accelerator.autocast():
            loss = flow_matching_loss(transformer, text_encoder, tokenizer, video, prompts, sigmas, noise)
        accelerator.backward(loss)
        if accelerator.sync_gradients and cfg.grad_clip > 0:
            accelerator.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        lr_schedule.step()
        optimizer.zero_grad(set_to_none=True)
        ema.step(params)
        step += 1
        last_loss = float(loss.detach())
        running += last_loss
        n_running += 1
        bar.update(1)
        if step % cfg.log_every == 0 or step == cfg.max_steps:
            avg = running / n_running
            bar.set_postfix(loss=f"{avg:.4f}")
            last_logged = {"step": step, "loss": avg, "lr": lr_schedule.get_last_lr()[0],
                           "elapsed_s": round(time.time() - start_time, 1)}
            if accelerator.is_main_process:
                with open(log_path, "a") as f:
                    f.write(json.dumps(last_logged) + "\n")
            running, n_running = 0.0, 0
        if step % cfg.checkpoint_every == 0 and step < cfg.max_steps:
            save_checkpoint(step, last_loss)
            sample(step)
    bar.close()

    ckpt = save_checkpoint(step, last_loss)
    sample_path = sample(step)
    export_dir = cfg.export_dir or os.path.join(cfg.output_dir, "export")
    if accelerator.is_main_process:
        dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[cfg.export_dtype]
        stage = {"stage": len(stages) + 1, "steps": step - first_step, "step_reached": step,
                 "train_seconds": round(time.time() - start_time, 1), "last_logged": last_logged,
                 "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                 "mixed_precision": mp, "config": cfg.to_dict()}
        with_ema(lambda: export_pipeline(unwrapped_tr, unwrapped_te, tokenizer, export_dir, dtype, cfg,
                                         stages + [stage]))
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return {"step": step, "loss": last_loss, "checkpoint": ckpt, "export_dir": export_dir, "sample": sample_path,
            "stopped_early": stopped_early, "elapsed_s": time.time() - start_time}
