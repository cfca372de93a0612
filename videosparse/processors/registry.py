"""Per-model facts, registered by transformer class, and the method registry keyed by config type."""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from ..config import DenseConfig, SolConfig, VedaConfig
from ..method import ModelInfo


@dataclass(frozen=True)
class ModelSpec:
    """How videosparse serves one transformer class.

    Attributes:
        processor_cls: the sparse processor class (a subclass of the stock processor), or a callable
            (session, layer, original processor) -> sparse processor where the layers of one model use several
            stock classes (LTX-2: plain or perturbed, chosen by the original's class).
        is_self_attention: (module name, attention module) -> True for the layers to sparsify.
        grid_fn: (transformer, forward args, kwargs) -> ((T, H, W), text_len[, reason the forward must run dense]);
            text_len: the tokens beside the video (text, history, conditions), an int, or a `grids.PaddedText`
            where the model masks a padded tail of them per item. The helpers the families share are in `grids`.
        text_position: where joint-attention text sits ("before"/"after"), None without joint text.
        attention_shape: config -> (heads, head dim) of the served layers, for configs without
            `num_attention_heads` / `attention_head_dim` (Kandinsky 5); None reads those two keys.
        step_timestep: (transformer, forward args, kwargs) -> the timestep of the generated video, which counts the
            denoising steps where no scheduler says the step; None takes the forward's `timestep` (its noisiest
            entry). MiniMax-H3 passes the distinct timesteps of all its rows, conditions pinned near the clean end.
        timestep_direction: -1 where that timestep falls through the denoising loop of every pipeline of the class,
            +1 where it rises (Mochi), 0 (default) where it is not known: a step counted by timestep then takes the
            direction of the calls that ended normally. It tells a new call from the next step of one whose single
            earlier timestep (a warm-up forward, a call that died after its first step) is the only one seen.
    """

    processor_cls: type | Callable
    is_self_attention: Callable[[str, torch.nn.Module], bool]
    grid_fn: Callable
    text_position: str | None = None
    attention_shape: Callable | None = None
    step_timestep: Callable | None = None
    timestep_direction: int = 0


_MODEL_SPECS: dict[type, Callable[[], ModelSpec]] = {}
_BUILTINS_LOADED = [False]
_BUILTINS_LOADING = [False]        # inside `_register_builtin_models` (its own `register_model` calls)
_BUILTINS_LOCK = threading.RLock()


def _load_builtins() -> None:
    """Register the built-in models once (again on the next call if their import failed; another thread waits for a
    load in progress); an entry registered before (a user's) keeps its place over them."""
    if _BUILTINS_LOADED[0]:
        return
    with _BUILTINS_LOCK:
        if _BUILTINS_LOADED[0] or _BUILTINS_LOADING[0]:
            return
        _BUILTINS_LOADING[0] = True
        try:
            user = dict(_MODEL_SPECS)
            _register_builtin_models()
            _MODEL_SPECS.update(user)
            _BUILTINS_LOADED[0] = True
        finally:
            _BUILTINS_LOADING[0] = False


def register_model(transformer_cls: type, spec_factory: Callable[[], ModelSpec]) -> None:
    """Register the `ModelSpec` factory of a transformer class (subclasses inherit it; it replaces a built-in
    entry of the same class)."""
    _load_builtins()
    _MODEL_SPECS[transformer_cls] = spec_factory


def block_layer(prefixes: str | tuple[str, ...], leaf: str = "attn1") -> Callable[[str, torch.nn.Module], bool]:
    """Layer filter: True for the modules under `prefixes` (one, or a tuple of them) whose name ends in `.<leaf>`
    exactly (`<prefix><i>.attn1`, not `audio_attn1`, not a face adapter's or other attention): the blocks' video
    self-attention in models with several attention kinds per block."""
    return lambda name, module: name.startswith(prefixes) and name.rsplit(".", 1)[-1] == leaf


