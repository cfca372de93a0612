"""The Plan: which key tiles every query tile attends to, and the builders that make one.

A plan is the contract between the tile choosers (Veda, Sol) and the kernels: the same plan runs on
every backend, so it can be checked against the reference and executed by the fast kernel unchanged.

    kv_index  int32 [B, H, Mq, Kmax]  key-tile indices per query tile, sorted ascending, valid
                                      entries packed left; entries past kv_count are ignored (the
                                      builders write 0 there; `with_valid_keys` leaves them as they were)
    kv_count  int32 [B, H, Mq]        number of valid entries per row (>= 1 for a meaningful row)
    block_m, block_n                  tokens per query tile / key tile
    k_mean    [B, H, Nk, D]           optional: mean key of every key tile       (zero-order
    v_sum     [B, H, Nk, D]           optional: sum of values of every key tile   correction of
    tile_len  [Nk]                    optional: real tokens of every key tile     skipped tiles)
    order     int32 [B*H*Mq]          optional: the order the kernels take the (b*H + h)*Mq + m rows in
                                      (a permutation; `work_order`: long rows first, then (b, h, m), each
                                      wave dealt evenly over the persistent grid's programs); builders
                                      that know their row lengths on the host attach it, otherwise the
                                      kernels compute it from kv_count
    valid_keys int32 [B]              optional: keys at positions >= valid_keys[b] are masked for every
                                      query of item b (a key-padding mask given as a device tensor, so
                                      that prompt lengths change no shape); listed tiles start below it
                                      (`with_valid_keys` drops the others), skipped tiles past it do not
                                      enter the correction (their centroids may hold anything); the keys
                                      and values there must be finite on the Hopper kernels, which load
                                      whole tiles (an inf there reaches P.V as 0 * inf, as in SDPA)
"""

from __future__ import annotations

import importlib.util
import math
import numbers
from dataclasses import dataclass, fields, replace

import torch

from .validation import check_block


