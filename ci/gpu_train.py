"""One rank of examples/train_digits.py for ci/check_gpu.sh: logs tf_poseidon's placement, trains,
and checks where the rank ran (not a test).

    tfposeidon-run -np 2 python ci/gpu_train.py --expect gpu [train_digits arguments]

``--expect gpu``: the rank must see exactly one GPU, run its ops there, (when the job has more
ranks on this host than GPUs) have memory growth on, and take the device-side data path: its
all-reduce buckets packed on the GPU (comm/datapath.py logs that once per process, which is
what is checked, so a silent fall-back to the host form fails) by the compiled ops' GPU kernel
(a ``pack`` under ``/GPU:0`` must run there: without a GPU kernel TensorFlow would place it on
the CPU). ``--expect cpu``: no GPU. Prints "rank R: ..." lines; exit status 1 if a check fails.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
logging.getLogger("tf_poseidon").setLevel(logging.INFO)
DEVICE_PACK_LOG = "all-reduce buckets are packed on the GPU"  # comm/datapath.py's log line


class _Messages(logging.Handler):
    """Keeps the messages logged by tf_poseidon in this process."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(record.getMessage())


_messages = _Messages()
logging.getLogger("tf_poseidon").addHandler(_messages)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import train_digits  # noqa: E402  (imports keras, then tf_poseidon: placement happens here)

import tensorflow as tf  # noqa: E402

import tf_poseidon as tp  # noqa: E402
from tf_poseidon import ops, placement  # noqa: E402
from tf_poseidon.world import world  # noqa: E402


def main(argv: list[str]) -> int:
    expect = argv[argv.index("--expect") + 1]
    rest = [a for i, a in enumerate(argv) if a != "--expect" and argv[i - 1:i] != ["--expect"]]
    chosen = placement.configure_process(world())
    gpus = tf.config.list_logical_devices("GPU")
    device = (tf.constant(1.0) + 1.0).device
    problems = []
    if expect == "gpu":
        if len(gpus) != 1 or not device.endswith("GPU:0"):
            problems.append(f"expected one GPU and ops on it, got {gpus} and {device}")
        physical = tf.config.get_visible_devices("GPU")
        growth = (os.environ.get("TF_FORCE_GPU_ALLOW_GROWTH") == "true"
                  or bool(physical and tf.config.experimental.get_memory_growth(physical[0])))
        if chosen.memory_growth != growth or (tp.local_size() > 1 and not growth):
            problems.append(f"memory growth {growth}, placement says {chosen.memory_growth}")
        with tf.device("/GPU:0"):
            packed = ops.pack([tf.ones([3])], tf.float16).device
        if not packed.endswith("GPU:0"):
            problems.append(f"pack under /GPU:0 ran on {packed}: no GPU kernel in the ops")
    elif gpus:
        problems.append(f"expected no GPU, got {gpus}")
    accuracy = train_digits.train(train_digits.parse_args(rest))
    device_packed = any(DEVICE_PACK_LOG in message for message in _messages.seen)
    if expect == "gpu" and not device_packed:
        problems.append("the all-reduce buckets were not packed on the GPU (no "
                        f"'{DEVICE_PACK_LOG}' logged): the host form ran")
    print(f"rank {tp.rank()}: {chosen.describe(world())}; ops on {device}; buckets packed on "
          f"the GPU: {'yes' if device_packed else 'no'}; accuracy {accuracy:.4f}")
    for problem in problems:
        print(f"rank {tp.rank()}: FAIL {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
