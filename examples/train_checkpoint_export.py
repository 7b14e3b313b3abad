"""Train on the digits (examples/data/) with checkpoints, resume at any number of ranks, export.

    tfposeidon-run -np 2 python examples/train_checkpoint_export.py --epochs 3
    tfposeidon-run -np 3 python examples/train_checkpoint_export.py --epochs 6 --resume
    python examples/train_checkpoint_export.py --epochs 8 --resume

Everything is written under --output-dir (default: digits_output/ in the working directory).
The first run writes digits_output/checkpoints/epoch01.keras ... epoch03.keras (rank 0 writes,
atomically) and exports the trained model to digits_output/export/1; the second continues from
the latest checkpoint, with 3 ranks instead of 2, and exports digits_output/export/2; the third
does the same in one process. The global batch stays the same whatever the number of ranks, so
sync training continues exactly as an uninterrupted run would. Serve the exports with
TensorFlow Serving (docs/checkpoints.md):

    docker run -p 8501:8501 -v "$PWD/digits_output/export:/models/digits" -e MODEL_NAME=digits \
        tensorflow/serving
"""

from __future__ import annotations

import argparse
import os
import re

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

import tf_poseidon as tp  # noqa: E402
from tf_poseidon import callbacks as tp_callbacks  # noqa: E402
from tf_poseidon.export import export_for_serving  # noqa: E402
from train_digits import build_model, load_data  # noqa: E402

CHECKPOINT = "epoch{epoch:02d}.keras"


def latest_checkpoint(directory: str) -> tuple[str, int] | None:
    """(path, epoch) of the newest ``epochNN.keras`` in ``directory``, or None."""
    if not os.path.isdir(directory):
        return None
    epochs = [int(m.group(1)) for m in map(re.compile(r"epoch(\d+)\.keras").fullmatch,
                                           os.listdir(directory)) if m]
    if not epochs:
        return None
    epoch = max(epochs)
    return os.path.join(directory, CHECKPOINT.format(epoch=epoch)), epoch


def new_or_resumed_model(args: argparse.Namespace, strategy) -> tuple[keras.Model, int]:
    """The model to train and the number of epochs it has done. Every rank reads the same
    checkpoint (a shared filesystem, or a copy of rank 0's file on each host)."""
    latest = latest_checkpoint(args.checkpoint_dir) if args.resume else None
    with strategy.scope():
        if latest is not None:
            path, epoch = latest
            if tp.is_chief():
                print(f"resuming from {path} on {tp.size()} rank(s)")
            return keras.models.load_model(path), epoch  # weights, optimizer state, compile
        model = build_model()
        model.compile(optimizer=keras.optimizers.Adam(args.learning_rate),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        return model, 0


def main(args: argparse.Namespace) -> None:
    keras.utils.set_random_seed(args.seed)
    x_train, y_train, x_test, y_test = load_data(args.seed)
    strategy = tp.PoseidonStrategy()
    model, done = new_or_resumed_model(args, strategy)
    checkpoint = tp_callbacks.ModelCheckpoint(os.path.join(args.checkpoint_dir, CHECKPOINT))
    model.fit(x_train, y_train, batch_size=args.batch_size, initial_epoch=done,
              epochs=args.epochs, shuffle=False, callbacks=[checkpoint], verbose=args.verbose)
    _, accuracy = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
    path = export_for_serving(model, args.export_dir)  # every rank calls it; rank 0 writes
    if tp.is_chief():
        print(f"test accuracy: {accuracy:.4f} after {args.epochs} epochs; exported to {path}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5, help="total epochs, resumed ones too")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in --checkpoint-dir")
    parser.add_argument("--output-dir", default="digits_output",
                        help="where checkpoints/ and export/ go (default: %(default)s)")
    parser.add_argument("--checkpoint-dir", help="default: OUTPUT_DIR/checkpoints")
    parser.add_argument("--export-dir", help="default: OUTPUT_DIR/export")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", type=int, default=2, choices=[0, 1, 2])
    args = parser.parse_args(argv)
    args.checkpoint_dir = args.checkpoint_dir or os.path.join(args.output_dir, "checkpoints")
    args.export_dir = args.export_dir or os.path.join(args.output_dir, "export")
    return args


if __name__ == "__main__":
    main(parse_args())
