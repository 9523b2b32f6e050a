"""Phase 3, plan: one tile plan per loop (tile size from a byte budget, the weight-gradient
schedule), computed once per shape and asked by both the report and the tile loop.
"""
