"""Kiln contract conformance suite.

* ``cases/*.json``      data cases ``{description, rule, type, instance, valid, error_code, pointer?, mode?}``
                        run through the real strict loaders (``test_cases.py``);
* ``test_properties.py`` hypothesis-jsonschema properties per entry point;
* ``test_number_spellings.py`` the same instances with their numbers respelt: both layers agree and
  load the canonical form (``docs/contracts.md``, "Numbers");
* ``python -m conformance PATH`` validates every Kiln document under PATH, so another
  implementation can test its own output;
* ``python -m conformance.make_cases`` regenerates the schema-mutation case files from the
  examples in ``schemas/``.
"""

from __future__ import annotations

__all__: list[str] = []
