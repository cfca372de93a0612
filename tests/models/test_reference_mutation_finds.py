"""Mutation finds of session 65 on the reference model: the procedural data, the tokenizer and text encoder, the
training helpers and config, the training script's options, and the pipeline's argument checks (small and fast:
no training run)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from helpers import TINY_REFERENCE, TINY_REFERENCE_TEXT, tiny_reference_pipeline

from videosparse.models import reference as ref
from videosparse.models.reference_data import (
    DIRECTIONS,
    ClipSpec,
    check_travel,
    clip_batch,
    parse_prompt,
    render_clips,
    reversed_twin,
)
from videosparse.models.reference_text import ReferenceTextEncoder, build_reference_tokenizer
from videosparse.models.reference_train import (
    TrainConfig,
    _batch_for,
    _checkpoints,
    _choose_size,
    export_pipeline,
    flow_matching_loss,
    latest_checkpoint,
)

CALL = dict(num_frames=4, height=16, width=16, num_inference_steps=1, output_type="latent")


@pytest.fixture(scope="module")
def pipe():
    p = tiny_reference_pipeline()
    p.set_progress_bar_config(disable=True)
    return p


# ----------------------------------------------------------------------------------------- data
def test_parse_prompt_reads_any_case():
    # Mutation find: parse_prompt matched the vocabulary case-sensitively ("A Red Circle ..." named no colour)
    assert parse_prompt("A Red Circle Moving Left On A Dark Background") == ClipSpec("red", "circle", "left", "dark")
    assert parse_prompt("Large BLUE square growing, LIGHT background") == ClipSpec("blue", "square", "growing",
                                                                                    "light", "large", 1)


def test_travel_takes_exactly_two_values():
    # Mutation find: check_travel's length check dropped (three values passed as (shortest, longest))
    for bad in ((0.3, 0.6, 0.9), (0.3,)):
        with pytest.raises(ValueError, match="must be \\(shortest, longest\\)"):
            check_travel(bad)
    assert check_travel([0.3, 0.6]) == (0.3, 0.6)


def test_render_clips_refuses_too_small_clips_and_no_specs():
    # Mutation find: the renderer's bounds (2 frames, 8 x 8 pixels) and its empty-list check
    spec = [ClipSpec("red", "circle", "left", "dark")]
    for size in ((1, 16, 16), (4, 16, 4), (4, 4, 16)):
        with pytest.raises(ValueError, match="too small"):
            render_clips(spec, *size)
    with pytest.raises(ValueError, match="at least one ClipSpec"):
        render_clips([], 4, 16, 16)
    assert render_clips(spec, 2, 8, 8).shape == (1, 3, 2, 8, 8)


def test_reversed_twin_keeps_size_and_template():
    # Mutation find: reversed_twin dropped the template (the twin's prompt took another wording)
    spec = ClipSpec("blue", "ring", "up", "gray", "small", 1)
    assert reversed_twin(spec) == ClipSpec("blue", "ring", "down", "gray", "small", 1)
    assert reversed_twin(spec).prompt == "small blue ring moving down, gray background"


def test_clip_batch_twins_share_the_empty_prompt_draw_and_have_directional_sources():
    # Mutation find: twins drew their own empty prompt; twin sources drawn with the batch's p_directional
    video, prompts, twin_of = clip_batch(16, 2, 8, 8, generator=torch.Generator().manual_seed(1), p_empty_prompt=0.5,
                                         p_directional=0.0, twin_fraction=1.0, return_twins=True)
    assert twin_of.tolist() == [-1] * 8 + list(range(8))
    assert [p == "" for p in prompts[:8]] == [p == "" for p in prompts[8:]]
    assert 0 < sum(p == "" for p in prompts[:8]) < 8
    for src, twin in zip(prompts[:8], prompts[8:]):
        if src:
            assert parse_prompt(src).motion in DIRECTIONS and parse_prompt(twin) == reversed_twin(parse_prompt(src))


def test_clip_batch_refuses_twin_fractions_outside_0_1():
    # Mutation find: clip_batch's lower bound of twin_fraction dropped (a negative share was taken)
    for bad in (-0.5, 1.5):
        with pytest.raises(ValueError, match="twin_fraction"):
            clip_batch(4, 2, 8, 8, twin_fraction=bad)


# ----------------------------------------------------------------------------------------- text
def test_tokenizer_pads_on_the_right_with_pad_id_0_and_unk_id_1():
    # Mutation find: padding on the left, or [PAD] / [UNK] ids swapped, passed the tokenizer test
    tok = build_reference_tokenizer()
    assert (tok.pad_token_id, tok.unk_token_id) == (0, 1)
    enc = tok(["a red circle"], padding="max_length", max_length=6, add_special_tokens=False)
    assert enc.attention_mask[0] == [1, 1, 1, 0, 0, 0] and enc.input_ids[0][3:] == [0, 0, 0]


def test_text_encoder_refuses_long_inputs_and_keeps_an_empty_prompt_finite():
    # Mutation find: the length check let L = max_length + 1 through; a fully padded row gave NaN in the layers
    te = ReferenceTextEncoder(vocab_size=40, dim=16, num_layers=1, num_heads=2, ffn_dim=32, max_length=4).train()
    with pytest.raises(ValueError, match="more than max_length=4"):
        te(torch.zeros(1, 5, dtype=torch.long))
    mask = torch.tensor([[0, 0, 0, 0], [1, 1, 0, 0]])
    out = te(torch.tensor([[0, 0, 0, 0], [3, 4, 0, 0]]), mask).last_hidden_state
    assert out.shape == (2, 4, 16) and torch.isfinite(out).all()


def test_encode_text_zeroes_padding_so_an_empty_prompt_is_all_zeros(pipe):
    # Mutation find: encode_text returned the padding positions' embeddings (the unconditional embedding not zero)
    emb = ref.encode_text(pipe.tokenizer, pipe.text_encoder, ["", "a red circle"], "cpu")
    assert not emb[0].any() and not emb[1, 3:].any() and emb[1, :3].abs().sum(-1).gt(0).all()


# ------------------------------------------------------------------------------------- training
def test_train_config_refuses_values_that_fail_later():
    # Mutation find: bounds of TrainConfig (counts >= 1, keep_checkpoints, p_empty_prompt < 1, twin_fraction >= 0,
    # high_noise_min < 1, ema_decay < 1, a bool learning rate, a size of four values) and unknown fields
    for kwargs, match in ((dict(max_steps=0), "max_steps=0"), (dict(batch_size=0), "batch_size=0"),
                          (dict(keep_checkpoints=0), "keep_checkpoints=0"), (dict(p_empty_prompt=1.0), "p_empty_prompt"),
                          (dict(twin_fraction=-0.1), "twin_fraction"), (dict(high_noise_min=1.0), "high_noise_min"),
                          (dict(ema_decay=1.0), "ema_decay=1.0"), (dict(learning_rate=True), "learning_rate=True"),
                          (dict(alt_sizes=((4, 16, 16, 2),)), r"alt_sizes\[0\]=\(4, 16, 16, 2\) must be three")):
        with pytest.raises(ValueError, match=match):
            TrainConfig(**kwargs)
    with pytest.raises(ValueError, match="unknown TrainConfig fields \\['bach_size'\\]"):
        TrainConfig.from_dict({"bach_size": 4})


def test_train_config_reads_none_overrides_as_none_given():
    # Mutation find: transformer_overrides / text_overrides of None (`--text-overrides null`) were refused
    cfg = TrainConfig(transformer_overrides=None, text_overrides=None)
    assert cfg.transformer_overrides == {} and cfg.text_overrides == {}


class _Stub:
    """A transformer that records its inputs and predicts a given tensor."""

    config = SimpleNamespace(in_channels=3, out_channels=3)

    def __init__(self, pred):
        self.pred, self.seen = pred, {}

    def __call__(self, hidden_states, timestep, encoder_hidden_states, return_dict):
        self.seen.update(hidden_states=hidden_states, timestep=timestep)
        return (self.pred,)


def test_flow_matching_loss_inputs_and_target():
    # Mutation find: the noisy clip's mix, the timestep scale (sigma * 1000) and the velocity's sign
    tok = build_reference_tokenizer()
    te = ReferenceTextEncoder(vocab_size=len(tok), dim=16, num_layers=0)
    g = torch.Generator().manual_seed(0)
    video, noise = torch.rand(2, 3, 2, 8, 8, generator=g), torch.randn(2, 3, 2, 8, 8, generator=g)
    sigmas = torch.tensor([0.25, 0.75])
    stub = _Stub(noise - video)
    loss = flow_matching_loss(stub, te, tok, video, ["a red circle", ""], sigmas, noise)
    assert float(loss) == 0.0
    s = sigmas.view(-1, 1, 1, 1, 1)
    torch.testing.assert_close(stub.seen["hidden_states"], (1 - s) * video + s * noise)
    torch.testing.assert_close(stub.seen["timestep"], torch.tensor([250.0, 750.0]))


def test_checkpoints_are_complete_step_folders_in_step_order(tmp_path):
    # Mutation find: a step folder without trainer_state.json (a copy cut short) was taken as the latest checkpoint
    folder = tmp_path / "checkpoints"
    for name, complete in (("step-00000009", True), ("step-00000010", True), ("step-00000011", False),
                           (".tmp-step-00000012", True)):
        (folder / name).mkdir(parents=True)
        if complete:
            (folder / name / "trainer_state.json").write_text("{}")
    assert [os.path.basename(p) for p in _checkpoints(str(tmp_path))] == ["step-00000009", "step-00000010"]
    assert latest_checkpoint(str(tmp_path)).endswith("step-00000010")
    assert latest_checkpoint(str(tmp_path / "none")) is None


def test_batch_scaling_and_size_choice():
    # Mutation find: scale_batch_by_tokens inverted, the max_batch_size cap dropped, p_default_size's comparison flipped
    cfg = TrainConfig(batch_size=4, max_batch_size=10, alt_sizes=((16, 32, 32),))
    assert _batch_for(cfg, (16, 64, 64)) == 4 and _batch_for(cfg, (16, 32, 32)) == 10
    assert _batch_for(TrainConfig(batch_size=4, max_batch_size=64), (16, 32, 32)) == 16
    assert _batch_for(TrainConfig(batch_size=4, scale_batch_by_tokens=False), (16, 32, 32)) == 4
    g = torch.Generator().manual_seed(0)
    main = TrainConfig(p_default_size=1.0, alt_sizes=((16, 32, 32),))
    alt = TrainConfig(p_default_size=0.0, alt_sizes=((16, 32, 32),))
    assert {_choose_size(main, g) for _ in range(20)} == {(16, 64, 64)}
    assert {_choose_size(alt, g) for _ in range(20)} == {(16, 32, 32)}


def test_export_keeps_float32_modules_and_the_run_shift(pipe, tmp_path):
    # Mutation find: every exported parameter was cast (norms too), and the scheduler took the default shift
    from safetensors.torch import load_file

    out = export_pipeline(pipe.transformer, pipe.text_encoder, pipe.tokenizer, str(tmp_path / "exp"), torch.float16,
                          TrainConfig(shift=3.0), stages=[{"stage": 1}])
    with open(os.path.join(out, "scheduler", "scheduler_config.json")) as f:
        assert json.load(f)["shift"] == 3.0
    weights = load_file(os.path.join(out, "transformer", "diffusion_pytorch_model.safetensors"))
    assert weights["scale_shift_table"].dtype == weights["blocks.0.norm2.weight"].dtype == torch.float32
    assert weights["patch_embedding.weight"].dtype == torch.float16
    assert pipe.transformer.patch_embedding.weight.dtype == torch.float32          # the live model is not cast
    with open(os.path.join(out, "training_stages.json")) as f:
        assert json.load(f) == {"stages": [{"stage": 1}]}


def test_warmup_starts_at_one_step_of_the_ramp(tmp_path):
    # Mutation find: the warmup ramp counted from 0 (the first optimizer step at learning rate 0, one step late after)
    from videosparse.models.reference_train import train

    train(TrainConfig(output_dir=str(tmp_path), max_steps=1, warmup_steps=4, learning_rate=1e-3, batch_size=1,
                      max_batch_size=1, num_frames=2, height=8, width=8, alt_sizes=None, log_every=1,
                      checkpoint_every=10, sample_steps=1, transformer_overrides=TINY_REFERENCE,
                      text_overrides=TINY_REFERENCE_TEXT))
    with open(tmp_path / "loss_log.jsonl") as f:
        assert json.loads(f.readline())["lr"] == pytest.approx(5e-4)       # after step 1: min(1, (1 + 1) / 4) * lr


# ------------------------------------------------------------------------------------- script
def test_training_script_none_in_any_case_and_a_config_file(tmp_path):
    # Mutation find: "None" / "NULL" were parsed as numbers; a --config file's path was passed on as a field
    from helpers import load_script

    script = load_script("train_reference_model")
    assert script.config_from_args(["--p-directional", "None"]).p_directional is None
    assert script.config_from_args(["--max-minutes", "NULL"]).max_minutes is None
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"batch_size": 4, "seed": 3}))
    cfg = script.config_from_args(["--config", str(path), "--seed", "5"])
    assert (cfg.batch_size, cfg.seed) == (4, 5)


# ------------------------------------------------------------------------------------- pipeline
def test_pipeline_refuses_bad_argument_combinations(pipe):
    # Mutation find: the pipeline's checks of num_frames >= 1, prompt vs prompt_embeds, the callback's tensor names,
    # max_sequence_length >= 1 and the negative prompts' count
    emb = ref.encode_text(pipe.tokenizer, pipe.text_encoder, ["a red circle"], "cpu")
    for kwargs, match in ((dict(prompt="a red circle", num_frames=0), "num_frames=0"),
                          (dict(prompt="a red circle", prompt_embeds=emb), "not both"),
                          (dict(), "Provide either"),
                          (dict(prompt="a red circle", callback_on_step_end_tensor_inputs=["latents", "noise"]),
                           "callback_on_step_end_tensor_inputs must be among"),
                          (dict(prompt="a red circle", max_sequence_length=0), "max_sequence_length=0"),
                          (dict(prompt="a red circle", negative_prompt=["", ""]), "negative_prompt has batch size 2")):
        with pytest.raises(ValueError, match=match):
            pipe(**{**CALL, **kwargs})


def test_guidance_scale_one_runs_no_unconditional_branch(pipe):
    # Mutation find: guidance_scale=1.0 (documented "<= 1 disables it") still ran the unconditional call
    names = []
    original = pipe.transformer.cache_context

    def recording(name, **kwargs):
        names.append(name)
        return original(name, **kwargs)

    pipe.transformer.cache_context = recording
    try:
        pipe("a red circle", guidance_scale=1.0, **CALL)
        pipe("a red circle", guidance_scale=1.5, **CALL)
    finally:
        del pipe.transformer.cache_context
    assert names == ["cond", "cond", "uncond"]


def test_given_negative_embeddings_are_repeated_per_video(pipe):
    # Mutation find: given negative_prompt_embeds were not repeated for num_videos_per_prompt (two prompts: one row
    # per prompt does not broadcast over the four clips)
    prompts, negatives = ["a red circle", "a green cross"], ["a blue square", "a yellow ring"]
    emb = ref.encode_text(pipe.tokenizer, pipe.text_encoder, prompts, "cpu")
    neg = ref.encode_text(pipe.tokenizer, pipe.text_encoder, negatives, "cpu")
    kw = dict(num_videos_per_prompt=2, guidance_scale=3.0, **CALL)
    given = pipe(prompt_embeds=emb, negative_prompt_embeds=neg, generator=torch.Generator().manual_seed(0), **kw)
    computed = pipe(prompts, negative_prompt=negatives, generator=torch.Generator().manual_seed(0), **kw)
    assert given.frames.shape[0] == 4
    torch.testing.assert_close(given.frames, computed.frames, rtol=0, atol=1e-5)