def _register_builtin_models() -> None:
    from diffusers import (
        AllegroTransformer3DModel,
        AnyFlowTransformer3DModel,
        ChronoEditTransformer3DModel,
        CogVideoXTransformer3DModel,
        ConsisIDTransformer3DModel,
        Cosmos3OmniTransformer,
        CosmosTransformer3DModel,
        EasyAnimateTransformer3DModel,
        HeliosTransformer3DModel,
        HunyuanVideo15Transformer3DModel,
        HunyuanVideoFramepackTransformer3DModel,
        HunyuanVideoTransformer3DModel,
        Kandinsky5Transformer3DModel,
        Kandinsky6Transformer3DModel,
        LTX2VideoTransformer3DModel,
        LTXVideoTransformer3DModel,
        MiniMaxH3Transformer3DModel,
        MochiTransformer3DModel,
        MotifVideoTransformer3DModel,
        SkyReelsV2Transformer3DModel,
        WanAnimate2Transformer3DModel,
        WanAnimateTransformer3DModel,
        WanTransformer3DModel,
        WanVACETransformer3DModel,
    )

    # The timestep step counting compares (`step_timestep`, else the forward's `timestep`, its largest entry) falls
    # through each denoising loop of every diffusers 0.42.1 pipeline (modular ones included) of the classes set to -1
    # below: noisiest first, flow matching (Euler, UniPC, DPM, flow-map, Helios, Piflow) or the DDIM / DPM / Karras /
    # EDM schedulers their pipelines take; conditioning tokens or frames held at a lower timestep never raise the
    # largest entry, at most holding it (a tie is no move: Heun's repeats, Cosmos 2.5's conditioning floor at the end;
    # Helios's pyramid stages go on down). A scheduler set to run the other way (FlowMatch `invert_sigmas` outside
    # Mochi, Cosmos 2 without its Karras sigmas) feeds the model the wrong noise levels. Multi-loop pipelines
    # (FramePack sections, Animate segments, long-video windows and chunks) start each loop again from the top, as a
    # new call. It rises for Mochi (its published scheduler inverts the sigmas) and MiniMax-H3 (t = 1 - sigma).
    TIMESTEPS_FALL, TIMESTEPS_RISE = -1, 1

    def wan_spec() -> ModelSpec:
        # Wan 2.1 / 2.2 and VACE (whose vace_blocks' attn1 are self-attention over the same grid too)
        from .wan import WanSparseAttnProcessor, wan_grid

        return ModelSpec(WanSparseAttnProcessor, lambda name, m: name.endswith("attn1"), wan_grid,
                         timestep_direction=TIMESTEPS_FALL)

    register_model(WanTransformer3DModel, wan_spec)
    register_model(WanVACETransformer3DModel, wan_spec)

    def skyreels_v2_spec() -> ModelSpec:
        from .wan import SkyReelsV2SparseAttnProcessor, wan_grid

        return ModelSpec(SkyReelsV2SparseAttnProcessor, lambda name, m: name.endswith("attn1"), wan_grid,
                         timestep_direction=TIMESTEPS_FALL)

    register_model(SkyReelsV2Transformer3DModel, skyreels_v2_spec)

    def wan_animate_spec() -> ModelSpec:
        from .wan import WanAnimateSparseAttnProcessor, wan_grid

        # blocks.<i>.attn1 only: attn2 (text / image cross-attention) and the face adapter's cross-attention to the
        # motion tokens (face_adapter.<j>, WanAnimateFaceBlockAttnProcessor) keep their stock processors
        return ModelSpec(WanAnimateSparseAttnProcessor, block_layer("blocks."), wan_grid,
                         timestep_direction=TIMESTEPS_FALL)

    register_model(WanAnimateTransformer3DModel, wan_animate_spec)

    def wan_animate2_spec() -> ModelSpec:
        from .wan import WanAnimate2SparseAttnProcessor, wan_animate2_attention_shape, wan_animate2_grid

        # blocks.<i>.self_attn, both passes (extraction; generation with the per-frame reference keys added densely);
        # cross_attn (text + CLIP image) keeps its stock processor
        # (its modular pipelines: each segment's extraction pass at the segment's first timestep, then its loop)
        return ModelSpec(WanAnimate2SparseAttnProcessor, block_layer("blocks.", "self_attn"),
                         wan_animate2_grid, attention_shape=wan_animate2_attention_shape,
                         timestep_direction=TIMESTEPS_FALL)

    register_model(WanAnimate2Transformer3DModel, wan_animate2_spec)

    def chronoedit_spec() -> ModelSpec:
        from .wan import ChronoEditSparseAttnProcessor, wan_grid

        # blocks.<i>.attn1 only: attn2 (text + CLIP image context) keeps its stock processor
        return ModelSpec(ChronoEditSparseAttnProcessor, block_layer("blocks."), wan_grid,
                         timestep_direction=TIMESTEPS_FALL)

    register_model(ChronoEditTransformer3DModel, chronoedit_spec)

    def anyflow_spec() -> ModelSpec:
        from .wan import AnyFlowSparseAttnProcessor, anyflow_grid

        # blocks.<i>.attn1 (AnyFlowAttnProcessor, unmasked) only: attn2 (AnyFlowCrossAttnProcessor) stays stock. The
        # FAR causal model (AnyFlowFARTransformer3DModel, not a subclass) is not registered
        return ModelSpec(AnyFlowSparseAttnProcessor, block_layer("blocks."), anyflow_grid,
                         timestep_direction=TIMESTEPS_FALL)

    register_model(AnyFlowTransformer3DModel, anyflow_spec)

    def hunyuan_spec() -> ModelSpec:
        from .hunyuan import HunyuanVideoSparseAttnProcessor, hunyuan_grid

        # dual-stream and single-stream blocks; the token refiner (context_embedder) stays stock
        return ModelSpec(HunyuanVideoSparseAttnProcessor,
                         lambda name, m: name.startswith(("transformer_blocks.", "single_transformer_blocks.")),
                         hunyuan_grid, text_position="after", timestep_direction=TIMESTEPS_FALL)

    register_model(HunyuanVideoTransformer3DModel, hunyuan_spec)

    def hunyuan15_spec() -> ModelSpec:
        from .hunyuan import HunyuanVideo15SparseAttnProcessor, hunyuan15_grid

        # dual-stream blocks only; the token refiner (context_embedder) stays stock
        return ModelSpec(HunyuanVideo15SparseAttnProcessor, lambda name, m: name.startswith("transformer_blocks."),
                         hunyuan15_grid, text_position="after", timestep_direction=TIMESTEPS_FALL)

    register_model(HunyuanVideo15Transformer3DModel, hunyuan15_spec)

    def hunyuan_framepack_spec() -> ModelSpec:
        from .hunyuan import HunyuanVideoFramepackSparseAttnProcessor, hunyuan_framepack_grid

        # HunyuanVideo's blocks (dual- and single-stream) over [history; video; image; text]; the history, image and
        # text tokens are served as global tiles after the video; the token refiner stays stock
        return ModelSpec(HunyuanVideoFramepackSparseAttnProcessor,
                         lambda name, m: name.startswith(("transformer_blocks.", "single_transformer_blocks.")),
                         hunyuan_framepack_grid, text_position="after", timestep_direction=TIMESTEPS_FALL)

    register_model(HunyuanVideoFramepackTransformer3DModel, hunyuan_framepack_spec)

    def cogvideox_spec() -> ModelSpec:
        from .cogvideox import CogVideoXSparseAttnProcessor, cogvideox_grid

        return ModelSpec(CogVideoXSparseAttnProcessor, lambda name, m: name.endswith("attn1"), cogvideox_grid,
                         text_position="before", timestep_direction=TIMESTEPS_FALL)

    register_model(CogVideoXTransformer3DModel, cogvideox_spec)

    def ltx_spec() -> ModelSpec:
        from .ltx import LTXVideoSparseAttnProcessor, ltx_grid

        # attn1: video self-attention; attn2 (cross-attention to the text) stays stock
        # condition tokens that LTXConditionPipeline puts before the video are served like joint text before it
        return ModelSpec(LTXVideoSparseAttnProcessor, lambda name, m: name.endswith("attn1"), ltx_grid,
                         text_position="before", timestep_direction=TIMESTEPS_FALL)

    register_model(LTXVideoTransformer3DModel, ltx_spec)

    def ltx2_spec() -> ModelSpec:
        from .ltx2 import ltx2_grid, ltx2_sparse_processor

        # transformer_blocks.<i>.attn1 (video self-attention) only: audio_attn1 and the text / audio <-> video
        # cross-attentions keep their stock processors. Condition tokens appended after the video (keyframes) are
        # served like joint text after it
        return ModelSpec(ltx2_sparse_processor, block_layer("transformer_blocks."), ltx2_grid, text_position="after",
                         timestep_direction=TIMESTEPS_FALL)

    register_model(LTX2VideoTransformer3DModel, ltx2_spec)

    def mochi_spec() -> ModelSpec:
        from .mochi import MochiSparseAttnProcessor, mochi_grid

        # attn1 of every block: joint [video; text] attention (MochiAttention), text after the video
        return ModelSpec(MochiSparseAttnProcessor, lambda name, m: name.endswith("attn1"), mochi_grid,
                         text_position="after", timestep_direction=TIMESTEPS_RISE)

    register_model(MochiTransformer3DModel, mochi_spec)

    def cosmos_spec() -> ModelSpec:
        from .cosmos import CosmosSparseAttnProcessor, cosmos_grid

        # transformer_blocks.<i>.attn1 (video self-attention, CosmosAttnProcessor2_0 in every config) only: attn2, the
        # cross-attention to the text (and to the image context of Transfer2.5), keeps its stock processor
        # (its pipelines pass EDM's c_noise, sigma / (sigma + 1) or sigma, all falling with sigma; Anima's t / 1000)
        return ModelSpec(CosmosSparseAttnProcessor, block_layer("transformer_blocks."), cosmos_grid,
                         timestep_direction=TIMESTEPS_FALL)

    register_model(CosmosTransformer3DModel, cosmos_spec)

    def kandinsky5_spec() -> ModelSpec:
        from .kandinsky import Kandinsky5SparseAttnProcessor, kandinsky_attention_shape, kandinsky_grid

        # visual_transformer_blocks.<i>.self_attention (visual tokens only) only: the text refiner's self-attention
        # (text_transformer_blocks) and the visual blocks' cross_attention to the text keep their stock processors
        return ModelSpec(Kandinsky5SparseAttnProcessor, block_layer("visual_transformer_blocks.", "self_attention"),
                         kandinsky_grid, attention_shape=kandinsky_attention_shape, timestep_direction=TIMESTEPS_FALL)

    register_model(Kandinsky5Transformer3DModel, kandinsky5_spec)

    def helios_spec() -> ModelSpec:
        from .helios import HeliosSparseAttnProcessor, helios_grid

        # blocks.<i>.attn1 over [long; mid; short history; video]: the history tokens are served like joint text
        # before the video (global tiles); attn2 (cross-attention to the text) keeps its stock processor
        return ModelSpec(HeliosSparseAttnProcessor, block_layer("blocks."), helios_grid, text_position="before",
                         timestep_direction=TIMESTEPS_FALL)

    register_model(HeliosTransformer3DModel, helios_spec)

    def motif_video_spec() -> ModelSpec:
        from .motif import MotifVideoSparseAttnProcessor, motif_grid

        # the dual- and single-stream blocks' joint attention `attn` over [video; image; text]; their text
        # cross-attention (`cross_attn`) keeps its stock processor, and so do the DDT decoder blocks' calls
        return ModelSpec(MotifVideoSparseAttnProcessor,
                         block_layer(("transformer_blocks.", "single_transformer_blocks."), "attn"),
                         motif_grid, text_position="after", timestep_direction=TIMESTEPS_FALL)

    register_model(MotifVideoTransformer3DModel, motif_video_spec)

    def kandinsky6_spec() -> ModelSpec:
        from .kandinsky import Kandinsky6SparseAttnProcessor, kandinsky_attention_shape, kandinsky_grid

        # visual_transformer_blocks.<i>.video_dec_block.self_attention (video tokens only) only: the audio
        # self-attention, the text cross-attentions, the video <-> audio cross-attentions (va_ / av_cross_attention)
        # and both text refiners keep their stock processors
        return ModelSpec(Kandinsky6SparseAttnProcessor,
                         lambda name, m: name.startswith("visual_transformer_blocks.")
                         and name.endswith(".video_dec_block.self_attention"),
                         kandinsky_grid, attention_shape=kandinsky_attention_shape, timestep_direction=TIMESTEPS_FALL)

    register_model(Kandinsky6Transformer3DModel, kandinsky6_spec)

    def easyanimate_spec() -> ModelSpec:
        from .easyanimate import EasyAnimateSparseAttnProcessor, easyanimate_grid

        # transformer_blocks.<i>.attn1, the blocks' only attention: joint [text; video], text first (global tiles)
        return ModelSpec(EasyAnimateSparseAttnProcessor, block_layer("transformer_blocks."), easyanimate_grid,
                         text_position="before", timestep_direction=TIMESTEPS_FALL)

    register_model(EasyAnimateTransformer3DModel, easyanimate_spec)

    def consisid_spec() -> ModelSpec:
        from .cogvideox import CogVideoXSparseAttnProcessor, cogvideox_grid

        # CogVideoX's blocks: transformer_blocks.<i>.attn1, joint [text; video], text first (global tiles). The local
        # facial extractor and the perceiver cross-attention to the face tokens are plain modules with no processor
        return ModelSpec(CogVideoXSparseAttnProcessor, block_layer("transformer_blocks."), cogvideox_grid,
                         text_position="before", timestep_direction=TIMESTEPS_FALL)

    register_model(ConsisIDTransformer3DModel, consisid_spec)

    def allegro_spec() -> ModelSpec:
        from .allegro import AllegroSparseAttnProcessor, allegro_grid

        # transformer_blocks.<i>.attn1 (video self-attention, 3D RoPE) only: attn2, the same stock class as
        # cross-attention to the T5 text with its key mask, keeps its stock processor
        return ModelSpec(AllegroSparseAttnProcessor, block_layer("transformer_blocks."), allegro_grid,
                         timestep_direction=TIMESTEPS_FALL)

    register_model(AllegroTransformer3DModel, allegro_spec)

    def minimax_h3_spec() -> ModelSpec:
        from .minimax import MiniMaxH3SparseAttnProcessor, minimax_grid, minimax_video_timestep

        # transformer_blocks.<i>.attn: full self-attention over the packed [text | conditions | audio | video]
        # sequence, the generated video last; the rows before it are served as global tiles before the video. The
        # token refiner's text-only attn (token_refiner.refiner_blocks.<j>.attn) keeps its stock processor
        return ModelSpec(MiniMaxH3SparseAttnProcessor, block_layer("transformer_blocks.", "attn"),
                         minimax_grid, text_position="before", step_timestep=minimax_video_timestep,
                         timestep_direction=TIMESTEPS_RISE)

    register_model(MiniMaxH3Transformer3DModel, minimax_h3_spec)

    def cosmos3_spec() -> ModelSpec:
        from .cosmos3 import Cosmos3SparseAttnProcessor, cosmos3_attention_shape, cosmos3_grid

        # layers.<i>.self_attn (Cosmos3PackedMoTAttention): its generation pathway (the video grid, then sound and
        # action rows, over the understanding keys and their own) is served; the causal text pathway stays stock
        # timestep_direction 0: the forward takes no `timestep` (per-modality vision / sound / action timesteps) and
        # no step_timestep reads them, so no step of it is counted by timestep (its pipelines give the step index)
        return ModelSpec(Cosmos3SparseAttnProcessor, block_layer("layers.", "self_attn"),
                         cosmos3_grid, text_position="after", attention_shape=cosmos3_attention_shape)

    register_model(Cosmos3OmniTransformer, cosmos3_spec)


