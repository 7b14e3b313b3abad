"""Test and benchmark helpers: emulated multi-host clusters on one Linux machine, and
(``tf_poseidon.testing.loopback``) the ranks of a job as threads of one process.

Not imported by ``tf_poseidon`` itself. The clusters need root and ``ip``/``tc`` (iproute2);
:func:`available` says whether this machine allows it.
"""

from tf_poseidon.testing.emulated_cluster import EmulatedCluster, ShapedLoopback, available
from tf_poseidon.testing.netns import NetnsError

__all__ = ["EmulatedCluster", "ShapedLoopback", "available", "NetnsError"]
