"""Sharded-matrix layouts and the exact primitives the optimizers are written against."""

from .comm import CollectiveCounter, Round, collective_counter
from .layout import AxisPlan, Block, ColFlatPiece, ColPiece, FlatPiece, MatrixLayout, RectPiece
from .primitives import axis_sum, col_sums, local_sum, masked_reciprocal, masked_rsqrt, row_sums, scale_into

__all__ = [
    "AxisPlan",
    "Block",
    "ColFlatPiece",
    "ColPiece",
    "FlatPiece",
    "MatrixLayout",
    "RectPiece",
    "Round",
    "CollectiveCounter",
    "collective_counter",
    "axis_sum",
    "col_sums",
    "local_sum",
    "masked_reciprocal",
    "masked_rsqrt",
    "row_sums",
    "scale_into",
]
