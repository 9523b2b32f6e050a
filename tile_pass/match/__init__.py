"""Phase 1, match: find an LM-head projection and the row-wise region that reads its logits.

Every fact about an op lives in one place (:mod:`tile_pass.program._op_facts`, the IR's
vocabulary), registered next to its rule (:mod:`._rules`, by op family); :mod:`._region_match`
walks the graph with them and proves a region row-wise, in phases (one module each:
:mod:`._walk`, :mod:`._selections`, :mod:`._partners`, :mod:`._sharding`, :mod:`._scalar_loss`,
:mod:`._build`) that share one :class:`._matcher.RegionMatcher`.
"""
