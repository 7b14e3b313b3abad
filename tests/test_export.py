"""tp.export_for_serving: the TF Serving layout, named signature, stock ops only, atomic writes.

A real P=2 job (tests/workers/export_model.py) trains and exports; the export is then read
as TF Serving would: its op types are checked against the ops a plain TensorFlow has, and it is
run in fresh processes by ``tf.saved_model.load`` and by ``saved_model_cli run``, whose outputs
must equal the job's ``model.predict``. The rest runs here, in a single process without a
strategy (plain Keras).
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2

from multirank import WORKERS, check, job_env, run_job
from tf_poseidon.export import atomic_path, export_for_serving

DENIED_OPS = {"PyFunc", "PyFuncStateless", "EagerPyFunc"}
CUSTOM_OP_PREFIX = "Poseidon"  # kernels/poseidon_ops.cc: PoseidonPack, PoseidonUnpack, ...
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("export")
    check(run_job(2, "export_model.py", str(out))[0])
    return out


def read_saved_model(version_dir):
    saved_model = saved_model_pb2.SavedModel()
    with open(os.path.join(version_dir, "saved_model.pb"), "rb") as f:
        saved_model.ParseFromString(f.read())
    return saved_model


def op_types(meta_graph) -> set[str]:
    """Every op type in the graph and its function library (calls of library functions aside)."""
    library = meta_graph.graph_def.library.function
    ops = {node.op for node in meta_graph.graph_def.node}
    ops |= {node.op for function in library for node in function.node_def}
    return ops - {function.signature.name for function in library}


@pytest.mark.multirank
def test_only_rank0_writes_versions(exported):
    assert os.listdir(exported / "rank1") == []
    export = exported / "rank0" / "export"
    assert sorted(os.listdir(export), key=int) == ["1", "2", "10"]
    for version in ("1", "2", "10"):
        assert (export / version / "saved_model.pb").is_file()
        assert (export / version / "variables" / "variables.index").is_file()
    for rank in (0, 1):
        with open(exported / f"result_rank{rank}.json") as f:
            result = json.load(f)
        assert result["paths"] == [os.path.join("export", v) for v in ("1", "2", "10")]
        # Rank 0 raises the real error; the others learn that rank 0 failed.
        assert result["errors"] == (["FileExistsError", "NotADirectoryError"] if rank == 0
                                    else ["RuntimeError", "RuntimeError"])


@pytest.mark.multirank
def test_signature_names_and_batch_dimension(exported):
    saved_model = read_saved_model(exported / "rank0" / "export" / "1")
    (meta_graph,) = saved_model.meta_graphs
    assert list(meta_graph.meta_info_def.tags) == ["serve"]
    signature = meta_graph.signature_def["serving_default"]
    assert signature.method_name == "tensorflow/serving/predict"
    assert set(signature.inputs) == {"features", "context"}
    assert set(signature.outputs) == {"logits", "score"}
    dims = {name: [d.size for d in info.tensor_shape.dim]
            for part in (signature.inputs, signature.outputs) for name, info in part.items()}
    assert dims == {"features": [-1, 12], "context": [-1, 3], "logits": [-1, 3], "score": [-1, 1]}


@pytest.mark.multirank
def test_only_stock_tensorflow_ops(exported):
    (meta_graph,) = read_saved_model(exported / "rank0" / "export" / "1").meta_graphs
    ops = op_types(meta_graph)
    assert {"MatMul", "RestoreV2"} <= ops  # the scan sees the model and the loader
    assert not ops & DENIED_OPS
    assert not [op for op in ops if op.startswith(CUSTOM_OP_PREFIX)]
    assert [op for op in ops if not hasattr(tf.raw_ops, op)] == []


def assert_outputs_match(exported, outputs_by_name):
    predictions = np.load(exported / "predictions.npz")
    assert set(outputs_by_name) == set(predictions.files)
    for name in predictions.files:
        difference = float(np.max(np.abs(outputs_by_name[name] - predictions[name])))
        assert difference <= TOLERANCE, f"{name}: max |difference| {difference:.3g}"


@pytest.mark.multirank
def test_saved_model_load_in_fresh_process(exported, tmp_path):
    out = tmp_path / "outputs.npz"
    subprocess.run([sys.executable, os.path.join(WORKERS, "export_load.py"),
                    str(exported / "rank0" / "export" / "2"), str(exported / "inputs.npz"),
                    str(out)], env=job_env(), check=True, timeout=300)
    assert_outputs_match(exported, dict(np.load(out)))


@pytest.mark.multirank
def test_saved_model_cli_run(exported, tmp_path):
    cli = os.path.join(os.path.dirname(sys.executable), "saved_model_cli")
    inputs = exported / "inputs.npz"
    result = subprocess.run(
        [cli, "run", "--dir", str(exported / "rank0" / "export" / "10"), "--tag_set", "serve",
         "--signature_def", "serving_default",
         "--inputs", f"features={inputs}[features];context={inputs}[context]",
         "--outdir", str(tmp_path)],
        env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    assert result.returncode == 0, result.stdout.decode(errors="replace")[-3000:]
    assert_outputs_match(exported, {name: np.load(tmp_path / f"{name}.npy")
                                    for name in ("logits", "score")})


# -- one process, plain Keras ---------------------------------------------------------------

@pytest.fixture(scope="module")
def sequential():
    return keras.Sequential([keras.Input((4,), name="measurements"),
                             keras.layers.Dense(2, name="probabilities")])


def test_versions_count_up_and_are_never_overwritten(tmp_path, sequential):
    export = tmp_path / "export"
    assert export_for_serving(sequential, export) == os.path.join(export, "1")
    assert export_for_serving(sequential, str(export), version=5) == os.path.join(export, "5")
    stale = export / ".tp-tmp-4242-6"  # left by a writer killed while exporting version 6
    stale.mkdir()
    (export / "notes").mkdir()
    assert export_for_serving(sequential, export) == os.path.join(export, "6")
    assert sorted(os.listdir(export)) == ["1", "5", "6", "notes"]
    with pytest.raises(FileExistsError, match="already exists"):
        export_for_serving(sequential, export, version=5)
    signature = read_saved_model(export / "6").meta_graphs[0].signature_def["serving_default"]
    assert (set(signature.inputs), set(signature.outputs)) == ({"measurements"},
                                                               {"probabilities"})


def test_bad_arguments(tmp_path, sequential):
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError, match="not a directory"):
        export_for_serving(sequential, tmp_path / "file")
    for version in (0, -1, True, "1", 1.0):
        with pytest.raises(ValueError, match="version"):
            export_for_serving(sequential, tmp_path / "export", version=version)
    with pytest.raises(TypeError, match="keras.Model"):
        export_for_serving(keras.layers.Dense(2), tmp_path / "export")
    with pytest.raises(ValueError, match="not built"):
        export_for_serving(keras.Sequential([keras.layers.Dense(2)]), tmp_path / "export")

    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)
    subclassed = Subclassed()
    subclassed(np.zeros((1, 4), "float32"))
    with pytest.raises(ValueError, match="Functional or Sequential"):
        export_for_serving(subclassed, tmp_path / "export")
    assert not (tmp_path / "export").exists()


def test_atomic_path_keeps_the_old_file_when_the_writer_fails(tmp_path):
    target = tmp_path / "model.keras"
    target.write_text("old")
    (tmp_path / ".tp-tmp-1-model.keras").write_text("killed mid-write")
    (tmp_path / ".tp-tmp-1-other.keras").write_text("another target's")
    with pytest.raises(RuntimeError):
        with atomic_path(str(target)) as temp:
            assert os.path.dirname(temp) == str(tmp_path) and temp.endswith("model.keras")
            with open(temp, "w") as f:
                f.write("half")
            raise RuntimeError("writer failed")
    assert target.read_text() == "old"
    with atomic_path(str(target)) as temp:
        with open(temp, "w") as f:
            f.write("new")
    assert target.read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == [".tp-tmp-1-other.keras", "model.keras"]


def test_op_scan_sees_py_functions(tmp_path):
    # The scan of test_only_stock_tensorflow_ops would catch a numpy_function in the export.
    module = tf.Module()
    module.serve = tf.function(lambda x: tf.numpy_function(np.negative, [x], tf.float32),
                               input_signature=[tf.TensorSpec([None], tf.float32)])
    tf.saved_model.save(module, str(tmp_path))
    (meta_graph,) = read_saved_model(tmp_path).meta_graphs
    assert "PyFunc" in op_types(meta_graph)
