"""The file names of an adapter directory (spec/50), spelled here and nowhere else.

An adapter is the registry directory ``<registry>/<name>``, holding

* ``CONFIG_FILE`` and ``WEIGHTS_FILE``: the PEFT config and weights (``SERVING_FILES``, all a plain PEFT adapter has);
* ``RECEIPT_FILE``: the train receipt, when Kiln trained it (alone, it is the record of an attempt that published
  no weights);
* ``MANIFEST_FILE``: the adapter manifest binding the serving files and the receipt by digest;
* ``CANARY_FILE``: the serving canary's status, once the server checked it;
* ``SIGNATURE_FILE``: an OpenSSF model-signing signature over the directory's files, once someone signed it
  (``kiln.adapters.signing``).

The names live at the bottom of the artifact layer because rules below the registry module need them (the manifest
never names itself, a restore receipt lists what it copied, the lineage audit hashes a parent's weights, the
checkpoint loader tells an adapter from a checkpoint). Everything else about the directory -- reading it, binding it,
publishing, demoting, deleting and restoring it -- belongs to ``kiln.adapters``, which exports these names too.
"""

from __future__ import annotations

__all__ = [
    "CANARY_FILE",
    "CONFIG_FILE",
    "MANIFEST_FILE",
    "RECEIPT_FILE",
    "SERVING_FILES",
    "SIGNATURE_FILE",
    "WEIGHTS_FILE",
]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
RECEIPT_FILE = "train_receipt.json"
MANIFEST_FILE = "adapter_manifest.json"
CANARY_FILE = "adapter_canary_status.json"
SIGNATURE_FILE = "model.sig"  # model_signing's own default name, so its CLI finds it
SERVING_FILES = (CONFIG_FILE, WEIGHTS_FILE)
