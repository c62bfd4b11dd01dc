"""Block offloading: host masters, a per-request resident set, two event-synchronised slots, the estimator.

Not model-specific: the engine takes ``(path, module)`` pairs of blocks. See ``docs/resident_blocks.md``.
"""
