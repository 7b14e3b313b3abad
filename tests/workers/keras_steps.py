"""Worker for Keras features around the train step: a model's own train_step/test_step (the
Keras guide's pattern) and compile(jit_compile=True).

    keras_steps.py OUT

Configurations (each trained with fit for 2 epochs of 10 global batches of 60, then
evaluated and, for the Sequential ones, predicted):
  guide        a subclassed model whose train_step/test_step update the compiled metrics
               and return {m.name: m.result()}
  guide-xla    the same with jit_compile=True
  guide-draws  the same model with Dropout after its hidden layer, and a train_step that adds
               noise of its own to the input (keras.random.normal, on pixels picked with
               keras.random.randint, from a seed generator of the model)
  guide-bn     the same model with a BatchNormalization layer on its input (default mode: each
               rank normalizes with its own rows, the moving statistics are combined)
  cnn-xla      a Sequential CNN with Adam and jit_compile=True (Keras' own steps)
  cnn-plain    the same without XLA (only in a world of one: how far XLA alone moves the
               results, the scale the XLA comparison is measured against)
  cnn-augmented  the CNN without XLA, fit on a tf.data pipeline of global batches that a
               seeded RandomFlip layer augments (a stateful map: its seed generator's state),
               a stateless map then scales (tf.data parallelizes it on its own) and a
               prefetch ends
  cnn-augmented-keras  the same in plain Keras, no strategy (only in a world of one: the
               reference; Keras then never peeks at the pipeline before fit)
  augmenting-layers  the CNN without XLA whose first layers augment each image (RandomRotation,
               RandomZoom, RandomTranslation, RandomContrast, RandomBrightness);
               augmenting-layers-keras the same in plain Keras (only in a world of one)
  stateful     a stateful LSTM over the images' rows (8 steps of 8), Keras' own steps, built
               for the global batch as in one process (keras.Input(batch_size=75): the
               ranks' shares differ at P=2); it predicts 2 global batches (a stateful model
               takes no partial batch), then is exported (Model.export) to OUT/stateful_export
               and served there (``served``: rank 0's outputs of two calls on the first
               global batch; an exported stateful model carries its states on)
  stateful-rank-batch  the stateful LSTM built for the rank's share of the global batch
               (75 // P rows) and fit with batch_size=75 (``message``: the ValueError's text)
  retrieval    two towers (the images' top and bottom rows) whose train_step scores each
               query against the items of the whole global batch (in-batch negatives, every
               rank's items through the replica context's all_gather); fit only (the
               weights, and ``initial``: before fit)
  gan          the Keras guide's GAN (GAN below; no call() of its own), fit only (the
               weights, History's d_loss and g_loss); gan-keras the same in plain Keras (only
               in a world of one)
  on-batch     an MLP with Dropout trained by 12 train_on_batch calls on batches of 49 rows
               drawn with a seeded NumPy generator (every other call with a class_weight),
               then test_on_batch and predict_on_batch on 49 rows, and evaluate and predict
               on them (``evaluated``, ``predicted``); on-batch-keras the same in plain Keras
               (only in a world of one); on-batch-easgd the same under EASGD (tau=2)
  on-batch-mismatch  one train_on_batch call with each rank's own rows (``message``: the
               ValueError's text, "" if none was raised)
Writes OUT/<config>_rank<r>.npz on every rank: the weights, History's loss and accuracy, each
training batch's accuracy, evaluate's results, predict's outputs (gathered from every rank),
the non-trainable weights (``non_trainable``; ``moving_mean`` of the guide's BN layer),
``own_predictions``: this rank's model called on the predicted rows, no communication (not for
stateful), and ``states``: the stateful LSTM's h and c after all that (this rank's rows). With
KERAS_STEPS_XLA_DUMP=DIR, XLA writes the modules it compiles to DIR/rank<r>.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tf_poseidon as tp  # noqa: E402  (does not import TensorFlow yet)

if os.environ.get("KERAS_STEPS_XLA_DUMP"):
    os.environ["XLA_FLAGS"] = (f"--xla_dump_to={os.environ['KERAS_STEPS_XLA_DUMP']}/"
                               f"rank{tp.rank()}")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

GLOBAL_BATCH = 60
ROWS = 600
ON_BATCH = 49  # an odd batch: the ranks' shares differ at P=2
STATEFUL_BATCH = 75  # divides ROWS (a stateful RNN takes no partial batch), odd


def data():
    rng = np.random.default_rng(11)
    x = rng.normal(size=(ROWS, 8, 8, 1)).astype("float32")
    y = (x[:, :4].sum((1, 2, 3)) > 0).astype("int32") + (x[:, 4:].mean((1, 2, 3)) > 0.1)
    return x, y.astype("int32")


class GuideModel(keras.Model):
    """The Keras guide's custom step ("Customizing what happens in fit()", TensorFlow): the
    compiled loss and metrics, updated and read by the model's own train_step/test_step, plus
    ``unscaled_loss``, fed the loss as docs/synchronization.md shows for one process's value
    (as Keras' default step feeds its tracker). With ``batchnorm``, the flattened input is
    normalized by a BatchNormalization layer (``self.norm``): its moving mean depends on the
    data only, not on the weights. With ``draws``, a Dropout layer follows the hidden one and
    the training step draws noise for its batch from the model's own seed generator."""

    def __init__(self, batchnorm: bool = False, draws: bool = False):
        super().__init__()
        self.flatten = keras.layers.Flatten()
        self.norm = keras.layers.BatchNormalization(momentum=0.9) if batchnorm else None
        self.hidden = keras.layers.Dense(32, activation="relu")
        self.dropout = keras.layers.Dropout(0.3) if draws else None
        self.noise = keras.random.SeedGenerator(5) if draws else None
        self.out = keras.layers.Dense(3)
        self.unscaled_loss = keras.metrics.Mean(name="unscaled_loss")

    def call(self, x, training=False):
        x = self.flatten(x)
        if self.norm is not None:
            x = self.norm(x, training=training)
        x = self.hidden(x)
        return self.out(x if self.dropout is None else self.dropout(x, training=training))

    def train_step(self, data):
        x, y = data
        if self.noise is not None:  # noise on about half of the pixels of each image
            x = x + keras.random.normal(tf.shape(x), stddev=0.5, seed=self.noise) * tf.cast(
                keras.random.randint(tf.shape(x), 0, 2, seed=self.noise), x.dtype)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        return self.update_metrics(x, y, y_pred, loss)

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        return self.update_metrics(x, y, y_pred, self.compute_loss(y=y, y_pred=y_pred))

    def update_metrics(self, x, y, y_pred, loss) -> dict:
        """The guide's metric updates and results."""
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            elif metric is self.unscaled_loss:
                metric.update_state(loss * self.distribute_strategy.num_replicas_in_sync,
                                    sample_weight=tf.shape(x)[0])
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class GAN(keras.Model):
    """The Keras guide's GAN ("Customizing what happens in fit()", TensorFlow): a model with no
    call() of its own whose train_step trains a discriminator and a generator, each with its
    own optimizer, on latent vectors drawn for the batch from the model's seed generator. The
    guide draws its label noise once for the concatenated (fake, real) labels, whose first
    dimension is twice the rank's rows; here it is drawn for each half, so that each is a draw
    by rows (docs/synchronization.md, "Random layers")."""

    LATENT = 4

    def __init__(self):
        super().__init__()
        self.discriminator = keras.Sequential([
            keras.Input((64,)), keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(1)])
        self.generator = keras.Sequential([
            keras.Input((self.LATENT,)), keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(64)])
        self.d_loss = keras.metrics.Mean(name="d_loss")
        self.g_loss = keras.metrics.Mean(name="g_loss")
        self.seed_generator = keras.random.SeedGenerator(1337)

    @property
    def metrics(self):
        return [self.d_loss, self.g_loss]

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    def latent(self, rows):
        return keras.random.normal((rows, self.LATENT), seed=self.seed_generator)

    def labels(self, rows, value: float):
        return value + 0.05 * keras.random.uniform((rows, 1), seed=self.seed_generator)

    def train_step(self, real):
        real = tf.reshape(real, (-1, 64))
        rows = tf.shape(real)[0]
        combined = tf.concat([self.generator(self.latent(rows)), real], 0)
        labels = tf.concat([self.labels(rows, 1.0), self.labels(rows, 0.0)], 0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(combined))
        weights = self.discriminator.trainable_weights
        self.d_optimizer.apply_gradients(zip(tape.gradient(d_loss, weights), weights))
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(tf.zeros((rows, 1)),
                                  self.discriminator(self.generator(self.latent(rows))))
        weights = self.generator.trainable_weights
        self.g_optimizer.apply_gradients(zip(tape.gradient(g_loss, weights), weights))
        self.d_loss.update_state(d_loss)
        self.g_loss.update_state(g_loss)
        return {"d_loss": self.d_loss.result(), "g_loss": self.g_loss.result()}


class BatchLogs(keras.callbacks.Callback):
    """The accuracy in the logs of every training batch (what progress bars show)."""

    def __init__(self):
        super().__init__()
        self.accuracy = []

    def on_train_batch_end(self, batch, logs=None):
        self.accuracy.append(float(logs["accuracy"]))


def cnn(augmenting: bool = False) -> keras.Model:
    augmentation = [
        keras.layers.RandomRotation(0.2), keras.layers.RandomZoom(0.2),
        keras.layers.RandomTranslation(0.1, 0.1), keras.layers.RandomContrast(0.3),
        keras.layers.RandomBrightness(0.2, value_range=(-4, 4))] if augmenting else []
    return keras.Sequential([
        keras.Input((8, 8, 1)), *augmentation, keras.layers.Conv2D(6, 3, activation="relu"),
        keras.layers.MaxPooling2D(), keras.layers.Flatten(),
        keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)])


