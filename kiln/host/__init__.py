"""The host layer: the file system and the configuration Kiln finds on the machine.

``fs``      crash-atomic and exclusive writes, staged directories published by one rename, the registry name rule
            (``name_problem``), ``within_roots``, ``unsafe_path_problem``, ``writable_problem`` -- below everything
``config``  the one resolver of flags > ``KILN_<SECTION>_<FIELD>`` > ``kiln.toml`` > the schema's defaults
            (``resolve_settings``), shared by the server and the command line -- above the contract layer
"""

from __future__ import annotations

__all__ = ["config", "fs"]