@dataclass
class Plan:
    """Per (batch, head, query tile) list of key tiles, plus optional correction inputs."""

    kv_index: torch.Tensor
    kv_count: torch.Tensor
    block_m: int = 128
    block_n: int = 128
    k_mean: torch.Tensor | None = None
    v_sum: torch.Tensor | None = None
    tile_len: torch.Tensor | None = None
    order: torch.Tensor | None = None
    valid_keys: torch.Tensor | None = None

    @property
    def has_correction(self) -> bool:
        """Whether the plan carries correction inputs (`validate` requires all three once any is given)."""
        return self.k_mean is not None or self.v_sum is not None or self.tile_len is not None

    @property
    def num_key_tiles(self) -> int:
        """Nk, when known from the correction tensors; -1 for a plan without them (the caller derives it from
        the key length)."""
        return self.tile_len.numel() if self.tile_len is not None else -1

    def density(self, num_key_tiles: int | None = None) -> float:
        """Realised tile density: kept (query tile, key tile) pairs / all pairs."""
        if num_key_tiles is None and self.num_key_tiles <= 0:
            raise ValueError("density() needs num_key_tiles when the plan carries no tile_len.")
        nk = self.num_key_tiles if num_key_tiles is None else num_key_tiles
        if isinstance(nk, bool) or not isinstance(nk, numbers.Integral) or nk < 1:
            raise ValueError(f"num_key_tiles={num_key_tiles!r} must be an int >= 1 (the key tiles every row counts "
                             "against; None: the plan's tile_len's).")
        if not self.kv_count.numel():
            raise ValueError(f"the plan has no query-tile rows (kv_count {tuple(self.kv_count.shape)}): no density.")
        most = int(self.kv_count.max())
        if most > nk:
            raise ValueError(f"num_key_tiles={nk}, but a row of the plan keeps {most} tiles.")
        return float(self.kv_count.sum()) / (self.kv_count.numel() * nk)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Plan":
        """This plan with every tensor it holds on `device`, dtypes kept (as `Tensor.to(device)`: tensors already
        there are reused), e.g. a plan built on the CPU for q, k, v on the GPU."""
        return replace(self, **{f.name: t.to(device, non_blocking=non_blocking) for f in fields(self)
                                if isinstance(t := getattr(self, f.name), torch.Tensor)})

    def with_correction(self, k_mean: torch.Tensor, v_sum: torch.Tensor, tile_len: torch.Tensor) -> "Plan":
        """This plan with the zero-order correction's tile statistics: k_mean [B, H, Nk, D] (each key tile's mean
        key) and v_sum [B, H, Nk, D] (its value sum), floating point, and tile_len int32 or int64 [Nk] (its tokens);
        see `videosparse.sol.centroids.tile_stats`."""
        return replace(self, k_mean=k_mean, v_sum=v_sum, tile_len=tile_len)

    def with_index_slot(self) -> "Plan":
        """This plan with one (unused) index column when it has none (Kmax = 0, every row empty), so that
        kernels can read a row's first entry; otherwise the plan itself."""
        if self.kv_index.shape[-1]:
            return self
        return replace(self, kv_index=self.kv_index.new_zeros((*self.kv_index.shape[:3], 1)))

    def without_correction(self) -> "Plan":
        return replace(self, k_mean=None, v_sum=None, tile_len=None)

    def with_valid_keys(self, valid_keys: torch.Tensor | None, skip_padded_queries: bool = False) -> "Plan":
        """This plan with the key-padding limit `valid_keys` (int32 [B]; None: the plan itself): every row keeps
        only its listed tiles that start below its item's limit (tensor ops, no host sync: rows are sorted, so the
        kept ones stay packed left), and the kernels mask the keys at or past it in the last one.
        skip_padded_queries: the query tiles that start at or past the limit get no tiles, for models whose padded
        rows are zeros: without the correction their rows come out zero at no cost; with it they still take the
        centroids of the valid key tiles (a caller that needs zeros sets them, as `attend_text_prefix` does). The
        plan's `order` is dropped then (the kernels sort
        the new row lengths): kept, it would put the emptied rows, often the longest before, first, which cost the
        Gluon kernel 16% at HunyuanVideo 1.5's shape (4.24 vs 3.72 ms per call on the H200)."""
        if valid_keys is None:
            return self
        B = self.kv_count.shape[0]
        if not isinstance(valid_keys, torch.Tensor):
            raise TypeError(f"valid_keys={valid_keys!r} must be an int32 tensor [{B}] (one key count per batch item) "
                            "or None.")
        if valid_keys.dtype != torch.int32 or tuple(valid_keys.shape) != (B,):
            raise ValueError(f"valid_keys must be int32 [{B}] (one key count per batch item); got "
                             f"{valid_keys.dtype} {tuple(valid_keys.shape)}.")
        kmax = self.kv_index.shape[-1]
        listed = torch.arange(kmax, device=self.kv_index.device) < self.kv_count[..., None]
        below = self.kv_index * self.block_n < valid_keys.view(B, 1, 1, 1)
        count = (listed & below).sum(-1, dtype=torch.int32)
        order = self.order
        if skip_padded_queries:
            starts = torch.arange(count.shape[-1], device=count.device) * self.block_m
            count = count.masked_fill(starts >= valid_keys.view(B, 1, 1), 0)
            order = None
        return replace(self, kv_count=count, valid_keys=valid_keys, order=order)

    def check_structure(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None, *,
                        where: str = "") -> None:
        """The checks of `validate` that read only metadata (types, dtypes, shapes, devices; no host sync), so they
        run on every call, `validate=False` and torch.compile included: a plan whose shapes do not fit q, k would
        make a kernel write past its output or leave rows unwritten, and a k or v whose batch, heads or head dim
        differ from q's, or that differ from each other, would be read past its end. The counts and indices are not
        read (a row's entries past its count may hold anything, so Kmax may exceed k's tiles): a plan for more key
        tiles than k has passes unless its centroids show it. ValueError (TypeError for a field that is no tensor)
        naming tensor, shape and expectation."""
        at = f" ({where})" if where else ""
        for name in ("kv_index", "kv_count", "k_mean", "v_sum", "tile_len", "valid_keys", "order"):
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor) and (value is not None or name in ("kv_index", "kv_count")):
                allowed = "a tensor" if name in ("kv_index", "kv_count") else "a tensor or None"
                raise TypeError(f"Plan.{name} must be {allowed}; got {type(value).__name__}{at}.")
        if q.dim() != 4 or k.dim() != 4:
            raise ValueError(f"q and k must be (B, H, S, D); got q {tuple(q.shape)}, k {tuple(k.shape)}{at}.")
        if k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3] or (v is not None and v.shape != k.shape):
            got = f"q {tuple(q.shape)}, k {tuple(k.shape)}" + (f", v {tuple(v.shape)}" if v is not None else "")
            raise ValueError(f"shapes do not match: {got}; expected q (B, H, S, D) and k, v (B, H, Sk, D){at}.")
        check_block("block_m", self.block_m)
        check_block("block_n", self.block_n)
        B, H, S, D = q.shape
        Sk = k.shape[2]
        Mq, Nk = math.ceil(S / self.block_m), math.ceil(Sk / self.block_n)
        if self.kv_index.dtype != torch.int32 or self.kv_count.dtype != torch.int32:
            raise ValueError(
                f"kv_index/kv_count must be int32; got {self.kv_index.dtype}/{self.kv_count.dtype}{at}."
            )
        if self.kv_index.dim() != 4 or tuple(self.kv_index.shape[:3]) != (B, H, Mq):
            # q given as (B, S, H, D), the layout of diffusers' attention dispatch: the plan's heads sit at dim 2
            transposed = self.kv_index.dim() == 4 and tuple(self.kv_index.shape[:2]) == (B, S) != (B, H)
            raise ValueError(
                f"kv_index has shape {tuple(self.kv_index.shape)}; expected ({B}, {H}, {Mq}, Kmax) for "
                f"q {tuple(q.shape)} and block_m={self.block_m}{at}. q, k, v are (B, H, S, D)"
                + ("; q looks like (B, S, H, D): pass q.transpose(1, 2) (and k, v)." if transposed else ".")
            )
        if tuple(self.kv_count.shape) != (B, H, Mq):
            raise ValueError(f"kv_count has shape {tuple(self.kv_count.shape)}; expected ({B}, {H}, {Mq}){at}.")
        for name, t in (("kv_index", self.kv_index), ("kv_count", self.kv_count)):
            if t.device != q.device:
                raise ValueError(f"{name} is on {t.device}, q is on {q.device}{at}.")
        if self.has_correction:
            if self.k_mean is None or self.v_sum is None or self.tile_len is None:
                missing = [n for n in ("k_mean", "v_sum", "tile_len") if getattr(self, n) is None]
                raise ValueError(f"correction needs k_mean, v_sum and tile_len together; {missing} missing{at}.")
            for name, t in (("k_mean", self.k_mean), ("v_sum", self.v_sum)):
                if tuple(t.shape) != (B, H, Nk, D):
                    raise ValueError(f"{name} has shape {tuple(t.shape)}; expected ({B}, {H}, {Nk}, {D}){at}.")
            if tuple(self.tile_len.shape) != (Nk,):
                raise ValueError(f"tile_len has shape {tuple(self.tile_len.shape)}; expected ({Nk},){at}.")
            if self.tile_len.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"tile_len must be int32 or int64 (tokens per key tile); got {self.tile_len.dtype}"
                                 f"{at}.")
            for name, t in (("k_mean", self.k_mean), ("v_sum", self.v_sum)):
                if not t.is_floating_point():
                    raise ValueError(f"{name} must be a floating-point tensor; got {t.dtype}{at}.")
            for name, t in (("k_mean", self.k_mean), ("v_sum", self.v_sum), ("tile_len", self.tile_len)):
                if t.device != q.device:
                    raise ValueError(f"{name} is on {t.device}, q is on {q.device}{at}.")
        if self.valid_keys is not None:
            vk = self.valid_keys
            if vk.dtype != torch.int32 or tuple(vk.shape) != (B,) or vk.device != q.device:
                raise ValueError(f"valid_keys must be int32 [{B}] on {q.device}; got {vk.dtype} {tuple(vk.shape)} "
                                 f"on {vk.device}{at}.")
        if self.order is not None:
            n = B * H * Mq
            if self.order.dtype != torch.int32 or tuple(self.order.shape) != (n,) or self.order.device != q.device:
                raise ValueError(f"order must be int32 [{n}] on {q.device} (a permutation of the B*H*Mq rows); got "
                                 f"{self.order.dtype} {tuple(self.order.shape)} on {self.order.device}{at}.")

    def validate(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None, *, where: str = "") -> None:
        """Check the plan against q, k (B, H, S, D): `check_structure`, then its values (index range and order,
        counts, finite centroids, valid keys, the order a permutation; these read the plan on the host); raise
        ValueError naming tensor, shape and expectation (TypeError for a field that is no tensor)."""
        self.check_structure(q, k, v, where=where)
        at = f" ({where})" if where else ""
        B, H, S, D = q.shape
        Sk = k.shape[2]
        Mq, Nk = math.ceil(S / self.block_m), math.ceil(Sk / self.block_n)
        kmax = self.kv_index.shape[3]          # may exceed Nk (a plan packed at a fixed width): counts may not
        if bool((self.kv_count < 0).any()) or bool((self.kv_count > kmax).any()):
            raise ValueError(f"kv_count values must lie in [0, Kmax={kmax}]; got range "
                             f"[{int(self.kv_count.min())}, {int(self.kv_count.max())}]{at}.")
        slot = torch.arange(kmax, device=q.device)
        valid = slot < self.kv_count[..., None]
        idx = self.kv_index
        outside = ((idx < 0) | (idx >= Nk)) & valid
        if bool(outside.any()):
            first = tuple(int(i) for i in outside.nonzero()[0])
            raise ValueError(f"kv_index{list(first)} = {int(idx[first])} lies outside [0, {Nk}) (the key tiles; "
                             f"a row's first kv_count entries are read){at}.")
        if kmax > 1:
            unsorted = (idx[..., 1:] <= idx[..., :-1]) & valid[..., 1:]
            if bool(unsorted.any()):
                b, h, m, j = (int(i) for i in unsorted.nonzero()[0])
                raise ValueError(f"kv_index rows must be strictly increasing in their valid entries; row [{b}, {h}, "
                                 f"{m}] has {int(idx[b, h, m, j])} then {int(idx[b, h, m, j + 1])} at entries {j}, "
                                 f"{j + 1}{at}.")
        if self.has_correction:
            counted = None          # centroids of tiles that start past an item's valid keys are never read
            if self.valid_keys is not None:
                starts = torch.arange(Nk, device=q.device) * self.block_n
                counted = (starts < self.valid_keys.to(q.device).long()[:, None])[:, None, :].expand(B, H, Nk)
            for name, t in (("k_mean", self.k_mean), ("v_sum", self.v_sum), ("tile_len", self.tile_len)):
                read = t if counted is None or t.dim() == 1 else t[counted]
                if read.numel() and not bool(torch.isfinite(read).all()):
                    raise ValueError(f"{name} holds non-finite values (inf or NaN){at}; the correction needs finite "
                                     "centroids and tile lengths (past an item's valid_keys they may hold anything).")
            if Nk and bool((self.tile_len < 1).any()):
                raise ValueError(f"tile_len values must be >= 1 (tokens per key tile); got minimum "
                                 f"{int(self.tile_len.min())}{at}.")
            if Nk:
                most = torch.full((Nk,), self.block_n, dtype=torch.float64, device=self.tile_len.device)
                most[-1] = Sk - (Nk - 1) * self.block_n
                if bool((self.tile_len.double() > most).any()):
                    raise ValueError(f"tile_len holds more tokens than a key tile has (at most {self.block_n}, the "
                                     f"last of {Sk} keys {Sk - (Nk - 1) * self.block_n}){at}.")
        if self.valid_keys is not None:
            vk = self.valid_keys
            if B and (int(vk.min()) < 1 or int(vk.max()) > Sk):
                raise ValueError(f"valid_keys values must lie in [1, Sk={Sk}]; got range [{int(vk.min())}, "
                                 f"{int(vk.max())}]{at}.")
            past = idx.long() * self.block_n >= vk.view(B, 1, 1, 1)
            if bool((past & valid).any()):
                raise ValueError(f"kv_index lists key tiles that start at or past valid_keys{at}; "
                                 "Plan.with_valid_keys drops them.")
        if self.order is not None:
            n = B * H * Mq
            seen = torch.bincount(self.order.long().clamp(0, n), minlength=n + 1)[:n]
            if n and (int(self.order.min()) < 0 or not bool((seen == 1).all())):
                raise ValueError(f"order is not a permutation of 0..{n - 1}{at}.")

    def to_dense_mask(self, num_key_tiles: int) -> torch.Tensor:
        """bool [B, H, Mq, Nk]: True where the plan keeps the tile exactly (ValueError when a kept index is not
        below `num_key_tiles`)."""
        B, H, Mq, kmax = self.kv_index.shape
        valid = torch.arange(kmax, device=self.kv_index.device) < self.kv_count[..., None]
        listed = self.kv_index[valid]
        if listed.numel() and not 0 <= int(listed.min()) <= int(listed.max()) < num_key_tiles:
            raise ValueError(f"num_key_tiles={num_key_tiles}, but the plan keeps key tiles "
                             f"{int(listed.min())}..{int(listed.max())}.")
        mask = torch.zeros(B, H, Mq, num_key_tiles + 1, dtype=torch.bool, device=self.kv_index.device)
        idx = torch.where(valid, self.kv_index.long(), num_key_tiles)
        mask.scatter_(-1, idx, True)
        return mask[..., :num_key_tiles]