def model_spec(transformer: torch.nn.Module) -> ModelSpec:
    _load_builtins()
    for cls in type(transformer).__mro__:
        if cls in _MODEL_SPECS:
            return _MODEL_SPECS[cls]()
    name = type(transformer).__name__
    if isinstance(getattr(transformer, "components", None), dict) or hasattr(transformer, "transformer"):
        raise ValueError(f"{name} is a pipeline, not a transformer; pass pipe.transformer (e.g. "
                         "videosparse.processors(pipe.transformer, config)) or use videosparse.apply(pipe, config), "
                         "which serves every transformer of the pipeline.")
    supported = ", ".join(sorted(c.__name__ for c in _MODEL_SPECS))
    raise ValueError(f"transformer class {name} is not supported; supported: {supported}.")


def patch_size_of(cfg) -> tuple[int, int, int]:
    """(pt, ph, pw) from a config's `patch_size` (3-tuple, 2-tuple, or int with `patch_size_t`), or its spatial
    `latent_patch_size` (Cosmos 3)."""
    p = cfg.patch_size if hasattr(cfg, "patch_size") else int(cfg.latent_patch_size)
    if isinstance(p, int):
        return (int(getattr(cfg, "patch_size_t", None) or 1), p, p)
    p = tuple(int(v) for v in p)
    return p if len(p) == 3 else (1, *p)


