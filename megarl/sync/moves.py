"""Moves and buckets: the pieces every engine worker needs, each with the trainer rank it comes from, grouped into
buckets bounded per receiver. Pure and deterministic: every rank derives the same list from the same needs and
holdings (megarl.sync.shards), so nothing of the plan travels per update.

`plan_moves` intersects needs with holdings and picks one source per piece (the receiving rank itself when it holds
it, else the least-loaded holder), so that every engine worker receives exactly its shard and no rank receives or
forwards anything else. `bucket_moves` groups the moves into buckets bounded per receiving rank; a tensor larger than
a bucket is cut into row blocks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping as TMapping, Sequence

from megarl.sync.boxes import Box, box_numel, intersect, split_rows


@dataclass(frozen=True)
class Move:
    """Piece `box` of HF tensor `hf`, from trainer rank `src` to the rank `dst` that hosts the engine worker needing
    it (src == dst: a local copy)."""

    hf: str
    src: int
    dst: int
    box: Box
    holding: Box  # the box the source holds (the piece is cut from it)
    nbytes: int


def plan_moves(order: Sequence[str], needs: TMapping[int, TMapping[str, Box]], holdings: TMapping[str, list],
               element_bytes: TMapping[str, int]) -> list:
    """Every piece each receiving rank needs, with its source. Deterministic: every rank computes the same list.

    needs: {receiving rank: {hf_name: box}}; holdings: trainer_holdings(...); element_bytes: {hf_name: bytes}."""
    load: dict = {}
    moves = []
    wanted: dict = {}
    for dst in sorted(needs):
        for hf_name, want in needs[dst].items():
            wanted.setdefault(hf_name, []).append((dst, want))
    for hf_name in order:
        distinct: dict = {}  # the tensor's disjoint chunks, each with the ranks holding it
        for rank, box in holdings.get(hf_name, ()):
            distinct.setdefault(box, set()).add(rank)
        distinct = {box: sorted(ranks) for box, ranks in distinct.items()}
        for dst, want in wanted.get(hf_name, ()):
            covered, numel = 0, box_numel(want)
            for held, ranks in distinct.items():
                piece = want if held == want else intersect(want, held)
                if piece is None:
                    continue
                src = dst if dst in ranks else min(ranks, key=lambda r: (load.get(r, 0), abs(r - dst), r))
                size = numel if piece is want else box_numel(piece)
                nbytes = size * element_bytes[hf_name]
                if src != dst:
                    load[src] = load.get(src, 0) + nbytes
                moves.append(Move(hf_name, src, dst, piece, held, nbytes))
                covered += size
                if covered == numel:  # the chunks are disjoint: nothing else intersects
                    break
            if covered != numel:
                raise ValueError(f"{hf_name}: the trainer ranks hold {covered} of the {box_numel(want)} elements "
                                 f"engine rank {dst} needs (box {want}); the layouts do not fit together")
    return moves


def bucket_moves(moves: Sequence[Move], bucket_bytes: int) -> list:
    """Consecutive buckets of moves; each receiving rank gets at most bucket_bytes per bucket. A tensor whose pieces
    for one rank exceed a bucket is cut into row blocks, one bucket or more of its own."""
    by_tensor: dict = {}
    for mv in moves:
        by_tensor.setdefault(mv.hf, []).append(mv)
    buckets, current, fill = [], [], {}
    for group in by_tensor.values():
        need: dict = {}
        for mv in group:
            need[mv.dst] = need.get(mv.dst, 0) + mv.nbytes
        if any(fill.get(d, 0) + b > bucket_bytes for d, b in need.items()) and current:
            buckets.append(current)
            current, fill = [], {}
        if max(need.values()) <= bucket_bytes:
            current.extend(group)
            for d, b in need.items():
                fill[d] = fill.get(d, 0) + b
            continue
        for block in _cut(group, bucket_bytes):  # larger than a bucket: blocks of their own
            buckets.append(block)
    if current:
        buckets.append(current)
    return buckets


def _cut(group: Sequence[Move], bucket_bytes: int) -> list:
    pieces = []
    for mv in group:
        per = mv.nbytes // box_numel(mv.box)
        for box in split_rows(mv.box, max(1, bucket_bytes // per)):
            pieces.append(Move(mv.hf, mv.src, mv.dst, box, mv.holding, box_numel(box) * per))
    blocks, current, fill = [], [], {}
    for mv in pieces:
        if fill.get(mv.dst, 0) + mv.nbytes > bucket_bytes and current:
            blocks.append(current)
            current, fill = [], {}
        current.append(mv)
        fill[mv.dst] = fill.get(mv.dst, 0) + mv.nbytes
    if current:
        blocks.append(current)
    return blocks


def traffic(moves: Iterable[Move]) -> tuple:
    """({rank: bytes sent to other ranks}, {rank: bytes received from other ranks}, {rank: bytes its engine worker
    loads})."""
    sent, received, loaded = {}, {}, {}
    for mv in moves:
        loaded[mv.dst] = loaded.get(mv.dst, 0) + mv.nbytes
        if mv.src != mv.dst:
            sent[mv.src] = sent.get(mv.src, 0) + mv.nbytes
            received[mv.dst] = received.get(mv.dst, 0) + mv.nbytes
    return sent, received, loaded
