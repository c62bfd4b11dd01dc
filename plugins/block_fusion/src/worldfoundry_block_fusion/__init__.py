"""``wan_block_fusion`` and ``sana_block_fusion``: Triton pointwise fusion of DiT blocks, bitwise to eager.

Numerics live in :mod:`worldfoundry.core.fusion`; this package holds the options, the replacement block forwards
and processors (:mod:`.wan_block`, :mod:`.sana_block`), the handle and receipts (:mod:`.handle`) and the two
registrations (:mod:`.wan_plugin`, :mod:`.sana_plugin`).
"""
