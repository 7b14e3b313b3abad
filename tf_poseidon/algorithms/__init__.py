"""Training algorithms: how the ranks' local work becomes the update every rank applies.

``PoseidonStrategy(algorithm=tp.algorithms.SSP(staleness=2))``, or by name with the keyword
form ``PoseidonStrategy(mode="ssp", staleness=2)``. Built in: :class:`Sync` (``"sync"``, the
default), :class:`SSP` (``"ssp"``), :class:`EASGD` (``"easgd"``). base.py states the contract;
a new algorithm is one module registered with :func:`register` (docs/architecture.md).
"""

from tf_poseidon.algorithms.base import Algorithm, AlgorithmContext, AlgorithmImpl
from tf_poseidon.algorithms.registry import from_mode, names, register
from tf_poseidon.algorithms.sync import Sync
from tf_poseidon.algorithms.ssp import SSP
from tf_poseidon.algorithms.easgd import EASGD

__all__ = ["Algorithm", "AlgorithmContext", "AlgorithmImpl", "register", "names", "from_mode",
           "Sync", "SSP", "EASGD"]
