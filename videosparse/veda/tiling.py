"""Head-aware tiling: per (layer, head) 3D tile shape chosen on captured q/k/v.

For every (layer, head) the candidate tile shape with the lowest relative output error

    err = ||O_sparse - O_full||^2 / ||O_full||^2

under the oracle top-k plan (the teacher heat of `videosparse.veda.teacher`, top-k at the target
density with the diagonal forced) wins; votes are counted over samples (majority, ties broken by the
lower mean error); a layer keeps at most `max_shapes_per_layer` shapes (the pair that keeps the most
votes); shapes that would pad the grid by more than `max_padding` are excluded.

The result is a JSON file that `VedaConfig(tiling=path)` reads (`load_tiling`).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import numbers
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch

from ..config import BLOCK_SIZES, check_supported_block
from .._io import to_jsonable, write_atomic
from ..kernels import block_sparse_attention
from ..layout import TileLayout
from ..plan import topk_plan
from ..validation import check_density, check_tile, int_at_least, is_int
from .teacher import dense_lse_torch, teacher_heat

logger = logging.getLogger(__name__)

TILING_FORMAT = "videosparse-tiling"
TILING_VERSION = 1

TileShape = tuple[int, int, int]

#: Veda's candidates for 128-token tiles.
CANDIDATES_128: tuple[TileShape, ...] = ((8, 4, 4), (2, 8, 8), (4, 4, 8), (4, 8, 4), (8, 2, 8), (8, 8, 2))
#: The same six shapes with the time extent halved, for 64-token tiles.
CANDIDATES_64: tuple[TileShape, ...] = ((4, 4, 4), (1, 8, 8), (2, 4, 8), (2, 8, 4), (4, 2, 8), (4, 8, 2))


def candidate_shapes(block: int) -> tuple[TileShape, ...]:
    """The candidate tile shapes for `block` tokens per tile (128: Veda's six; 64: t-extent halved)."""
    if block == 128:
        return CANDIDATES_128
    if block == 64:
        return CANDIDATES_64
    raise ValueError(f"block={block} has no candidate tile shapes; choose 64 or 128.")


# ------------------------------------------------------------------------------------- JSON file
@dataclass(frozen=True)
class Tiling:
    """Per-layer, per-head tile shapes (what `VedaConfig(tiling=path)` loads).

    Attributes:
        layers: `layers[l][h]` is the (pt, ph, pw) of head h in layer l.
        block: tokens per tile.
        meta: anything else the search recorded (density, candidates, errors, ...).
    """

    layers: tuple[tuple[TileShape, ...], ...]
    block: int = 128
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def tiles_for(self, layer: int, num_heads: int) -> tuple[TileShape, ...]:
        """The shapes of `layer`'s heads; ValueError if the file does not cover it."""
        if not 0 <= layer < len(self.layers):
            raise ValueError(f"the tiling file covers layers 0..{len(self.layers) - 1}; layer {layer} was asked for.")
        heads = self.layers[layer]
        if len(heads) != num_heads:
            raise ValueError(f"the tiling file gives layer {layer} {len(heads)} head shapes; the model has "
                             f"{num_heads} heads.")
        return heads

    def check_model(self, model_class: str, num_layers: int, num_heads: int, source: str) -> None:
        """ValueError naming `source` (the file) when the tiling was searched for another model than this one
        (its recorded class or head count, its layer count or a layer's head shapes differ)."""
        meta = self.meta
        wrong = [f"{name}={meta[name]!r} (the model's: {mine!r})"
                 for name, mine in (("model_class", model_class), ("num_heads", num_heads))
                 if name in meta and meta[name] != mine]
        if len(self.layers) != num_layers:
            wrong.append(f"{len(self.layers)} layers (the model's: {num_layers})")
        wrong += [f"{len(heads)} head shapes in layer {l} (the model's heads: {num_heads})"
                  for l, heads in enumerate(self.layers) if len(heads) != num_heads][:1]
        if wrong:
            raise ValueError(f"tiling file {source!r} was searched for another model: " + ", ".join(wrong) + ".")

    @property
    def searched_component(self) -> str | None:
        """The pipeline component the search ran on ("transformer", "transformer_2"), as its JSON records it."""
        search = self.meta.get("search_config")
        component = search.get("component") if isinstance(search, dict) else None
        return component if isinstance(component, str) else None

    def to_dict(self) -> dict[str, Any]:
        return {"format": TILING_FORMAT, "version": TILING_VERSION, "block": self.block,
                "layers": [[list(s) for s in heads] for heads in self.layers], **self.meta}

    def save(self, path: str | os.PathLike) -> None:
        """Write the JSON atomically (`videosparse._io.write_atomic`: temp file + rename)."""
        write_atomic(path, json.dumps(to_jsonable(self.to_dict()), indent=1, allow_nan=False))  # strict: inf as "inf"


def load_tiling(path: str | os.PathLike, block: int | None = None) -> Tiling:
    """Read a tiling JSON written by `search_tiling(...).save(path)` / `videosparse search-tiling`.

    ValueError naming the file and the field for anything else: a missing or unreadable file, another
    format or a newer version, a block other than 64 / 128 (or than `block`), shapes that are not three
    positive ints (JSON integers) whose product is the block.
    """
    name = repr(os.fspath(path))
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"tiling file {name} does not exist.") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"tiling file {name} cannot be read ({e}).") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"tiling file {name} is not valid JSON ({e}).") from None
    if not isinstance(data, dict) or data.get("format") != TILING_FORMAT:
        raise ValueError(f"{name} is not a videosparse tiling file (format must be {TILING_FORMAT!r}).")
    version = data.get("version", 0)
    if not is_int(version) or version > TILING_VERSION:
        raise ValueError(f"tiling file {name}: version {version!r} is not one this videosparse reads "
                         f"(an int <= {TILING_VERSION}).")
    missing = [key for key in ("block", "layers") if key not in data]
    if missing:
        raise ValueError(f"tiling file {name} has no {' or '.join(repr(m) for m in missing)} field.")
    file_block = data["block"]
    if not is_int(file_block) or file_block not in BLOCK_SIZES:
        raise ValueError(f"tiling file {name}: block={file_block!r} must be 64 or 128.")
    if block is not None and file_block != block:
        raise ValueError(f"tiling file {name} has block={file_block}; the config has block={block}.")
    if not isinstance(data["layers"], list) or not all(isinstance(heads, list) and heads for heads in data["layers"]):
        raise ValueError(f"tiling file {name}: 'layers' must be a list (one per layer) of non-empty lists of "
                         "head tile shapes [pt, ph, pw].")
    layers = []
    for l, heads in enumerate(data["layers"]):
        for h, s in enumerate(heads):
            try:
                check_tile(s, file_block)
            except ValueError:
                raise ValueError(f"tiling file {name} layer {l} head {h}: shape {s!r} must be 3 positive ints "
                                 f"with product {file_block}.") from None
        layers.append(tuple(tuple(s) for s in heads))
    meta = {k: v for k, v in data.items() if k not in ("format", "version", "block", "layers")}
    return Tiling(tuple(layers), file_block, meta)


