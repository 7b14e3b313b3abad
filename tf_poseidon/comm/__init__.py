"""Communication: the engine thread that owns MPI, the graph ops that feed it, buckets."""
