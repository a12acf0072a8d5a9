"""Feed-forward blocks of the PVT family."""
from typing import Tuple

import torch
import torch.nn as nn

from .conv import token_conv


class PVTMlp(nn.Module):
    """``fc1 -> [ReLU] -> [DWConv 3x3] -> GELU -> fc2`` on tokens.

    With ``dwconv=False`` this is PVT v1's plain MLP; with ``dwconv=True`` PVTv2's
    depth-wise-conv MLP (the conv sees the ``hw_shape`` map of the hidden tokens), and
    ``linear=True`` adds PVTv2-li's ReLU after ``fc1``.

    Args:
        in_features: input/output channels ``C``.
        hidden_features: hidden channels.
        drop: dropout after the activation and after ``fc2``.
        dwconv: insert the 3x3 depth-wise conv (PVTv2).
        linear: ReLU after ``fc1`` (PVTv2-li).
    """

    def __init__(self, in_features: int, hidden_features: int, drop: float = 0.,
                 dwconv: bool = True, linear: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.relu = nn.ReLU() if linear else nn.Identity()
        self.dwconv = nn.Conv2d(hidden_features, hidden_features, 3, 1, 1,
                                groups=hidden_features) if dwconv else None
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_features, in_features)
        self.drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor, hw_shape: Tuple[int, int]) -> torch.Tensor:
        x = self.relu(self.fc1(x))
        if self.dwconv is not None:
            x = token_conv(self.dwconv, x, hw_shape)  # channels-last view, no copies
        x = self.drop(self.act(x))
        return self.drop(self.fc2(x))
