"""The zoo: recipes for the small models trained in this repository, and their measurements.

Shipped checkpoints live in sub-directories named after their recipe (e.g. ``toy-moe-2l/``).
"""
