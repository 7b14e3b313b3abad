"""``tp.PowerSGD``: the knobs of low-rank compression, and which gradients it can carry."""

from __future__ import annotations

import math
from typing import Sequence

CHOICES = ("auto", "always")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def matrix_shape(shape: Sequence[int | None] | None) -> tuple[int, int] | None:
    """The [m, n] matrix a gradient of ``shape`` is compressed as — its last dimension is n,
    the others flattened into m (a convolution kernel [kh, kw, c_in, c_out] is
    [kh·kw·c_in, c_out]) — or None for a scalar, a vector or a shape not fully known."""
    if shape is None or len(shape) < 2 or any(d is None for d in shape):
        return None
    return math.prod(int(d) for d in shape[:-1]), int(shape[-1])


class PowerSGD:
    """Low-rank compression of matrix-shaped gradients with error feedback (PowerSGD).

    ``PoseidonStrategy(lowrank=tp.PowerSGD(rank=4))``. Per matrix gradient M [m, n] and step,
    every rank adds its residual to M, computes P = M·Q, the ranks sum P, orthonormalize it,
    compute Q = Mᵀ·P, sum Q, and every rank applies P·Qᵀ; each keeps what that missed of its M
    as its next residual (tf_poseidon/lowrank/protocol.py). Bytes per rank and step: those of
    two all-reduces of (m + n)·r values instead of m·n.

    Args:
      rank: r, the approximation's rank (a matrix uses min(r, m, n)). Higher is more accurate
        and sends more; 1–4 is usual.
      start_step: steps at the start of training in which the gradients the plan chose for
        low-rank are summed exactly (PyTorch's ``start_powerSGD_iter``): the first steps are the
        most sensitive to approximate gradients.
      min_compression: a matrix is compressed only if m·n / ((m + n)·r) is at least this
        (PyTorch's ``min_compression_rate``); others, and vectors, are all-reduced. Below 1,
        matrices that low-rank sends in more bytes than all-reduce qualify too.
      choice: "auto" — the per-layer cost model picks low-rank for a matrix when its estimated
        time is the lowest of the layer's protocols (all-reduce, SFB, low-rank) at the measured
        or given bandwidth; "always" — every matrix that meets ``min_compression``.

    Raises:
      ValueError: a knob has an invalid value (the message names it and what is allowed).
    """

    def __init__(self, rank: int = 4, start_step: int = 10, min_compression: float = 2.0,
                 choice: str = "auto"):
        if not _is_int(rank) or rank < 1:
            raise ValueError(f"tp.PowerSGD: rank={rank!r} is not valid; it must be an integer "
                             ">= 1 (1 to 4 is usual).")
        if not _is_int(start_step) or start_step < 0:
            raise ValueError(f"tp.PowerSGD: start_step={start_step!r} is not valid; it must be "
                             "an integer >= 0 (the steps summed exactly before compressing).")
        if (isinstance(min_compression, bool) or not isinstance(min_compression, (int, float))
                or not 0.0 < min_compression < math.inf):
            raise ValueError(f"tp.PowerSGD: min_compression={min_compression!r} is not valid; "
                             "it must be a positive number (m·n / ((m+n)·rank) a matrix must "
                             "reach to be compressed; below 1, low-rank may send more than "
                             "all-reduce).")
        if choice not in CHOICES:
            raise ValueError(f"tp.PowerSGD: choice={choice!r} is not valid; allowed values are "
                             + ", ".join(repr(c) for c in CHOICES) + ".")
        self.rank = rank
        self.start_step = start_step
        self.min_compression = float(min_compression)
        self.choice = choice

    def matrix_rank(self, m: int, n: int) -> int:
        """The rank used for an m×n matrix: min(rank, m, n)."""
        return min(self.rank, m, n)

    def compression(self, m: int, n: int) -> float:
        """m·n / ((m + n)·r): how many times fewer values travel than by all-reduce."""
        return m * n / ((m + n) * self.matrix_rank(m, n))

    def refusal(self, m: int, n: int) -> str | None:
        """Why an m×n matrix is not compressed (None: it is eligible)."""
        rate = self.compression(m, n)
        if rate < self.min_compression:
            return (f"low-rank compresses {rate:.3g}x < min_compression "
                    f"{self.min_compression:g}")
        return None

    def options(self) -> dict:
        return {"rank": self.rank, "start_step": self.start_step,
                "min_compression": self.min_compression, "choice": self.choice}

    def __repr__(self) -> str:
        return "PowerSGD(" + ", ".join(f"{k}={v!r}" for k, v in self.options().items()) + ")"

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.options() == self.options()

    def __hash__(self) -> int:
        return hash(tuple(self.options().items()))
