"""Phase 4, splice: the matched region replaced by one call of the tiled op, in named steps;
logits the graph also returns are handed back exactly.
"""