# ------------------------------------------------------------------------------------- search
def head_errors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Sequence[int], shapes: Sequence[TileShape],
                *, density: float, block: int = 128, text_len: int = 0, text_position: str = "after",
                backend: str = "auto", text_slot: bool = False) -> torch.Tensor:
    """Relative output error per head of every shape under its oracle top-k plan.

    Args:
        q, k, v: [B, S, H, D] in diffusers' original token order (post-RoPE).
        grid: (T, H, W) of the video tokens.
        shapes: candidate tile shapes.
        density: target fraction of video key tiles per query tile.
        block, text_len, text_position, text_slot: as in `TileLayout`.
        backend: kernel backend for `block_sparse_attention` and the teacher.

    Returns:
        fp64 [len(shapes), H]: per head, ||O_sparse - O_full||^2 / ||O_full||^2 with both norms summed over
        the batch (one pooled ratio, whatever B).
    """
    qh, kh, vh = (x.transpose(1, 2).float() for x in (q, k, v))                 # [B, H, S, D]
    full = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh)          # [B, H, S, D]
    ref_norm = full.double().pow(2).sum(dim=(0, 2, 3)).clamp_min(1e-30)          # [H]
    lse = dense_lse_torch(qh, kh) if not qh.is_cuda else None                   # shape-independent
    errs = []
    for shape in shapes:
        layout = TileLayout(tuple(grid), shape, block, text_len, text_position, text_slot)
        qt, kt, vt = (layout.gather(x).float().contiguous() for x in (q, k, v))
        perm, _ = layout.indices(q.device)
        heat = teacher_heat(qt, kt, block, lse=None if lse is None else lse[:, :, perm],
                            num_tiles=layout.num_video_tiles, backend="torch" if backend == "reference" else "auto")
        plan = topk_plan(heat, density, num_global_tiles=layout.num_global_tiles, block=block)
        out = block_sparse_attention(qt, kt, vt, plan, backend=backend)
        diff = out.double() - full[:, :, perm].double()
        errs.append(diff.pow(2).sum(dim=(0, 2, 3)) / ref_norm)
    return torch.stack(errs)


