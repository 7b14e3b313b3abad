"""tf_poseidon: data-parallel training for TensorFlow 2 / Keras 3 over MPI.

```python
import tf_poseidon as tp
strategy = tp.PoseidonStrategy()
with strategy.scope():
    model = make_model(); model.compile(...)
model.fit(x, y, batch_size=GLOBAL_BATCH)
```
launched with ``mpirun -np 4 python train.py`` (or plain ``python train.py``).
"""

from tf_poseidon import keras_integration as _keras_integration
from tf_poseidon.strategy import PoseidonStrategy
from tf_poseidon.world import WorldError, is_chief, local_rank, local_size, rank, size

_keras_integration.install()

__version__ = "0.1.0"

__all__ = ["PoseidonStrategy", "WorldError", "rank", "size", "local_rank", "local_size",
           "is_chief"]