def _cached(cache: dict, key: tuple, build):
    """cache[key], built by build() on a miss; the cache is emptied once it holds 64 entries. Built as normal tensors
    even under inference_mode: a later call that records autograd keeps them for its backward (a plan's `order`)."""
    hit = cache.get(key)
    if hit is None:
        with torch.inference_mode(False):
            hit = build()
        if len(cache) >= 64:
            cache.clear()
        cache[key] = hit
    return hit


_ORDERS: dict[tuple, torch.Tensor] = {}


ROW_FIXED_COST = 2   # a work item's cost beyond its key tiles, in key tiles (item sweep: ~2.9 vs ~1.7 us per tile)


def work_order(kv_count: torch.Tensor, programs: int | None = None) -> torch.Tensor:
    """int32 [B*H*Mq]: the order the kernels take the plan rows (b*H + h)*Mq + m in, from kv_count (int32, any
    shape, rows in that order).

    Base order (programs None: launches of one program per row, which the hardware schedules as they come):
    rows with more than twice the mean kv_count of the non-empty rows first (global-tile rows, a dense head
    among sparse ones), longest first; then the other non-empty rows in (b, h, m) order; empty rows last. In
    head-major order a wave of items reads one or two heads' K/V, which L2 then holds (16 MB per head at 32,768
    tokens x 128); sorted by length, every wave reads every head.

    programs given (the persistent kernels: program p takes entries p, p + programs, ...): the base order
    with each wave of `programs` consecutive entries permuted so that its costliest row (kv_count +
    ROW_FIXED_COST) goes to the program with the least work so far; the last, partial wave, which goes to
    programs 0..r-1 as it is, counted first. Waves keep their rows (and so their heads), and the programs end
    together even when rows differ in length. On the H200 (12 x 32,768, `scripts/ab_work_order.py`,
    `benchmarks/order_ab_6_h200.json`, `..._hopper_h200.json`), against rows sorted longest first: rows of
    log-normal length +27% (Gluon) / +19% (Triton Hopper), where the base order alone gives -1 / -9%; top-k
    plans +3-5 / +1-3% (the base order: the same); 2 global-tile rows per head +4 / +2%; per-head densities
    -0.4 / +1.6%. On CUDA two Triton launches (`kernels.triton_work_order`), elsewhere a torch loop over the waves."""
    c = kv_count.reshape(-1).long()
    long_rows = c * torch.count_nonzero(c) > 2 * c.sum()              # c > 2 x the mean of the non-empty rows
    key = torch.where(long_rows, c + 2, c.clamp(max=1))                 # long rows by length > other rows > empty
    base = torch.sort(key, descending=True, stable=True).indices
    if programs is None:
        return base.to(torch.int32)
    if programs < 1:
        raise ValueError(f"programs must be >= 1; got {programs}.")
    if c.is_cuda:
        from .kernels.triton_work_order import balanced_order

        return balanced_order(base, kv_count, programs, cost_offset=ROW_FIXED_COST)
    return base[_balanced_positions(c[base] + ROW_FIXED_COST, programs)].to(torch.int32)


