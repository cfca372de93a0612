#!/usr/bin/env python
"""Train the reference text-to-video model (see videosparse/models/reference.py) and export it.

The defaults are the shipped recipe (benchmarks/reference_model.json, "training"): from scratch with
absolute-position input channels, an embedding-only text encoder, 20% of the noise levels in [0.9, 1),
long paths and time-reversed twins. The shipped weights came from these two runs on an H200 (15 min):

    accelerate launch scripts/train_reference_model.py --output-dir outputs/ref --max-minutes 7.4 \
        --export-dir outputs/ref_stage1 --seed 11
    accelerate launch scripts/train_reference_model.py --init-from outputs/ref_stage1 --output-dir outputs/ref2 \
        --max-minutes 7.6 --learning-rate 2e-4 --warmup-steps 50 --seed 12 \
        --export-dir videosparse/models/reference_weights

    # resume a killed run: run the same command again (the latest checkpoint in --output-dir is picked up)

Earlier recipes, each lacking one of those parts, are kept reproducible through the options, e.g. the
first shipped weights (plain input, a 2-layer text encoder, uniform motions, short paths; they followed
the colour but the direction sign only by chance, benchmarks/reference_model_stage*_h200.json):

    accelerate launch scripts/train_reference_model.py --output-dir outputs/old --max-minutes 6 \
        --transformer-overrides '{"in_channels": 3}' --text-overrides '{"num_layers": 2}' \
        --p-high-noise 0 --travel '[0.3, 0.6]' --p-directional null --twin-fraction 0

Every field of `videosparse.models.reference_train.TrainConfig` is an option (--batch-size, --max-steps,
--checkpoint-every, ...); `--config run.json` reads them from a file first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import typing

from videosparse.models.reference_train import TrainConfig, train


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="JSON file of TrainConfig fields (command-line options override it)")
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        if f.name in ("alt_sizes", "travel", "transformer_overrides", "text_overrides"):
            p.add_argument(flag, type=_json_value, default=None, help=f"{f.name} as JSON")
        elif hint is bool:
            p.add_argument(flag, type=_bool, default=None, metavar="BOOL")
        elif hint in (int, float, str):
            p.add_argument(flag, type=hint, default=None)
        else:  # optional number / str: "none" (or "null") sets None
            p.add_argument(flag, type=_optional(float if "float" in str(hint) else str), default=None)
    return p


_NONE = object()   # an explicit "none" on the command line, told apart from an option not given


def _bool(text: str) -> bool:
    """true / false, 1 / 0, yes / no (any case); anything else an argparse error naming it (a typo is no False)."""
    value = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true / false, 1 / 0, yes / no)")
    return value


def _json_value(text: str):
    """A JSON option's value; `null` is an explicit None (told apart from the option not given)."""
    value = json.loads(text)
    return _NONE if value is None else value


def _optional(conv):
    def parse(text: str):
        return _NONE if text.lower() in ("none", "null") else conv(text)
    parse.__name__ = conv.__name__
    return parse


def config_from_args(argv: list[str] | None = None) -> TrainConfig:
    """The `TrainConfig` of a command line (a `--config` file first, then the options given)."""
    args = vars(_parser().parse_args(argv))
    fields: dict = {}
    config_path = args.pop("config")
    if config_path:
        with open(config_path) as f:
            fields.update(json.load(f))
    fields.update({k: None if v is _NONE else v for k, v in args.items() if v is not None})
    return TrainConfig.from_dict(fields)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    summary = train(config_from_args(argv))
    print(json.dumps(summary, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
