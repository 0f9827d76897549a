"""Schema-to-code generator: ``python -m codegen [--check]``.

Reads the hand-written JSON Schemas in ``schemas/`` and writes ``generated/kiln_contracts/``:

* ``models/*.py``  pydantic v2 models (datamodel-code-generator), one module per schema file;
* ``bundle.json``  every definition of every schema file in one self-contained document
  (cross-file ``$ref`` rewritten to local ones) -- the strict/writer validator source;
* ``bundle_reader.json`` the same with the train receipt's own objects opened for readers;
* ``entrypoints.json`` the loadable documents: definition, schema file, type tag;
* ``openapi.json`` the OpenAPI 3.1 document of the HTTP routes.

Nothing here imports ``kiln``.
"""