def _balanced_positions(cost: torch.Tensor, programs: int) -> torch.Tensor:
    """int64 [N]: the balancing permutation of `work_order` (entry j takes entry result[j] of the base order),
    from the costs (int64 [N]) in base order; the torch path."""
    n = cost.numel()
    full = n // programs
    order = torch.arange(n, device=cost.device)
    loads = torch.zeros(programs, dtype=torch.long, device=cost.device)
    loads[:n - full * programs] = cost[full * programs:]               # the partial wave: programs 0..r-1
    waves = cost[:full * programs].view(full, programs)
    items = waves.sort(dim=1, descending=True, stable=True).indices     # per wave, costliest first
    for w in range(full):
        cols = loads.sort(stable=True).indices                          # least loaded first
        order[w * programs + cols] = w * programs + items[w]
        loads[cols] += waves[w, items[w]]
    return order


def device_programs(device: torch.device | str) -> int | None:
    """The persistent kernels' grid size on `device` (its SM count) for `work_order`; None off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def row_order(row_lengths: list[int], groups: int, device: torch.device | str) -> torch.Tensor | None:
    """int32 [groups * len(row_lengths)]: `work_order` (for `device_programs(device)`) of the plan rows
    g * len + m when every group g of B*H has these planned row lengths, computed on the host once per
    (lengths, groups, device) and cached. The kernels then skip computing it (one launch per call). Under
    torch.compile (where a host computation and copy per call in the graph would cost more) only rows of one
    or two adjacent lengths, none empty (e.g. Wan's top-k plans: 25 or 26 tiles), are given, as an arange: (b, h,
    m) order, within 2% of the balanced order on them (`benchmarks/order_ab_6_h200.json`, "identity");
    otherwise None and the kernel custom op computes the order."""
    if torch.compiler.is_compiling():
        if row_lengths and min(row_lengths) >= 1 and max(row_lengths) - min(row_lengths) <= 1:
            return torch.arange(groups * len(row_lengths), dtype=torch.int32, device=device)
        return None

    def build():
        return work_order(torch.tensor(row_lengths, dtype=torch.int32).repeat(groups),
                          device_programs(device)).to(device)

    return _cached(_ORDERS, (tuple(row_lengths), groups, str(device)), build)


def plan_from_mask(mask: torch.Tensor, block_m: int = 128, block_n: int = 128) -> Plan:
    """A plan from a tile mask, bool [B, H, Mq, Nk] (True = compute exactly)."""
    if mask.dtype != torch.bool or mask.dim() != 4:
        raise ValueError(f"mask must be bool [B, H, Mq, Nk]; got {mask.dtype} {tuple(mask.shape)}.")
    check_block("block_m", block_m)
    check_block("block_n", block_n)
    Nk = mask.shape[-1]
    count = mask.sum(-1, dtype=torch.int32)
    kmax = max(int(count.max()), 1) if count.numel() else 1
    cols = torch.arange(Nk, device=mask.device, dtype=torch.int32).expand_as(mask)
    keyed = torch.where(mask, cols, torch.full_like(cols, Nk))
    index = keyed.sort(dim=-1).values[..., :kmax]
    index = torch.where(index == Nk, torch.zeros_like(index), index).to(torch.int32).contiguous()
    return Plan(index, count.contiguous(), block_m, block_n)


def dense_plan(batch: int, heads: int, seq_len: int, block_m: int = 128, block_n: int = 128,
               device: torch.device | str = "cpu", key_len: int | None = None) -> Plan:
    """The plan that keeps every key tile (full attention) of `seq_len` queries over `key_len` keys (default
    `seq_len`)."""
    check_block("block_m", block_m)
    check_block("block_n", block_n)
    for name, value in (("batch", batch), ("heads", heads), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, (numbers.Integral, torch.SymInt)) or value < 0:
            raise ValueError(f"{name}={value!r} must be an int >= 0.")
    given = key_len is not None
    key_len = key_len if given else seq_len
    if isinstance(key_len, bool) or not isinstance(key_len, (numbers.Integral, torch.SymInt)) or key_len < 1:
        raise ValueError(f"key_len={key_len!r} must be an int >= 1" + ("." if given else " (it defaults to seq_len)."))
    Mq, Nk = math.ceil(seq_len / block_m), math.ceil(key_len / block_n)
    index = torch.arange(Nk, dtype=torch.int32, device=device).expand(batch, heads, Mq, Nk).contiguous()
    count = torch.full((batch, heads, Mq), Nk, dtype=torch.int32, device=device)
    return Plan(index, count, block_m, block_n, order=row_order([Nk] * Mq, batch * heads, device))


def row_budget_list(density: float, num_rows: int, num_cols: int) -> list[int]:
    """Per-row tile budgets averaging density*num_cols, spread evenly, each in [1, num_cols].

    Row i gets floor((i+1)*x) - floor(i*x) with x = density*num_cols, so fractional budgets are
    spread evenly over the rows. Plain Python (no tensors), so compiled graphs see constants.
    """
    x = density * num_cols
    edges = [math.floor(i * x + 1e-9) for i in range(num_rows + 1)]
    return [min(max(edges[i + 1] - edges[i], 1), num_cols) for i in range(num_rows)]


def row_budgets(density: float, num_rows: int, num_cols: int) -> torch.Tensor:
    """int64 [num_rows]: `row_budget_list` as a tensor."""
    return torch.tensor(row_budget_list(density, num_rows, num_cols), dtype=torch.long)


_TOPK_CONSTANTS: dict[tuple, tuple[list[int], torch.Tensor, torch.Tensor]] = {}


def _topk_constants(density: float, Mv: int, Nv: int, device: torch.device):
    """(budget list, budget int64 [Mv], eye bool [Mv, Mv] on `device`), cached in eager mode.

    Building the budget tensor copies a host list to the GPU, which (pageable memory) synchronises
    the stream: once per layer and step it stalled the host, and the GPU idled while the host caught up.
    """
    def build():
        budget_list = row_budget_list(density, Mv, Nv)
        return (budget_list, torch.tensor(budget_list, dtype=torch.long, device=device),
                torch.eye(Mv, dtype=torch.bool, device=device))

    if torch.compiler.is_compiling():      # under compile they are constants of the graph
        return build()
    return _cached(_TOPK_CONSTANTS, (density, Mv, Nv, str(device)), build)


HAS_TRITON = importlib.util.find_spec("triton") is not None    # the fused CUDA helpers need it; CPU paths do not
MAX_TILES = 8192     # = kernels.triton_topk.MAX_TILES (that module imports triton; this one must not)


def _fused_topk(scores: torch.Tensor) -> bool:
    """Whether `topk_plan` selects with the fused Triton kernel (CUDA, Triton installed, at most MAX_TILES)."""
    return scores.is_cuda and HAS_TRITON and scores.shape[-1] <= MAX_TILES


@torch.library.custom_op("videosparse::topk_rows", mutates_args=())
def _topk_rows_op(scores: torch.Tensor, budget: torch.Tensor, width: int,
                  num_global_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.triton_topk.topk_rows_triton` as one opaque node for torch.compile."""
    from .kernels.triton_topk import topk_rows_triton

    return topk_rows_triton(scores, budget, width, num_global_tiles)


