"""Phase 5, tiles: the tile loop and the custom ops around it, the traced tile function (its
gradient derived by make_fx of autograd.grad), and the post-trace passes on it.
"""