def stateful_lstm(rows: int = STATEFUL_BATCH) -> keras.Model:
    return keras.Sequential([
        keras.Input(batch_shape=(rows, 8, 8, 1)),
        keras.layers.Reshape((8, 8)), keras.layers.LSTM(6, stateful=True), keras.layers.Dense(3)])


class Retrieval(keras.Model):
    """A two-tower retrieval model trained with in-batch negatives: a query's positive is the
    item of its own row, its negatives every other item of the global batch, gathered from
    every rank with ``all_gather`` (whose gradient reaches each rank's item tower)."""

    def __init__(self):
        super().__init__()
        self.flatten = keras.layers.Flatten()
        self.query = keras.layers.Dense(8)
        self.item = keras.layers.Dense(8)

    def call(self, x):
        return self.query(self.flatten(x[:, :4])), self.item(self.flatten(x[:, 4:]))

    def train_step(self, data):
        x, _ = data
        context = tf.distribute.get_replica_context()
        with tf.GradientTape() as tape:
            queries, items = self(x)
            rows = tf.shape(queries)[0]
            first = tf.reduce_sum(  # this rank's rows' place in the global batch
                context.all_gather(tf.reshape(rows, [1]), 0)[:context.replica_id_in_sync_group])
            logits = tf.matmul(queries, context.all_gather(items, 0), transpose_b=True)
            loss = tf.nn.compute_average_loss(tf.nn.sparse_softmax_cross_entropy_with_logits(
                first + tf.range(rows), logits), global_batch_size=GLOBAL_BATCH)
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables),
                             self.trainable_variables)
        return {"retrieval_loss": loss}


