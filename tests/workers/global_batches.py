"""A keras.utils.PyDataset of global batches, as a user's serves them to every rank: the test
workers' PyDataset input (model_zoo.py, shuffle_ids.py)."""

import keras


class GlobalBatches(keras.utils.PyDataset):
    """``(x, y)`` in global batches of ``batch`` rows, in order (the last one smaller where
    ``batch`` does not divide the rows), fetched by ``workers`` threads."""

    def __init__(self, x, y, batch: int, workers: int = 1):
        super().__init__(workers=workers)
        self.x, self.y, self.batch = x, y, batch

    def __len__(self):
        return -(-len(self.x) // self.batch)

    def __getitem__(self, index):
        rows = slice(index * self.batch, (index + 1) * self.batch)
        return self.x[rows], self.y[rows]
