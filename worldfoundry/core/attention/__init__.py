"""Attention numerics: attention providers, explicit SDPA backends, fused/packed projections and static K/V caching.

* :mod:`.providers` — the attention provider contract (capabilities, numerics class, probe, SDPA-signature callable).
* :mod:`.builtin_providers` — the PyTorch SDPA backends as providers (``sdpa``, ``sdpa_flash``, ...).
* :mod:`.provider_registry` — providers by name, discovered from the ``worldfoundry.attention_providers`` entry point.
* :mod:`.provider_dispatch` — per-call routing of one attention module's SDPA calls to providers.

* :mod:`.sdpa_backends` — run SDPA with exactly one PyTorch backend, failing with a typed error otherwise.
* :mod:`.packed_storage` — pack Linears reading one input into one storage (shared or derived copy).
* :mod:`.fused_projection` — one GEMM on the packed weight, split; exact by per-geometry verification.
* :mod:`.packed_projection` — the same as a plain callable serving diffusers' fused-projection branch
  (``attn.to_qkv``), with the member checks done once per model forward.
* :mod:`.static_kv_cache` — request-scoped cache of projections of a constant conditioning.
* :mod:`.fingerprints` — identity/version keys that say when a derived tensor is stale.
"""

from __future__ import annotations
