"""Klique's unit of GPU: 1/840 of one. Every size and capacity, on the plane and in the agents, is a whole
number of these units.

840 is the least common multiple of 1..8, so halves, thirds, quarters, fifths, sixths, sevenths (MIG
slices of a 7-slice GPU), eighths and tenths are all whole numbers of units: no float ever drifts.
"""

UNITS_PER_GPU = 840
