"""Static check of hlopass's door to JAX's internals against every supported JAX version's API.

hlopass reaches into ``jax._src`` through one module, ``hlopass/internals.py`` (the door). JAX changes those internals
between releases, so each supported version's API is kept here as a manifest (``manifests/jax-X.Y.Z.json``, made
from the sources with ``ast`` by ``generate.py``, committed so the check needs no JAX sources), and ``check.py``
verifies the door against all of them: imported modules and names, attribute chains on module aliases, call
arguments against signatures, attributes read on JAX objects (``ATTRIBUTES_READ``/``ATTRIBUTES_OPTIONAL``),
feature checks (``getattr``/``hasattr``/``_optional``: present in at least one version, else dead code) and
primitive names. The door's conventions are in ``check.py``'s docstring.

Run: ``python -m tools.jax_api.check [--door hlopass/internals.py]`` (exit 1 on problems);
tests: ``pytest tests/tools/test_jax_api.py``.

Add a version (e.g. when widening ``jax>=0.10,<0.12`` in pyproject.toml): regenerate its manifest with
``python -m tools.jax_api.generate SRC --out tools/jax_api/manifests/jax-X.Y.Z.json`` (SRC: site-packages,
a jax/ folder or an sdist tarball; exact commands in ``generate.py``'s docstring), commit it, and run the tests:
the check then covers the new version, and the tests check the installed version's manifest against the installed
JAX (names, signatures, primitives) and that regenerating it reproduces the committed file. Drop a version by
deleting its manifest.
"""