def weights_of(model) -> np.ndarray:
    return np.concatenate([v.numpy().ravel() for v in model.weights])


def run_retrieval(strategy, x, y, out: str) -> None:
    with strategy.scope():
        model = Retrieval()
        model(x[:1])
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9))
    initial = weights_of(model)
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    np.savez(out, weights=weights_of(model), initial=initial)


def run_gan(strategy, x, out: str) -> None:
    with strategy.scope():
        model = GAN()
        model.compile(keras.optimizers.Adam(0.002), keras.optimizers.Adam(0.002))
    history = model.fit(x, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    np.savez(out, weights=weights_of(model), d_loss=history.history["d_loss"],
             g_loss=history.history["g_loss"])


def run_on_batch(strategy, x, y, out: str, mismatch: bool) -> None:
    with strategy.scope():
        model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                                  keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dropout(0.3), keras.layers.Dense(3)])
        model.compile(keras.optimizers.Adam(0.01),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    if mismatch:  # each rank its own rows, as a Horovod script passes its shard's batches
        try:
            model.train_on_batch(x[tp.rank():tp.rank() + ON_BATCH], y[tp.rank():][:ON_BATCH])
        except ValueError as e:
            return np.savez(out, message=str(e))
        return np.savez(out, message="")
    rng, logs = np.random.default_rng(5), []  # seeded alike on every rank
    for step in range(12):
        rows = rng.integers(0, ROWS, ON_BATCH)
        weights = {"class_weight": {0: 1.0, 1: 2.0, 2: 0.5}} if step % 2 else {}
        logs.append(model.train_on_batch(x[rows], y[rows], return_dict=True, **weights))
    tested = model.test_on_batch(x[:ON_BATCH], y[:ON_BATCH], return_dict=True)
    evaluated = model.evaluate(x[:ON_BATCH], y[:ON_BATCH], batch_size=ON_BATCH, verbose=0,
                               return_dict=True)
    np.savez(out, weights=weights_of(model), loss=[log["loss"] for log in logs],
             accuracy=[log["accuracy"] for log in logs],
             evaluation=[tested["loss"], tested["accuracy"]],
             evaluated=[evaluated["loss"], evaluated["accuracy"]],
             predictions=model.predict_on_batch(x[:ON_BATCH]),
             predicted=model.predict(x[:ON_BATCH], batch_size=ON_BATCH, verbose=0))


def run(strategy, config: str, out: str) -> None:
    x, y = data()
    keras.utils.set_random_seed(21)
    if config.endswith("-keras"):
        strategy = tf.distribute.get_strategy()
    if config == "retrieval":
        return run_retrieval(strategy, x, y, out)
    if config.startswith("gan"):
        return run_gan(strategy, x, out)
    if config.startswith("on-batch"):
        if config == "on-batch-easgd":
            strategy = tp.PoseidonStrategy(algorithm=tp.algorithms.EASGD(tau=2))
        return run_on_batch(strategy, x, y, out, mismatch=config == "on-batch-mismatch")
    if config == "stateful-rank-batch":
        with strategy.scope():
            model = stateful_lstm(STATEFUL_BATCH // tp.size())
            model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        try:
            model.fit(x, y, batch_size=STATEFUL_BATCH, epochs=1, shuffle=False, verbose=0)
        except ValueError as e:
            return np.savez(out, message=str(e))
        return np.savez(out, message="")
    stateful = config == "stateful"
    batch = STATEFUL_BATCH if stateful else GLOBAL_BATCH
    with strategy.scope():
        model = (GuideModel(batchnorm=config == "guide-bn", draws=config == "guide-draws")
                 if config.startswith("guide")
                 else stateful_lstm() if stateful
                 else cnn(augmenting=config.startswith("augmenting-layers")))
        optimizer = (keras.optimizers.SGD(0.1, momentum=0.9) if config.startswith("guide")
                     else keras.optimizers.Adam(0.01))
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"], jit_compile=config.endswith("xla"))
    batches = BatchLogs()
    if config.startswith("cnn-augmented"):
        flip = keras.layers.RandomFlip("horizontal", seed=3)
        inputs = {"x": tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH).map(
            lambda images, labels: (flip(images, training=True), labels)).map(
            lambda images, labels: (2.0 * images, labels)).prefetch(2)}
    else:
        inputs = {"x": x, "y": y, "batch_size": batch}
    history = model.fit(**inputs, epochs=2, shuffle=False, verbose=0, callbacks=[batches])
    evaluation = model.evaluate(x, y, batch_size=batch, verbose=0, return_dict=True)
    predicted = x[:2 * batch] if stateful else x[:97]
    predictions = model.predict(predicted, batch_size=batch, verbose=0)
    served = []
    if stateful:
        exported = os.path.join(os.path.dirname(out), "stateful_export")
        model.export(exported)  # every rank: rank 0 writes, the others wait for it
        if tp.rank() == 0:
            loaded = tf.saved_model.load(exported)  # holds the variables serve reads
            served = [loaded.serve(x[:batch]).numpy() for _ in range(2)]
    norm = getattr(model, "norm", None)
    np.savez(out, weights=weights_of(model), loss=history.history["loss"],
             accuracy=history.history["accuracy"],
             unscaled_loss=history.history.get("unscaled_loss", []),
             evaluation=[evaluation["loss"], evaluation["accuracy"]], predictions=predictions,
             batch_accuracy=batches.accuracy,
             non_trainable=np.concatenate([v.numpy().ravel()
                                           for v in model.non_trainable_weights] or [[]]),
             moving_mean=norm.moving_mean.numpy() if norm is not None else [],
             own_predictions=[] if stateful else model(predicted, training=False),
             states=np.concatenate([v.numpy() for v in model.layers[1].states], 1)
             if stateful else [], served=served)


def main(out: str, configs: str) -> None:
    strategy = tp.PoseidonStrategy()
    for config in configs.split(","):
        run(strategy, config, os.path.join(out, f"{config}_rank{tp.rank()}.npz"))


if __name__ == "__main__":
    main(*sys.argv[1:3])
