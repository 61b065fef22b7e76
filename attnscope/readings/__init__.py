"""Readings of a result: what a head does (statistics and kinds), a mask as a grid, a mask in other libraries' words."""
