"""Ulysses context parallelism for the sparse path.

Under diffusers' context parallelism (`transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=P))`)
every rank holds a contiguous 1/P of the sequence, and the stock attention exchanges q, k, v by one all-to-all so
that each rank sees the whole sequence for H/P heads (rank r: heads [r H/P, (r + 1) H/P)). The sparse path does the
same exchange, builds its tile order, plan and kernel call on the whole sequence of its heads, and exchanges the
output back. Ring attention (`ring_degree > 1`) and `ulysses_anything` (uneven splits) are not served: those calls
run diffusers' own context-parallel attention, dense.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol


@dataclass(frozen=True)
class UlyssesShard:
    """This rank's place in the Ulysses group: `world` ranks, this one `rank` (the group's local rank)."""

    group: object               # torch.distributed ProcessGroup
    world: int
    rank: int

    def heads(self, num_heads: int) -> slice:
        """The heads this rank attends over after `seq_to_heads` (num_heads: all heads of the layer)."""
        local = num_heads // self.world
        return slice(self.rank * local, (self.rank + 1) * local)


def ulysses_shard(parallel_config) -> UlyssesShard | str | None:
    """None without context parallelism; the `UlyssesShard` of a plain Ulysses config; otherwise the reason the
    sparse path cannot serve it (a string)."""
    cp = getattr(parallel_config, "context_parallel_config", None) if parallel_config is not None else None
    if cp is None:
        return None
    if (cp.ring_degree or 1) > 1:
        return f"ring attention (context parallelism with ring_degree={cp.ring_degree}) splits the keys across ranks"
    if getattr(cp, "ulysses_anything", False):
        return "ulysses_anything context parallelism may split the sequence unevenly"
    if (cp.ulysses_degree or 1) <= 1:
        return None
    return UlyssesShard(cp._ulysses_mesh.get_group(), cp.ulysses_degree, cp._ulysses_local_rank)


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    """all-to-all over dim 0 (chunk p goes to rank p; chunk p of the result came from rank p)."""
    shape = x.shape
    out = funcol.all_to_all_single(x.flatten(), None, None, group)
    if isinstance(out, funcol.AsyncCollectiveTensor):
        out = out.wait()
    return out.view(shape)


def gather_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[B, H/P, ...] of every rank -> [B, H, ...] (rank order, so head order), on every rank."""
    out = funcol.all_gather_tensor(x.contiguous(), 1, group)
    return out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out


def seq_to_heads(x: torch.Tensor, shard: UlyssesShard) -> torch.Tensor:
    """[B, S/P, H, D] (this rank's tokens, all heads) -> [B, S, H/P, D] (all tokens, this rank's heads)."""
    B, S_local, H, D = x.shape
    P = shard.world
    x = x.reshape(B, S_local, P, H // P, D).permute(2, 0, 1, 3, 4).contiguous()      # [P, B, S/P, H/P, D]
    return _exchange(x, shard.group).transpose(0, 1).reshape(B, P * S_local, H // P, D)


def heads_to_seq(x: torch.Tensor, shard: UlyssesShard) -> torch.Tensor:
    """[B, S, H/P, D] -> [B, S/P, H, D], the inverse of `seq_to_heads`."""
    B, S, H_local, D = x.shape
    P = shard.world
    x = x.reshape(B, P, S // P, H_local, D).transpose(0, 1).contiguous()            # [P, B, S/P, H/P, D]
    return _exchange(x, shard.group).permute(1, 2, 0, 3, 4).reshape(B, S // P, P * H_local, D)
