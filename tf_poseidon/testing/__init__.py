"""Test and benchmark helpers: emulated multi-host clusters on one Linux machine.

Not imported by ``tf_poseidon`` itself. Needs root and ``ip``/``tc`` (iproute2);
:func:`available` says whether this machine allows it.
"""

from tf_poseidon.testing.emulated_cluster import EmulatedCluster, ShapedLoopback, available
from tf_poseidon.testing.netns import NetnsError

__all__ = ["EmulatedCluster", "ShapedLoopback", "available", "NetnsError"]
