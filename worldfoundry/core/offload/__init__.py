"""Block offloading: host masters, a per-request resident set, two event-synchronised slots, the estimator.

Not model-specific: the engine takes ``(path, module)`` pairs of blocks; the acceleration that drives it
lives in its own distribution (see the project's plugin docs).
"""
