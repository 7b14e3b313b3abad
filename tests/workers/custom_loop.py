"""The custom training step the test workers share: ``strategy.run`` + ``GradientTape`` +
``apply_gradients`` with TensorFlow's loss convention (per-example losses averaged over the
global batch, regularization losses scaled by 1/replicas), for classifiers with logits."""

import keras
import tensorflow as tf


def train_step(strategy, model, optimizer, global_batch: int, sum_loss: bool = True):
    """A ``tf.function`` ``step(x, y)`` that trains ``model`` on one distributed batch.

    With ``sum_loss`` it returns the loss summed over replicas (a collective every step);
    without, it returns None, so ranks that may run ahead of each other (SSP) are not tied
    together by a per-step reduction.
    """
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    @tf.function
    def step(x, y):
        def replica_fn(x, y):
            with tf.GradientTape() as tape:
                per_example = loss_fn(y, model(x, training=True))
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
                if model.losses:
                    loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        per_replica_loss = strategy.run(replica_fn, args=(x, y))
        if sum_loss:
            return strategy.reduce("SUM", per_replica_loss, axis=None)
        return None

    return step