@dataclass
class TilingSearchResult:
    """Accumulated votes and errors of a tiling search, and the chosen shapes.

    Attributes:
        tiling: the chosen `Tiling`.
        candidates: shapes considered per layer (after the padding exclusion).
        mean_err: mean_err[l][h][shape] over samples (relative error).
        votes: votes[l][h][shape] (samples where the shape had the lowest error).
        summary: mean error of the chosen tiling and of the best single shape (in-sample).
    """

    tiling: Tiling
    candidates: dict[int, list[TileShape]]
    mean_err: dict[int, list[dict[TileShape, float]]]
    votes: dict[int, list[dict[TileShape, int]]]
    summary: dict[str, Any]

    def save(self, path: str | os.PathLike) -> None:
        self.tiling.save(path)


def _choose_layer(votes: list[Counter], err: list[dict[TileShape, float]], shapes: list[TileShape],
                  max_shapes: int) -> list[TileShape]:
    """Per-head winners of one layer, reduced to at most `max_shapes` distinct shapes.

    Each head's preference order: more votes first, then lower mean error. The kept set of shapes is
    the one (of size <= max_shapes) that keeps the most votes when every head takes its preferred
    shape in the set; ties go to the lower total mean error.
    """
    def key(h: int, s: TileShape) -> tuple[float, float]:
        return (-votes[h][s], err[h].get(s, math.inf))

    winners = [min(shapes, key=lambda s: key(h, s)) for h in range(len(votes))]
    if len(set(winners)) <= max_shapes:
        return winners
    best, best_key = None, None
    for combo in itertools.combinations(shapes, max_shapes):
        pick = [min(combo, key=lambda s: key(h, s)) for h in range(len(votes))]
        score = (-sum(votes[h][s] for h, s in enumerate(pick)), sum(err[h].get(s, math.inf) for h, s in enumerate(pick)))
        if best_key is None or score < best_key:
            best, best_key = pick, score
    return best  # type: ignore[return-value]


def search_tiling(
    samples: Iterable[Any],
    *,
    density: float,
    block: int = 128,
    num_layers: int | None = None,
    num_heads: int | None = None,
    candidates: Sequence[TileShape] | None = None,
    max_padding: float = 0.2,
    max_shapes_per_layer: int = 2,
    backend: str = "auto",
    meta: dict[str, Any] | None = None,
) -> TilingSearchResult:
    """Head-aware tiling search (Veda) over captured attention inputs.

    Args:
        samples: records with fields `layer`, `q`, `k`, `v` ([B, S, H, D], original order, post-RoPE),
            `grid` (T, H, W), and optionally `text_len`, `text_position` (e.g. the records of
            `videosparse.processors.observe`).
        density (`float`): target fraction of video key tiles per query tile.
        block (`int`, defaults to 128): tokens per tile, 64 or 128 (the blocks the configs take).
        num_layers, num_heads: the model's; default the largest layer index seen + 1 and the heads of
            the samples. Layers never seen take, for every head, the shape the seen layers chose most often.
        candidates: default `candidate_shapes(block)`.
        max_padding (`float`, defaults to 0.2): exclude shapes that pad the grid by more than this.
        max_shapes_per_layer (`int`, defaults to 2): distinct shapes allowed per layer.
        backend: kernel backend for the sparse outputs.
        meta: extra fields written into the JSON (model class, density, ...).

    Returns:
        A `TilingSearchResult`; `.save(path)` writes the JSON `VedaConfig(tiling=path)` reads.
    """
    search = TilingSearch(density=density, block=block, candidates=candidates, max_padding=max_padding,
                          max_shapes_per_layer=max_shapes_per_layer, backend=backend)
    for rec in samples:
        search.add(rec)
    return search.result(num_layers=num_layers, num_heads=num_heads, meta=meta)


