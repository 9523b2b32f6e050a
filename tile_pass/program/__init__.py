"""Phase 2, program: the region as a row-wise program (the IR), its registry and interpreter,
the per-token layouts between the user's shapes and the tiles' rows, and the token weights
derived from the region's scalar loss.
"""