@_topk_rows_op.register_fake
def _(scores, budget, width, num_global_tiles):
    B, H, Mv, _ = scores.shape
    N = Mv + num_global_tiles
    return (scores.new_empty((B, H, N, width), dtype=torch.int32), scores.new_empty((B, H, N), dtype=torch.int32))


def topk_plan(
    scores: torch.Tensor,
    density: float,
    *,
    num_global_tiles: int = 0,
    block: int = 128,
    select_dtype: torch.dtype = torch.float32,
) -> Plan:
    """Top-k plan from video-tile scores, with the diagonal forced and global tiles always kept.

    Args:
        scores: float [B, H, Mv, Nv] (Mv == Nv), score of key tile j for query tile i over the video
            tiles. Entries of -inf mark columns that may never be chosen (empty/pad tiles), except the forced
            diagonal, which every row keeps whatever its score.
        density: fraction of video key tiles per row, in (0, 1]; per-row budgets from `row_budget_list`.
            The diagonal tile is forced and counted in the budget.
        num_global_tiles: tiles after the video tiles (text); every video row keeps them, and their
            rows attend to every tile.
        block: tokens per tile (block_m == block_n).
        select_dtype: dtype the torch path's top-k compares in. torch.float16 halves its radix select
            (0.36 vs 0.62 ms at 40x591x591 on the H200) for logits: scores closer than fp16's 11 bits
            may swap at the budget boundary, and beyond +-65504 they saturate to +-inf. Keep fp32 for
            probabilities (teacher heat), whose small values fp16 would flush to ties. On CUDA with Triton
            (up to `MAX_TILES` video tiles) one fused kernel selects instead (`kernels.triton_topk`), always in
            fp32 and with ties at the budget boundary going to the lower column.

    Returns:
        A `Plan` over Mv + num_global_tiles query tiles and as many key tiles, with its work order from the
        row budgets (rows whose -inf columns leave them short keep their budget's place).
    """
    if scores.dim() != 4 or scores.shape[-1] != scores.shape[-2]:
        raise ValueError(f"scores must be [B, H, Mv, Mv]; got {tuple(scores.shape)}.")
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density={density} must lie in (0, 1].")
    check_block("block", block)
    B, H, Mv, Nv = scores.shape
    if Mv == 0:
        raise ValueError(f"scores {tuple(scores.shape)} have no video tiles; a plan needs at least one.")
    if isinstance(num_global_tiles, bool) or not isinstance(num_global_tiles, int) or num_global_tiles < 0:
        raise ValueError(f"num_global_tiles={num_global_tiles!r} must be an int >= 0.")
    G = num_global_tiles
    device = scores.device
    budget_list, budget, eye = _topk_constants(density, Mv, Nv, device)    # list, [Mv] int64, [Mv, Mv] bool
    kmax = max(budget_list)
    if _fused_topk(scores):
        width = kmax if G == 0 else Mv + G
        if torch.compiler.is_compiling():
            idx, count = _topk_rows_op(scores, budget, width, G)
        else:       # the kernel itself: the custom op's dispatch would cost ~0.2 ms of host time per call
            from .kernels.triton_topk import topk_rows_triton

            idx, count = topk_rows_triton(scores, budget, width, G)
        lengths = budget_list if G == 0 else [b + G for b in budget_list] + [Mv + G] * G
        return Plan(idx, count, block, block, order=row_order(lengths, B * H, device))
    # NaN -> -inf (topk ranks NaN above the diagonal's +inf), +inf (or a score saturated to it in fp16) -> the largest
    # finite value, so that only the diagonal is +inf and no tie can displace it; one elementwise pass
    s = scores.to(select_dtype).nan_to_num(nan=float("-inf"), posinf=torch.finfo(select_dtype).max,
                                           neginf=float("-inf"))
    s = s.masked_fill(eye, float("inf"))
    # budgets are kmax or kmax - 1 (`row_budget_list`): an unsorted top-kmax, and the rows with
    # kmax - 1 drop their weakest pick (any other spread of budgets takes the ranked top-k)
    spread = kmax - min(budget_list)
    # [B, H, Mv, kmax]; a branch, not sorted=spread > 1: under dynamic shapes that is a SymBool, which topk refuses
    values, indices = s.topk(kmax, dim=-1, sorted=True) if spread > 1 else s.topk(kmax, dim=-1, sorted=False)
    keep = values > float("-inf")
    slot = torch.arange(kmax, device=device)
    if spread == 1:
        weakest = values.argmin(-1, keepdim=True)
        keep &= ~((budget < kmax)[:, None] & (slot == weakest))
    elif spread > 1:
        keep &= slot < budget[:, None]
    idx = torch.where(keep, indices.to(torch.int32), Nv).sort(-1).values
    count = keep.sum(-1, dtype=torch.int32)
    idx = torch.where(idx == Nv, 0, idx)
    if G == 0:
        return Plan(idx.to(torch.int32).contiguous(), count.contiguous(), block, block,
                    order=row_order(budget_list, B * H, device))
    N = Mv + G
    # video rows: selected video tiles then every global tile, packed left
    glob = torch.arange(Mv, N, device=device).expand(B, H, Mv, G)
    width = N
    rows = torch.zeros(B, H, N, width, dtype=torch.long, device=device)
    video_part = torch.cat([idx, torch.zeros(B, H, Mv, width - kmax, dtype=torch.long, device=device)], -1)
    pos = count.long()[..., None] + torch.arange(G, device=device)    # slots after the video picks
    video_part.scatter_(-1, pos, glob)
    rows[:, :, :Mv] = video_part
    rows[:, :, Mv:] = torch.arange(N, device=device)
    counts = torch.cat([count + G, torch.full((B, H, G), N, dtype=torch.int32, device=device)], -1)
    order = row_order([b + G for b in budget_list] + [N] * G, B * H, device)
    return Plan(rows.to(torch.int32).contiguous(), counts.contiguous(), block, block, order=order)   # global: N wide