class TilingSearch:
    """`search_tiling` one record at a time: `add(record)` scores it and keeps only per-(layer, head) sums and
    votes, so records can be scored as a pipeline produces them (none is held); `result()` chooses the shapes.
    Arguments as in `search_tiling`."""

    def __init__(self, *, density: float, block: int = 128, candidates: Sequence[TileShape] | None = None,
                 max_padding: float = 0.2, max_shapes_per_layer: int = 2, backend: str = "auto") -> None:
        check_supported_block(block)
        if candidates is not None and (isinstance(candidates, str) or not isinstance(candidates, Sequence)
                                       or not candidates):
            raise ValueError(f"candidates={candidates!r} must be a non-empty list of tile shapes (pt, ph, pw).")
        try:                # tuples of ints however given (a tiling JSON's "candidates" holds lists)
            self.shapes = tuple(dict.fromkeys(check_tile(s, block) for s in candidates)) \
                if candidates is not None else candidate_shapes(block)
        except ValueError as err:
            raise ValueError(f"candidates: {err}") from None
        density = check_density("density", density, "the fraction of video key tiles kept per query tile")
        if isinstance(max_padding, bool) or not isinstance(max_padding, numbers.Real) or not 0 <= max_padding < 1:
            raise ValueError(f"max_padding={max_padding!r} must be a number in [0, 1) (the share of padded tokens a "
                             "shape may add).")
        max_shapes_per_layer = int_at_least(max_shapes_per_layer, 1, "max_shapes_per_layer")
        self.density, self.block, self.backend = density, int(block), backend
        self.max_padding, self.max_shapes_per_layer = float(max_padding), max_shapes_per_layer
        self.err_sum: dict[int, torch.Tensor] = {}          # layer -> [n_shapes, H] summed errors
        self.err_cnt: dict[int, int] = {}
        self.votes: dict[int, list[Counter]] = {}
        self.allowed_per_layer: dict[int, list[TileShape]] = {}
        self.heads_seen: int | None = None
        self._warned_grids: set[tuple[int, ...]] = set()

    @property
    def num_samples(self) -> int:
        return int(sum(self.err_cnt.values()))

    def add(self, rec: Any) -> None:
        """Score one record (fields as `search_tiling`'s samples) and add it to the layer's sums and votes."""
        shapes_all = self.shapes
        layer = int(rec.layer)
        grid = tuple(int(g) for g in rec.grid)
        text_len = int(getattr(rec, "text_len", 0) or 0)
        text_position = getattr(rec, "text_position", None) or "after"
        if math.prod(grid) < self.block:  # fewer video tokens than one tile: one tile, which every plan keeps
            if grid not in self._warned_grids:
                self._warned_grids.add(grid)
                logger.warning("grid %s has fewer video tokens than one %d-token tile: its calls keep their one tile "
                               "(nothing to choose) and are not scored", grid, self.block)
            return
        pads = {s: TileLayout(grid, s, self.block).padding_fraction for s in shapes_all}
        allowed = [s for s in shapes_all if pads[s] <= self.max_padding + 1e-12]
        if not allowed:
            least = min(shapes_all, key=lambda s: pads[s])
            if grid not in self._warned_grids:              # once per grid, not once per captured sample
                self._warned_grids.add(grid)
                logger.warning("grid %s: every candidate pads by more than %.0f%%; keeping %s (%.1f%%)",
                               grid, 100 * self.max_padding, least, 100 * pads[least])
            allowed = [least]
        e = head_errors(rec.q, rec.k, rec.v, grid, shapes_all, density=self.density, block=self.block,
                        text_len=text_len, text_position=text_position, backend=self.backend,
                        text_slot=bool(getattr(rec, "text_slot", False)))                  # [n_shapes, H]
        H = e.shape[1]
        mask = torch.tensor([s in allowed for s in shapes_all], device=e.device)
        best = e.masked_fill(~mask[:, None], math.inf).argmin(0).tolist()
        err_sum = self.err_sum.get(layer, torch.zeros_like(e)) + e
        # (all that can fail is done: a record that raised above leaves the search as it was)
        prev = self.allowed_per_layer.get(layer)
        self.allowed_per_layer[layer] = allowed if prev is None else [s for s in prev if s in allowed] or prev
        self.heads_seen = H
        votes = self.votes.setdefault(layer, [Counter() for _ in range(H)])
        for h in range(H):
            votes[h][shapes_all[best[h]]] += 1
        self.err_sum[layer] = err_sum
        self.err_cnt[layer] = self.err_cnt.get(layer, 0) + 1

    def result(self, *, num_layers: int | None = None, num_heads: int | None = None,
               meta: dict[str, Any] | None = None) -> TilingSearchResult:
        """The chosen tiling of the records added so far (ValueError when there were none)."""
        shapes_all, err_sum, err_cnt, votes = self.shapes, self.err_sum, self.err_cnt, self.votes
        if not err_sum and self._warned_grids:
            grids = ", ".join(map(str, sorted(self._warned_grids)))
            raise ValueError(f"search_tiling scored no sample: every captured call's video grid ({grids}) holds "
                             f"fewer tokens than one {self.block}-token tile, "
                             "which leaves nothing to choose; search on a larger video (more frames, height or width).")
        if not err_sum:
            raise ValueError("search_tiling got no samples; capture at least one self-attention call.")
        L = num_layers if num_layers is not None else max(err_sum) + 1
        Hn = num_heads if num_heads is not None else self.heads_seen
        if Hn != self.heads_seen or max(err_sum) >= L:
            raise ValueError(f"num_layers={num_layers}, num_heads={num_heads} do not fit the samples: they hold "
                             f"{self.heads_seen} heads and layers up to {max(err_sum)}.")
        layers_out: list[tuple[TileShape, ...]] = []
        mean_err: dict[int, list[dict[TileShape, float]]] = {}
        chosen_err, single_err = [], {s: [] for s in shapes_all}
        for l in range(L):
            if l not in err_sum:
                layers_out.append(None)         # filled below with the searched layers' most chosen shape
                continue
            m = (err_sum[l] / err_cnt[l]).tolist()
            allowed = self.allowed_per_layer[l]
            mean_err[l] = [{s: m[i][h] for i, s in enumerate(shapes_all)} for h in range(Hn)]
            picks = _choose_layer(votes[l], mean_err[l], allowed, self.max_shapes_per_layer)
            layers_out.append(tuple(picks))
            for h, s in enumerate(picks):
                chosen_err.append(mean_err[l][h][s])
                for t in shapes_all:
                    single_err[t].append(mean_err[l][h][t] if t in allowed else math.inf)
        # a layer left out of the search (`layers=`) takes the shape chosen most often in those searched (the same
        # video grid, so it fits the padding rule as they do); the first such shape on ties
        picked = Counter(s for heads in layers_out if heads is not None for s in heads)
        fill = max(picked, key=lambda s: (picked[s], -list(picked).index(s)))
        layers_out = [heads if heads is not None else tuple([fill] * Hn) for heads in layers_out]
        singles = {f"{s[0]}x{s[1]}x{s[2]}": sum(v) / len(v) for s, v in single_err.items() if v}
        best_single = min(singles, key=singles.get)
        summary = {
            "mean_rel_err_searched": sum(chosen_err) / len(chosen_err),
            "mean_rel_err_single": singles,
            "best_single_shape": best_single,
            "mean_rel_err_best_single": singles[best_single],
            "num_samples": self.num_samples,
            # why a shape's mean_rel_err_single is inf: it pads a searched layer's grid past max_padding there
            "shapes_over_max_padding": [name for name, err in singles.items() if math.isinf(err)],
        }
        summary["searched_vs_best_single"] = (summary["mean_rel_err_searched"]
                                              / max(summary["mean_rel_err_best_single"], 1e-30))
        info = dict(meta or {})
        info.update({"density": self.density, "max_padding": self.max_padding,
                     "max_shapes_per_layer": self.max_shapes_per_layer,
                     "candidates": [list(s) for s in shapes_all], "summary": summary,
                     "mean_rel_err": {str(l): [{"x".join(map(str, s)): v for s, v in hs.items()} for hs in per]
                                      for l, per in mean_err.items()}})
        tiling = Tiling(tuple(layers_out), self.block, info)
        return TilingSearchResult(tiling, self.allowed_per_layer, mean_err,
                                  {l: [dict(c) for c in v] for l, v in votes.items()}, summary)
