"""tf_poseidon: data-parallel training for TensorFlow 2 / Keras 3 over MPI."""

from tf_poseidon.world import is_chief, local_rank, local_size, rank, size

__all__ = ["rank", "size", "local_rank", "local_size", "is_chief"]
