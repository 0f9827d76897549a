"""One module per artifact: strict ``load_*``, canonical atomic ``write_*``, ``verify_*``.

Importing this package registers every semantic rule of the schemas.
"""

from __future__ import annotations

__all__: list[str] = []
