#!/usr/bin/env python
"""Train the reference text-to-video model (see videosparse/models/reference.py) and export it.

    # a run on a GPU, stopping cleanly after 6 minutes, weights written into the package
    accelerate launch scripts/train_reference_model.py --output-dir outputs/ref --max-minutes 6 \
        --export-dir videosparse/models/reference_weights
    # resume: run the same command again (the latest checkpoint in --output-dir is picked up)
    # continue from the shipped weights with the direction-focused data (time-reversed twins of directional
    # clips with the opposite direction word, more training at high noise), as tried for issue 4
    # (benchmarks/reference_model_stage4_h200.json: not enough):
    accelerate launch scripts/train_reference_model.py --init-from videosparse/models/reference_weights \
        --output-dir /tmp/run4 --export-dir /tmp/export/reference_weights --seed 3 --max-minutes 3.5 \
        --warmup-steps 50 --p-default-size 0.3 --alt-sizes '[[16,32,32],[8,32,32],[16,48,48],[12,48,48]]' \
        --checkpoint-every 100000 --sample-steps 10 --twin-fraction 0.5 --logit-normal-mean 0.5
    # the same continuation with absolute-position input channels (Wan sees positions only relatively, so
    # "starts on the right" is hard to produce): the plain weights are widened with zero-initialised
    # channels, so training starts from exactly the shipped model
    accelerate launch scripts/train_reference_model.py --init-from videosparse/models/reference_weights \
        --transformer-overrides '{"in_channels": 6}' --output-dir /tmp/run5 \
        --export-dir /tmp/export/reference_weights --seed 4 --max-minutes 4 --warmup-steps 50 \
        --checkpoint-every 100000 --sample-steps 10 --logit-normal-mean 0.5
    # from scratch with an embedding-only text encoder (cannot merge opposite direction words), 30% of the
    # noise levels in [0.9, 1) where the sampler decides the motion, longer paths
    # (benchmarks/reference_model_stage6_h200.json: stages 6 + 7 split this into two runs; not enough in 14 min)
    accelerate launch scripts/train_reference_model.py --output-dir /tmp/run8 \
        --export-dir /tmp/export/reference_weights --max-minutes 15 --text-overrides '{"num_layers": 0}' \
        --twin-fraction 0.5 --p-directional 0.75 --p-high-noise 0.3 --travel '[0.5, 0.8]'

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
            p.add_argument(flag, type=json.loads, default=None, help=f"{f.name} as JSON")
        elif hint is bool:
            p.add_argument(flag, type=lambda v: v.lower() in ("1", "true", "yes"), default=None, metavar="BOOL")
        elif hint in (int, float, str):
            p.add_argument(flag, type=hint, default=None)
        else:  # optional number / str
            conv = float if "float" in str(hint) else str
            p.add_argument(flag, type=conv, default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = vars(_parser().parse_args(argv))
    fields: dict = {}
    config_path = args.pop("config")
    if config_path:
        with open(config_path) as f:
            fields.update(json.load(f))
    fields.update({k: v for k, v in args.items() if v is not None})
    cfg = TrainConfig.from_dict(fields)
    summary = train(cfg)
    print(json.dumps(summary, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
