"""Worker for the SFB save test: loads a model saved after SFB training, in a fresh process
without tf_poseidon, and prints one JSON line: the layers' classes (module.name), whether the
saved config mentions tf_poseidon, and the loaded weights' checksum.

    sfb_load.py MODEL.keras
"""

import json
import os
import sys
import zipfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402


def main():
    path = sys.argv[1]
    with zipfile.ZipFile(path) as archive:
        config_text = archive.read("config.json").decode()
    model = keras.models.load_model(path)
    report = {
        "classes": [f"{type(layer).__module__}.{type(layer).__name__}"
                    for layer in model.layers],
        "call_is_keras": all(type(layer).call.__module__.startswith("keras.")
                             for layer in model.layers),
        "config_mentions_tf_poseidon": "tf_poseidon" in config_text,
        "tf_poseidon_imported": "tf_poseidon" in sys.modules,
        "weights_sum": float(sum(np.abs(w).sum() for w in model.get_weights())),
    }
    print("REPORT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
