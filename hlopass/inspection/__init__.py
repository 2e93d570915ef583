"""Inspection tools built on the engine: ``explain``, dumps, drawings, liveness, the
``hlopass-dump`` command line and the demo. Nothing in the engine or the passes imports them."""
