"""Blockwise int8 for parameters on their way between hosts: stateless encode and decode, testable without a group.

[Note: int8 blocks] A gathered parameter crosses the link as int8 with one fp32 scale per ``INT8_BLOCK`` elements
(the block's largest magnitude over 127), as ZeRO++'s quantized weights (qwZ) do: 1 + 4/256 bytes an element against
4, and an error per element of at most half a step of its block. Blocks of a few hundred elements keep one outlier
from coarsening a whole tensor. Every rank -- the one that sent a block included -- decodes the same bytes, so
every replica computes with the same weights; the optimizer's masters never see the rounding.
"""

from __future__ import annotations

import torch

INT8_BLOCK = 256  # elements per scale
_LEVELS = 127.0


def int8_frame_bytes(numel: int) -> int:
    """Bytes of ``numel`` elements encoded: the int8 values (padded to whole blocks), then the blocks' fp32 scales."""
    blocks = -(-numel // INT8_BLOCK)
    return blocks * INT8_BLOCK + 4 * blocks


def encode_int8(values: torch.Tensor, frame: torch.Tensor) -> None:
    """The 1-D floating-point ``values`` into the uint8 ``frame`` of ``int8_frame_bytes(values.numel())`` bytes."""
    numel = values.numel()
    blocks = -(-numel // INT8_BLOCK)
    padded = torch.zeros(blocks * INT8_BLOCK, dtype=torch.float32, device=values.device)
    padded[:numel].copy_(values)
    rows = padded.view(blocks, INT8_BLOCK)
    scales = rows.abs().amax(dim=1).div_(_LEVELS).clamp_min_(torch.finfo(torch.float32).tiny)
    rows.div_(scales.unsqueeze(1)).round_().clamp_(-_LEVELS, _LEVELS)
    frame[: blocks * INT8_BLOCK].view(torch.int8).copy_(padded)
    frame[blocks * INT8_BLOCK : blocks * (INT8_BLOCK + 4)].view(torch.float32).copy_(scales)


def decode_int8(frame: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``numel`` values of ``dtype`` from a frame ``encode_int8`` wrote."""
    blocks = -(-numel // INT8_BLOCK)
    values = frame[: blocks * INT8_BLOCK].view(torch.int8).view(blocks, INT8_BLOCK).to(torch.float32)
    scales = frame[blocks * INT8_BLOCK : blocks * (INT8_BLOCK + 4)].view(torch.float32)
    return values.mul_(scales.unsqueeze(1)).view(-1)[:numel].to(dtype)
