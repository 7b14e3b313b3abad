"""tf_poseidon: data-parallel training for TensorFlow 2 / Keras 3 over MPI.

```python
import tf_poseidon as tp
strategy = tp.PoseidonStrategy()
with strategy.scope():
    model = make_model(); model.compile(...)
model.fit(x, y, batch_size=GLOBAL_BATCH)
```
launched with ``mpirun -np 4 python train.py`` (or plain ``python train.py``).

Importing the package reads the world from the launcher's variables and places this process
(its GPU, its share of the host's cores; see placement.py) before TensorFlow starts; TensorFlow
itself is imported only when the strategy (or ``tp.ops``) is first used, so ``tfposeidon-run``
and ``tp.rank()`` stay fast.
"""

import importlib

from tf_poseidon import placement as _placement
from tf_poseidon import world as _world
from tf_poseidon.world import WorldError, is_chief, local_rank, local_size, rank, size

_placement.configure_process(_world.world())

__version__ = "0.1.0"

__all__ = ["PoseidonStrategy", "WorldError", "rank", "size", "local_rank", "local_size",
           "is_chief", "algorithms", "codecs", "ops", "callbacks", "export_for_serving",
           "PowerSGD", "profiling"]

# attribute -> (module it comes from, name in it; None: the attribute is the module itself)
_LAZY = {"PoseidonStrategy": ("tf_poseidon.strategy", "PoseidonStrategy"),
         "algorithms": ("tf_poseidon.algorithms", None),
         "codecs": ("tf_poseidon.comm.codecs", None),
         "ops": ("tf_poseidon.ops", None),
         "callbacks": ("tf_poseidon.callbacks", None),
         "export_for_serving": ("tf_poseidon.export", "export_for_serving"),
         "PowerSGD": ("tf_poseidon.lowrank", "PowerSGD"),
         "profiling": ("tf_poseidon.profiling", None)}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'tf_poseidon' has no attribute {name!r}")
    module, attribute = _LAZY[name]
    module = importlib.import_module(module)
    return module if attribute is None else getattr(module, attribute)
