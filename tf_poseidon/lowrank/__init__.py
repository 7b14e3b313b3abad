"""Low-rank gradient compression: PowerSGD with error feedback (Vogels et al., NeurIPS 2019).

A matrix-shaped gradient M [m, n] (a Dense kernel; a convolution kernel viewed as
[kh·kw·c_in, c_out]) is summed over ranks as a rank-r approximation: two all-reduces of thin
matrices, P [m, r] and Q [n, r], instead of one of M. Each rank keeps what the approximation
missed (its *residual*) and adds it to its next gradient, so nothing is lost, only delayed.

* ``options.py`` — :class:`PowerSGD`, the user's knobs (``PoseidonStrategy(lowrank=...)``):
  rank, warm-up steps, minimum compression, how the per-layer plan chooses.
* ``protocol.py`` — the ``"lowrank"`` bucket protocol: the two rounds on the engine thread,
  the residuals and Q kept between steps, and their checkpoint form.
* ``blas.py`` — numpy's BLAS at one thread while the protocol computes.

Which gradients go low-rank is the per-layer plan's choice (tf_poseidon/sacp/), next to
all-reduce and SFB; docs/compression.md says when to use it.
"""

from tf_poseidon.lowrank.options import PowerSGD, matrix_shape
from tf_poseidon.lowrank.protocol import KIND, LowRankProtocol

__all__ = ["PowerSGD", "matrix_shape", "KIND", "LowRankProtocol"]