def model_info(transformer: torch.nn.Module, spec: ModelSpec, num_layers: int) -> ModelInfo:
    cfg = transformer.config
    if spec.attention_shape is not None:
        heads, head_dim = spec.attention_shape(cfg)
    else:
        heads, head_dim = int(cfg.num_attention_heads), int(cfg.attention_head_dim)
    patch = patch_size_of(cfg)
    return ModelInfo(type(transformer).__name__, num_layers, heads, head_dim, patch, spec.text_position)


# config type -> "module:class" of its SparseMethod (None = dense, no method)
METHODS: dict[type, str | None] = {
    DenseConfig: None,
    VedaConfig: "videosparse.veda.method:VedaMethod",
    SolConfig: "videosparse.sol.method:SolMethod",
}


def check_config(config) -> str | None:
    """The "module:class" of the config's method (None for dense); TypeError for a non-config."""
    for cls in type(config).__mro__:
        if cls in METHODS:
            return METHODS[cls]
    if isinstance(config, type) and any(issubclass(config, c) for c in METHODS):
        raise TypeError(f"config is the class {config.__name__}; pass an instance, e.g. {config.__name__}().")
    raise TypeError(
        f"config of type {type(config).__name__} is not a videosparse config; use one of "
        f"{', '.join(c.__name__ for c in METHODS)}."
    )


def make_method(config, info: ModelInfo):
    """The `SparseMethod` instance for `config` (None for `DenseConfig`)."""
    target = check_config(config)
    if target is None:
        return None
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)(config, info)
