"""The machinery of ``pargrad.capture`` (docs/capture.md): record a step once, replay it
as straight-line kernel calls.

- recorder.py: what a first call notes while ``fn`` runs, and what makes it
  unreplayable (imported by the modules that make tensors, so it imports none of them);
- program.py: a recording made into a program: the forward replayed, cut into segments;
- backward.py: a segment's backward, and ``CapturedBackward``, its node in the graph;
- source.py: generated code, once a recording is replayed;
- step.py: ``capture(fn)``: guards, the cache of variants, ``stats``, the fallback.

This package's ``__init__`` imports nothing, so that the modules below tensor.py can
import the recorder; ``pargrad.capture`` is step.py's ``capture``.
"""
